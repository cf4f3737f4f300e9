"""What the engine is doing, as plain values: the one view of engine state for code outside the engine.

The server's metrics, the CLI's banner, the benchmarks and the examples read `LLMEngine.stats()`
instead of reaching into the scheduler and the page allocator, so those can change without
breaking their readers. An `EngineStats` is a frozen snapshot: taken on the thread that steps the
engine (the engine is not thread-safe), it can then be handed to any other thread and read there.

The counts are cheap (a few `len` calls) and the server takes them after every step. Per-request
detail (`running`, `waiting`) costs one small object per request, so it is built only when asked
for (`stats(requests=True)`): a `--verbose`-style display or a test, not every step of a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from numba_vllm.engine.request import Request
from numba_vllm.engine.scheduler import Scheduler

Phase = Literal["waiting", "prefill", "decode"]


@dataclass(frozen=True)
class RequestStats:
    """One unfinished request, between two steps."""

    request_id: str
    phase: Phase  # what its next step is: waiting for a slot, (re-)prefilling its known tokens, or decoding one
    slot: int | None  # batch slot while running; None while waiting
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far (kept across preemptions)
    num_computed_tokens: int  # leading known tokens whose K/V are in the cache
    num_pages: int  # KV-cache pages it holds (0 while waiting)
    num_preemptions: int  # times it lost its pages and had to recompute

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated."""
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between two steps. Pages are usable ones (the null page is never
    counted); `num_preemptions` and `num_steps` count over the engine's life."""

    num_running: int  # requests in batch slots
    num_waiting: int  # requests queued for a slot (new or preempted)
    num_free_slots: int
    num_pages: int  # usable KV-cache pages, PAGE_SIZE tokens each
    num_pages_used: int  # held by running requests
    num_pages_free: int
    num_preemptions: int  # requests that lost their pages and recomputed
    num_steps: int  # forward passes run (`LLMEngine.step` calls)
    max_model_len: int  # the longest a request may grow (prompt + output)
    running: tuple[RequestStats, ...] | None = None  # by slot; None unless asked for
    waiting: tuple[RequestStats, ...] | None = None  # in queue order (the next admitted first); None unless asked for
    num_failed_steps: int = 0  # steps whose runner raised (their requests finished with "error")

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable pages held by requests, 0..1."""
        return self.num_pages_used / self.num_pages


def collect_stats(
    scheduler: Scheduler, num_steps: int, num_preemptions: int, requests: bool = False, num_failed_steps: int = 0
) -> EngineStats:
    """The scheduler's state as an `EngineStats`; per-request detail only if ``requests``."""
    allocator = scheduler.allocator
    running = waiting = None
    if requests:
        running = tuple(_request_stats(r) for r in sorted(scheduler.running, key=lambda r: r.slot))
        waiting = tuple(_request_stats(r) for r in scheduler.waiting)
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_slots=scheduler.num_free_slots,
        num_pages=allocator.num_usable_pages,
        num_pages_used=allocator.num_allocated_pages,
        num_pages_free=allocator.num_free_pages,
        num_preemptions=num_preemptions,
        num_steps=num_steps,
        max_model_len=scheduler.max_model_len,
        running=running,
        waiting=waiting,
        num_failed_steps=num_failed_steps,
    )


def _request_stats(request: Request) -> RequestStats:
    return RequestStats(
        request_id=request.request_id,
        phase=_phase(request),
        slot=request.slot,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_pages=len(request.page_ids),
        num_preemptions=request.num_preemptions,
    )


def _phase(request: Request) -> Phase:
    """Decode when only the last known token, a generated one, is left to compute (as
    `ScheduledSequence.is_decode` says of a step); prefill while a prompt or a recompute is under way."""
    if request.slot is None:
        return "waiting"
    computed = request.num_computed_tokens
    return "decode" if computed == request.num_tokens - 1 and computed >= request.num_prompt_tokens else "prefill"
