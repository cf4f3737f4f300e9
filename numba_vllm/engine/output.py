"""A request's output as it grows: sampled ids in, streamed text and the stop decision out.

Every request, whether run alone or in a continuous batch, turns its sampled tokens into text the
same way and stops by the same rules:
- a stop token (the model's EOS ids unless `ignore_eos`, plus the request's `stop_token_ids`) ends
  it with reason "stop"; the token is kept in the ids but adds no text;
- a stop string ends it with reason "stop"; the text is cut where the string begins;
- its output budget (`max_tokens`, within the model's length limit) ends it with reason "length".
Text is streamed as it becomes final: the incremental detokenizer never yields half a UTF-8
character, and text that could still turn out to be the start of a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from numba_vllm.model.config import ModelConfig


@dataclass
class RequestOutput:
    """One request: what went in, what came out so far, and why it stopped (None while running)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (stop token or string), "length", "abort", or "error"
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (set with the first token)
    error: str | None = None  # with finish_reason "error": what failed (the step's exception, one line)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputBuilder:
    """Feeds one request's sampled tokens through stop checks and detokenization."""

    def __init__(
        self,
        output: RequestOutput,
        params: SamplingParams,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        max_new_tokens: int,
    ):
        """`max_new_tokens`: the request's output budget (`LengthPolicy.max_new_tokens`)."""
        self.output = output
        self.max_new_tokens = max_new_tokens
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(config.eos_token_ids)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                self.stop_ids.add(tokenizer.eos_token_id)
        self.detok = IncrementalDetokenizer(tokenizer, output.prompt_token_ids) if tokenizer is not None else None
        self.held = _StopStringFilter(params.stop)

    def add(self, token: int, stop: bool = False) -> str:
        """Append one sampled token; return the text that became final (sets finish_reason when done).
        `stop`: the request ends with this token (its structured-output grammar is complete)."""
        out = self.output
        out.token_ids.append(token)  # a stop token is kept in the ids, never in the text
        delta = ""
        if token in self.stop_ids:
            out.finish_reason = "stop"
        elif self.detok is not None:
            delta, hit = self.held.push(self.detok.add(token))
            if hit:
                out.finish_reason = "stop"
        if stop and out.finish_reason is None:
            out.finish_reason = "stop"
        if out.finish_reason is None and len(out.token_ids) >= self.max_new_tokens:
            out.finish_reason = "length"
        if out.finish_reason is not None:
            delta += self._flush()
        out.text += delta
        return delta

    def abort(self) -> None:
        self.output.finish_reason = "abort"

    def fail(self, error: str) -> None:
        """End the request because its step failed; the text streamed so far stays."""
        self.output.finish_reason = "error"
        self.output.error = error

    def _flush(self) -> str:
        """Text still held back once the request is over (not after a stop string)."""
        if self.detok is None or self.held.hit:
            return ""
        tail, hit = self.held.push(self.detok.flush())  # bytes still waiting for their UTF-8 sequence
        if hit:
            self.output.finish_reason = "stop"
        return tail + self.held.flush()


class _StopStringFilter:
    """Holds back streamed text that might be the start of a stop string; cuts at a full match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.hit = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text now safe to emit, whether a stop string was found)."""
        if self.hit:
            return "", True
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = max(len(s) for s in self.stops) - 1  # the longest tail that could begin a stop string
        safe = len(self.pending) - keep
        if safe <= 0:
            return "", False
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
