"""One generation request as the engine sees it: its tokens, its place in the batch and its pages.

A request moves WAITING -> RUNNING -> FINISHED_*; preemption sends it from RUNNING back to WAITING
(its pages are freed, its generated tokens kept, and it re-prefills them later). Everything the
scheduler needs to know about a request is a field here, so the scheduler keeps no side tables.

Token bookkeeping, for a request with prompt ``p`` and generated tokens ``o``:

- ``all_token_ids = p + o`` are the known tokens, ``num_tokens`` of them;
- the first ``num_computed_tokens`` of them have their K/V in the cache (in the pages ``page_ids``);
- while running, ``num_computed_tokens < num_tokens``: at least the last known token (the prompt's
  last, or the last sampled one) still has to go through the model, and doing so samples the next;
- with prefix caching, the first ``num_computed_tokens`` can come from pages another request
  computed: ``page_hashes`` names its full pages, so admission can find them (`prefix_cache.py`).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from numba_vllm.engine.logits_edits import LogitsEdits
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import GrammarMatcher


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # in the scheduler's queue (new, or preempted), holding no pages and no slot
    RUNNING = "running"  # holds a batch slot and pages; scheduled every step the budget allows
    FINISHED_STOPPED = "finished_stopped"  # hit an EOS id, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"  # hit max_tokens or the model length
    FINISHED_ABORTED = "finished_aborted"  # aborted by the caller
    FINISHED_ERROR = "finished_error"  # its step failed (the runner raised); the engine went on without it

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort"; "error" for a failed step), or None while not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # identity, not field equality: two requests are never "the same" by value
class Request:
    """A prompt, how to sample from it, and the state the scheduler keeps for it."""

    request_id: str
    prompt_token_ids: list[int]  # (num_prompt_tokens,)
    sampling_params: SamplingParams
    arrival_index: int  # 0, 1, 2, ... in the order the engine received requests
    output_token_ids: list[int | None] = field(default_factory=list)  # (num_output_tokens,) sampled so far; None:
    # sampled on the device by a step in flight, not on the host yet (overlapped scheduling)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens of all_token_ids whose K/V are in the cache
    page_ids: list[int] = field(default_factory=list)  # block table: page ids in token order
    slot: int | None = None  # batch slot while RUNNING, else None
    num_preemptions: int = 0  # times this request lost its pages and had to recompute
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its first full pages (prefix_cache.py)
    grammar: GrammarMatcher | None = None  # its structured-output constraint's parser state (structured.py), if any
    logits_edits: LogitsEdits | None = None  # its penalties, bias and masks, if its sampling params edit logits

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        try:  # plain ints, whatever integer type came in (NumPy ints from a tokenizer, say)
            prompt = [operator.index(t) for t in self.prompt_token_ids]
        except TypeError:
            raise ValueError(f"request {self.request_id}: prompt token ids must be integers") from None
        if not prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty (at least one token is needed)")
        if min(prompt) < 0:
            raise ValueError(f"request {self.request_id}: prompt token ids must be >= 0, got {min(prompt)}")
        self.prompt_token_ids = prompt

    # ---- token counts --------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The known tokens at positions ``start .. end - 1``, without building all_token_ids.

        Decode asks for one token every step, so this avoids copying the whole sequence each time.
        """
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"request {self.request_id}: positions {start}..{end} outside 0..{self.num_tokens}")
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    # ---- status --------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason: "stop", "length", "abort" or "error" once finished; None before."""
        return self.status.finish_reason
