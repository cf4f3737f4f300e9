"""A request's output as it grows: sampled ids in, streamed text and the stop decision out.

The shapes are vLLM's: a `RequestOutput` (the prompt, and what is known of the request as a whole)
holds one `CompletionOutput` per generated sequence in `outputs` (several with `n` > 1). Every
sequence, whether run alone or in a continuous batch, turns its sampled tokens into text the same
way and stops by the same rules:
- a stop token (the model's EOS ids unless `ignore_eos`, plus the request's `stop_token_ids`) ends
  it with reason "stop"; the token is kept in the ids but adds no text; `stop_reason` is the id for a
  `stop_token_ids` id, None for EOS;
- a stop string ends it with reason "stop" and `stop_reason` the string; the text is cut where the
  string begins (after it with `include_stop_str_in_output`); before `min_tokens` tokens are out,
  stop strings are not looked for (and stop ids cannot come: the sampler masks them);
- its output budget (`max_tokens`, within the model's length limit) ends it with reason "length".
Text is streamed as it becomes final: the incremental detokenizer never yields half a UTF-8
character, and text that could still turn out to be the start of a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from numba_vllm.engine.logprobs import Logprob  # at run time: msgspec rebuilds logprobs from these annotations
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from numba_vllm.model.config import ModelConfig


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`); a request with `n` > 1 has n."""

    index: int  # its place among the request's sequences (0 .. n-1)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # None: logprobs were not requested
    logprobs: list[dict[int, Logprob]] | None = None  # one per token of token_ids; None: logprobs were not requested
    finish_reason: str | None = None  # "stop" (stop token or string), "length", "abort", or "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it; None for EOS or a limit

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request (vLLM's `RequestOutput`): its prompt and, in `outputs`, its sequences so far."""

    request_id: str
    prompt: str | None  # the text given, or None for a prompt given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # in order of index
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token (None for the first);
    # None: prompt logprobs were not requested
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (set with the first token)
    error: str | None = None  # the request failed (its sequences end with "error"): what failed, one line

    @property
    def finished(self) -> bool:
        """Every sequence has ended."""
        return all(c.finish_reason is not None for c in self.outputs)


class OutputBuilder:
    """Feeds one sequence's sampled tokens through stop checks and detokenization."""

    def __init__(
        self,
        output: RequestOutput,
        completion: CompletionOutput,
        params: SamplingParams,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        max_new_tokens: int,
        detokenize: bool = True,
    ):
        """`completion`: the sequence of `output` this builder fills; `max_new_tokens`: its output
        budget (`LengthPolicy.max_new_tokens`). With `detokenize` False only the ids and the stops on
        ids and length are kept (a server's engine core: its front end builds the text)."""
        self.output = output
        self.completion = completion
        self.max_new_tokens = max_new_tokens
        self.eos_ids: set[int] = set()
        if not params.ignore_eos:
            self.eos_ids.update(config.eos_token_ids)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                self.eos_ids.add(tokenizer.eos_token_id)
        self.stop_ids = set(params.stop_token_ids)
        detokenize = detokenize and tokenizer is not None  # without text there are no stop strings either
        self.detok = None
        if detokenize:
            self.detok = IncrementalDetokenizer(tokenizer, output.prompt_token_ids, params.skip_special_tokens)
        self.held = _StopStringFilter(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens

    def add(self, token: int, stop: bool = False) -> str:
        """Append one sampled token; return the text that became final (sets finish_reason when done).
        `stop`: the sequence ends with this token (its structured-output grammar is complete)."""
        out = self.completion
        out.token_ids.append(token)  # a stop token is kept in the ids, never in the text
        delta = ""
        if token in self.eos_ids or token in self.stop_ids:
            out.finish_reason = "stop"
            out.stop_reason = None if token in self.eos_ids else token
        elif self.detok is not None:
            delta, hit = self.held.push(self.detok.add(token), look=len(out.token_ids) >= self.min_tokens)
            if hit is not None:
                out.finish_reason, out.stop_reason = "stop", hit
        if stop and out.finish_reason is None:
            out.finish_reason = "stop"
        if out.finish_reason is None and len(out.token_ids) >= self.max_new_tokens:
            out.finish_reason = "length"
        if out.finish_reason is not None:
            delta += self._flush()
        out.text += delta
        return delta

    def abort(self) -> None:
        if self.completion.finish_reason is None:
            self.completion.finish_reason = "abort"

    def fail(self, error: str) -> None:
        """End the sequence because its step failed; the text streamed so far stays."""
        self.completion.finish_reason = "error"
        self.output.error = error

    def _flush(self) -> str:
        """Text still held back once the sequence is over (not after a stop string)."""
        if self.detok is None or self.held.hit is not None:
            return ""
        tail, hit = self.held.push(self.detok.flush())  # bytes still waiting for their UTF-8 sequence
        if hit is not None:
            self.completion.finish_reason, self.completion.stop_reason = "stop", hit
        return tail + self.held.flush()


class _StopStringFilter:
    """Holds back streamed text that might be the start of a stop string; cuts at a full match."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        """`include_stop`: the text found ends after the stop string, not before it."""
        self.stops = stops
        self.include_stop = include_stop
        self.pending = ""
        self.hit: str | None = None  # the stop string found

    def push(self, text: str, look: bool = True) -> tuple[str, str | None]:
        """Add text; return (text now safe to emit, the stop string found or None). Without `look`
        (before min_tokens) no stop string is looked for: everything is emitted."""
        if self.hit is not None:
            return "", self.hit
        self.pending += text
        if not self.stops or not look:
            out, self.pending = self.pending, ""
            return out, None
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.hit = min(found, key=lambda f: f[0])  # the match that begins first
            if self.include_stop:
                cut += len(self.hit)
            out, self.pending = self.pending[:cut], ""
            return out, self.hit
        keep = max(len(s) for s in self.stops) - 1  # the longest tail that could begin a stop string
        safe = len(self.pending) - keep
        if safe <= 0:
            return "", None
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
