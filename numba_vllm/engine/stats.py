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
from numba_vllm.engine.scheduler import Scheduler, StepPlan

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
    page_ids: tuple[int, ...] | None = None  # its block table (pages in token order); None unless asked for

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated."""
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between two steps. Pages are usable ones (the null page is never
    counted); `num_preemptions`, `num_steps` and the prefix-cache queries and hits count over the
    engine's life. A page several requests share counts once in `num_pages_used`; a free page that
    still holds a cached prefix counts in `num_pages_free` (allocating it evicts the prefix)."""

    num_running: int  # requests in batch slots
    num_waiting: int  # requests queued for a slot (new or preempted)
    num_free_slots: int
    num_pages: int  # usable KV-cache pages, PAGE_SIZE tokens each
    num_pages_used: int  # held by running requests
    num_pages_free: int
    num_preemptions: int  # requests that lost their pages and recomputed
    num_steps: int  # forward passes run (`LLMEngine.step` calls)
    max_model_len: int  # the longest a request may grow (prompt + output)
    prefix_caching: bool  # whether requests reuse cached prefix pages (EngineConfig.enable_prefix_caching)
    num_cached_pages: int  # pages holding a reusable prefix, held or free (0 without prefix caching)
    num_prefix_cache_queries: int  # known tokens of admitted requests looked up in the prefix cache
    num_prefix_cache_hits: int  # of those, tokens found cached (their K/V reused, not recomputed)
    running: tuple[RequestStats, ...] | None = None  # by slot; None unless asked for
    waiting: tuple[RequestStats, ...] | None = None  # in queue order (the next admitted first); None unless asked for
    num_failed_steps: int = 0  # steps whose runner raised (their requests finished with "error")

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable pages held by requests, 0..1."""
        return self.num_pages_used / self.num_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up tokens found in the prefix cache, 0..1 (0 before any lookup)."""
        return self.num_prefix_cache_hits / self.num_prefix_cache_queries if self.num_prefix_cache_queries else 0.0


def collect_stats(
    scheduler: Scheduler, num_steps: int, num_preemptions: int, requests: bool = False, pages: bool = False,
    num_failed_steps: int = 0,
) -> EngineStats:
    """The scheduler's state as an `EngineStats`; per-request detail only if ``requests``, and each
    running request's page ids too if ``pages`` (a waiting request holds none: its tuple is empty)."""
    allocator = scheduler.allocator
    cache = scheduler.prefix_cache
    running = waiting = None
    if requests:
        running = tuple(_request_stats(r, pages) for r in sorted(scheduler.running, key=lambda r: r.slot))
        waiting = tuple(_request_stats(r, pages) for r in scheduler.waiting)
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
        prefix_caching=cache is not None,
        num_cached_pages=allocator.num_cached_pages,
        num_prefix_cache_queries=cache.num_queries if cache is not None else 0,
        num_prefix_cache_hits=cache.num_hits if cache is not None else 0,
        running=running,
        waiting=waiting,
        num_failed_steps=num_failed_steps,
    )


def _request_stats(request: Request, pages: bool) -> RequestStats:
    return RequestStats(
        request_id=request.request_id,
        phase=_phase(request),
        slot=request.slot,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_pages=len(request.page_ids),
        num_preemptions=request.num_preemptions,
        page_ids=tuple(request.page_ids) if pages else None,
    )


def _phase(request: Request) -> Phase:
    """Decode when only the last known token, a generated one, is left to compute (as
    `ScheduledSequence.is_decode` says of a step); prefill while a prompt or a recompute is under way."""
    if request.slot is None:
        return "waiting"
    computed = request.num_computed_tokens
    return "decode" if computed == request.num_tokens - 1 and computed >= request.num_prompt_tokens else "prefill"


# ---- one step ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduledStats:
    """One batch slot's share of a step (a `ScheduledSequence` as plain values)."""

    request_id: str
    slot: int
    phase: Literal["prefill", "decode"]  # decode: one generated token in, one out; prefill: a prompt (or recompute) chunk
    start_position: int  # position of the first of its new tokens
    num_new_tokens: int  # tokens whose K/V the step computed
    samples: bool  # the step reached its last known token and sampled the next
    page_ids: tuple[int, ...]  # its block table during the step (pages in token order)


@dataclass(frozen=True)
class StepStats:
    """What one step ran: the slots it served, the requests it preempted, the pages left free."""

    step: int  # the step's index (0 for the engine's first)
    sequences: tuple[ScheduledStats, ...]  # by slot; a running request the token budget left out is absent
    preempted_request_ids: tuple[str, ...]  # lost their pages this step, oldest admitted first
    num_free_pages: int  # after the step's allocations
    num_waiting: int  # requests in the queue during the step (preempted ones included)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)


def step_stats(plan: StepPlan, step: int) -> StepStats:
    """The plan of step ``step`` as a `StepStats` (the plan's fields only: it may be read after the step)."""
    sequences = tuple(
        ScheduledStats(
            request_id=s.request.request_id,
            slot=s.slot,
            phase="decode" if s.is_decode else "prefill",
            start_position=s.start_position,
            num_new_tokens=s.num_new_tokens,
            samples=s.samples,
            page_ids=tuple(s.page_ids),
        )
        for s in plan.sequences
    )
    return StepStats(step, sequences, tuple(plan.preempted_request_ids), plan.num_free_pages, plan.num_waiting)
