"""Sampling parameters (vLLM's field names) and the host-side sampler.

`SamplingParams` says how one request picks its next tokens and when it stops. It is validated on
construction: a bad value raises `ValueError` with one line naming the field. Temperature 0 means
greedy (argmax), and so does any temperature below `MIN_TEMPERATURE`, as in vLLM: it is set to 0
here, once, so that the host and device samplers agree and neither divides by a tiny number (logits
/ 1e-310 overflow to inf and softmax turns NaN; / a float32 subnormal ties every large logit at inf).
Otherwise logits are divided by the temperature, cut to the `top_k` most likely tokens and then to
the smallest set whose probability reaches `top_p`, and one token is drawn with the request's own
random generator, so a `seed` reproduces the same text whatever else runs beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from numba_vllm.engine.structured import StructuredOutputsParams

MIN_TEMPERATURE = 1e-5  # lower temperatures mean greedy (vLLM's _SAMPLING_EPS); logits / 1e-5 stay finite in float64

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
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
    """The distribution `sample` draws from: (V,) f64 summing to 1, zero outside top-k / top-p."""
    z = logits.astype(np.float64) / params.temperature
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
