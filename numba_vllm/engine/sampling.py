"""Sampling parameters (vLLM's field names) and the host-side sampler.

`SamplingParams` says how one request picks its next tokens and when it stops. It is validated on
construction: a bad value raises `ValueError` with one line naming the field. Temperature 0 means
greedy (argmax), and so does any temperature below `MIN_TEMPERATURE`, as in vLLM: it is set to 0
here, once, so that the host and device samplers agree and neither divides by a tiny number (logits
/ 1e-310 overflow to inf and softmax turns NaN; / a float32 subnormal ties every large logit at inf).
Otherwise logits are divided by the temperature, cut to the `top_k` most likely tokens and then to
the smallest set whose probability reaches `top_p`, and one token is drawn with the request's own
random generator, so a `seed` reproduces the same text whatever else runs beside it.

Before temperature, the logits of a row are edited as vLLM does, in this order: `bad_words` and
`min_tokens` mask tokens (-inf), `logit_bias` is added, then the penalties: `repetition_penalty`
(transformers' rule, over prompt and output tokens: a positive logit is divided by it, a negative
one multiplied), `frequency_penalty` (times the token's count in the output) and `presence_penalty`
(once if the token is in the output) are subtracted. After temperature, `min_p` drops tokens whose
probability is below min_p times the most likely token's, then top-k and top-p. Rows that use none
of these cost nothing (`engine/logits_edits.py`, `kernels/logits_edits.py`). After the edits, a
row with `structured_outputs` has the tokens its grammar forbids set to -inf (`engine/structured.py`).

Logprobs (`logprobs`, `prompt_logprobs`: the top k, 0 <= k <= MAX_LOGPROBS, besides the chosen or
the prompt's own token) are vLLM's default kind: the log-softmax of the model's raw logits, before
any of the edits above and before temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from numba_vllm.engine.structured import StructuredOutputsParams

MIN_TEMPERATURE = 1e-5  # lower temperatures mean greedy (vLLM's _SAMPLING_EPS); logits / 1e-5 stay finite in float64
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit, vLLM's default)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most this (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values at most this (OpenAI's range)

@dataclass
class SamplingParams:
    """How to sample one request's tokens, and when to stop."""

    n: int = 1  # sequences to generate from the prompt (they share its KV pages; LLMEngine.add_request)
    temperature: float = 1.0  # 0 = greedy; below MIN_TEMPERATURE it is set to 0
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much probability
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) = all
    seed: int | None = None  # per-request random seed
    max_tokens: int | None = 16  # new tokens at most; None = until the model's length limit
    stop: list[str] = field(default_factory=list)  # strings that end the output (not included)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the output
    ignore_eos: bool = False  # keep going past the model's EOS ids
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 = off
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output; 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (before the penalties)
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    bad_words: list[str] = field(default_factory=list)  # words whose last token is masked when the rest matches
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in its text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    logprobs: int | None = None  # top logprobs of each output token (0 = the chosen token only)
    prompt_logprobs: int | None = None  # top logprobs of each prompt token (0 = the token's own only)
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            kind = type(self.structured_outputs).__name__
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {kind}")
        self._check_edits()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    def _check_edits(self) -> None:
        """Validate min_p, the penalties, logit_bias, min_tokens, bad_words and the two flags."""
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if abs(getattr(self, name)) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.isdigit():  # JSON object keys are strings
                    token = int(token)
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                _check_number("logit_bias", value)
                if abs(value) > MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
                bias[int(token)] = float(value)
            self.logit_bias = bias or None
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def edits_logits(self) -> bool:
        """Whether the row's logits are edited before sampling (penalties, bias, min_tokens, bad words)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
            or self.min_tokens or self.bad_words
        )  # fmt: skip

    def make_rng(self) -> np.random.Generator:
        """This request's own random generator (seeded if a seed was given)."""
        return np.random.default_rng(self.seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token id from one row of logits (V,) f32."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = sampling_probs(logits, params)
    return int(rng.choice(len(probs), p=probs))


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `sample` draws from: (V,) f64 summing to 1, zero outside min-p / top-k / top-p.

    `logits` are already edited (`logits_edits`); temperature, then min_p, top-k and top-p, as vLLM."""
    z = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:  # p_i >= min_p * p_max, i.e. z_i - z_max >= log(min_p)
        z = np.where(z - z.max() >= math.log(params.min_p), z, -np.inf)
    if 0 < params.top_k < len(z):
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        keep = cumulative - p[order] < params.top_p  # a token is kept if the mass before it is < top_p
        p_kept = np.zeros_like(p)
        p_kept[order[keep]] = p[order[keep]]
        p = p_kept / p_kept.sum()
    return p


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_number(name: str, x: object) -> None:
    if not isinstance(x, (int, float, np.floating, np.integer)) or isinstance(x, bool) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
