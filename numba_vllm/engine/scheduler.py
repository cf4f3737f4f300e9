"""Continuous batching: which requests run this step, on which tokens, in which pages.

State: ``max_num_seqs`` batch slots, the ``running`` requests (in admission order) each holding a
slot and pages, and a FIFO ``waiting`` queue. Policy, each step, under one token budget
(``max_num_batched_tokens``) shared by prefill and decode, as in vLLM v1, of which one request's
prompt chunk takes at most ``long_prefill_token_threshold`` tokens (vLLM's name; by default the
whole budget, less on the CPU backends, so that requests arriving during a long prefill join it):

1. Running requests first, oldest admitted first: each gets its next tokens, one for decode or
   the next chunk of a prompt still being prefilled. Serving them first means admitting a new
   request can never stall the ones already generating.
2. If a running request needs a page and none is free, the *newest* running request is preempted
   by recompute: its pages and slot are freed, ``num_computed_tokens`` goes back to 0, its
   generated tokens are kept, and it goes to the *front* of the waiting queue, to re-prefill
   prompt + generated tokens when pages allow. The newest has the least work to redo and the
   oldest keeps making progress, so the batch can never deadlock. Repeat until the request fits;
   if it is itself the newest, it is simply not scheduled this step.
3. Only if nobody was preempted this step (pages are scarce otherwise), admit waiting requests in
   FIFO order into free slots while budget and pages allow. A prompt longer than the remaining
   budget is prefilled in chunks over several steps (chunked prefill); only the step that reaches
   the last known token samples.

Prefix caching (``PageAllocator(..., enable_caching=True)``, `prefix_cache.py`): when a request is
admitted (rule 3, a static batch, or again after a preemption), the cached pages that begin its
known tokens join its block table (their reference counts go up) and count as computed, so only the
rest is prefilled; a preempted request so finds its own pages again unless they were evicted. Those
free-but-cached pages count as free pages: allocating evicts the least recently used of them, so a
request is preempted only when no free page is left, cached or not. After each step, the pages it
filled are recorded in the cache. A shared page is always full and computed, so nobody writes it.

Static batching (``scheduling="static"``), for comparison, is a plain batched ``generate``: when no
request is running, a *batch* is formed from the head of the waiting queue, in FIFO order, up to
``max_num_seqs`` requests whose known tokens (prompt, plus generated tokens for a preempted one)
all fit the free pages together; every member takes its slot at once (slots 0, 1, ...), and its
prompt is prefilled by rule 1 under the token budget, in chunks over several steps if need be.
Rule 3 is off: nothing is admitted until every member has finished, so a finished member's slot
stays empty while the longest one runs. Preemption (rule 2) works as above; a preempted member
leaves its batch, goes to the front of the queue and is admitted first with the *next* batch.

The scheduler advances requests in `update` after the step has run; stopping rules (EOS, stop
strings, max_tokens, and `max_model_len` below) are the engine's, which calls `finish`. With
overlapped scheduling the engine calls `update` as soon as a step is launched, with None for the
tokens it samples (the next step is scheduled as if they were known; the runner feeds them to it on
the device), and `fill` once they are on the host; `schedule(hold=...)` leaves out the requests
the step in flight certainly finishes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from numba_vllm.engine.config import SCHEDULING_MODES
from numba_vllm.engine.kv_cache import PageAllocator, pages_for_tokens
from numba_vllm.engine.prefix_cache import PrefixCache
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.model.config import PAGE_SIZE


class SchedulerStalledError(RuntimeError):
    """Unfinished requests exist but none could be scheduled: an engine bug (e.g. a request was
    not finished at `Scheduler.max_model_len`), raised instead of looping forever."""


@dataclass
class ScheduledSequence:
    """One request's share of a step: compute K/V for ``token_ids`` at ``start_position`` onwards."""

    request: Request
    slot: int  # batch slot, 0 .. max_num_seqs - 1
    start_position: int  # request.num_computed_tokens before the step; token_ids[i] sits at start_position + i
    token_ids: list[int]  # (num_new_tokens,) tokens whose K/V are computed (and written) this step
    page_ids: list[int]  # block table after this step's allocation, covering start_position + num_new_tokens tokens
    samples: bool  # the step reaches the last known token, so a new token is sampled from its logits

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens the last new token attends to (itself included)."""
        return self.start_position + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One generated token in, one sampled token out (as opposed to a prompt or recompute chunk)."""
        return self.samples and len(self.token_ids) == 1 and self.start_position >= self.request.num_prompt_tokens


@dataclass
class StepPlan:
    """Everything the runner needs for one forward pass, and what `--verbose` prints."""

    sequences: list[ScheduledSequence]  # ordered by slot
    preempted_request_ids: list[str]  # preempted this step, oldest admitted first
    num_free_pages: int  # after this step's allocations
    num_waiting: int  # requests left in the waiting queue
    num_cached_pages: int = 0  # pages holding a reusable prefix (held or free); 0 without prefix caching

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def describe(self, allocator: PageAllocator | None = None) -> list[str]:
        """One line per slot and a summary line, for `--verbose`. Given the allocator (right after
        `schedule`), each slot also says how many of its pages other block tables share."""
        lines = []
        for s in self.sequences:
            kind = "decode " if s.is_decode else "prefill"
            end = "" if s.samples else " (chunk)"
            shared = ""
            if allocator is not None and allocator.enable_caching:
                shared = f" ({sum(allocator.ref_count(p) > 1 for p in s.page_ids)} shared)"
            lines.append(
                f"  slot {s.slot:3d}  {s.request.request_id:<12} {kind} {s.num_new_tokens:5d} tok"
                f"  pos {s.start_position}..{s.context_len - 1}{end}  pages {len(s.page_ids)}{shared}"
            )
        summary = f"  {self.num_batched_tokens} tokens, {self.num_free_pages} free pages, {self.num_waiting} waiting"
        if allocator is not None and allocator.enable_caching:
            summary += f", {self.num_cached_pages} cached pages"
        if self.preempted_request_ids:
            summary += f", preempted {', '.join(self.preempted_request_ids)}"
        return lines + [summary]


class Scheduler:
    """Batch slots, a FIFO waiting queue and the step policy described in the module docstring."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        allocator: PageAllocator,
        max_model_len: int,
        scheduling: str = "continuous",
        cache_key: bytes = b"",
        long_prefill_token_threshold: int | None = None,
    ) -> None:
        """With an allocator built with ``enable_caching``, prefix caching is on; ``cache_key`` names
        what else the K/V depends on (the model), folded into every page hash."""
        limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len}
        for name, value in limits.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_MODES)}, got {scheduling!r}")
        self.scheduling = scheduling  # "continuous" or "static" (see the module docstring)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens  # token budget of one step
        # the largest prompt chunk of one request in a step (None: the whole budget)
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        if max_model_len > allocator.num_usable_pages * PAGE_SIZE:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit the {allocator.num_usable_pages} pages of the cache: a request "
                "must fit the whole cache alone, or preempting everyone else would not let it proceed"
            )
        self.allocator = allocator
        self.prefix_cache = PrefixCache(allocator, cache_key) if allocator.enable_caching else None
        # The longest a request may grow (prompt + output): the engine's length policy finishes a
        # request (FINISHED_LENGTH) before it passes this, and rejects prompts that leave no room.
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests re-enter at the front
        self.running: list[Request] = []  # admission order: the last is the newest, preempted first
        self._free_slots: list[int] = list(range(max_num_seqs))  # min-heap: lowest free slot first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._plan_in_flight: StepPlan | None = None  # scheduled, not yet passed to update
        self.num_batches = 0  # static scheduling: batches formed so far

    # ---- queries -------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, request: Request, front: bool = False) -> None:
        """Queue a new request. Its prompt was checked by the engine's length policy (`lengths.py`):
        it leaves room for at least one new token within `max_model_len`. `front`: at the head of the
        queue (the held siblings of a request that was admitted already, so arrived before the rest)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.page_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}: only a new request can be added")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id}: {request.num_tokens} tokens leave no room within max_model_len")
        self._requests[request.request_id] = request
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a waiting or running request with a finished status, freeing its pages and slot."""
        if not status.is_finished:
            raise ValueError(f"finish needs a finished status, got {status}")
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is not an unfinished request of this scheduler")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        else:
            self.waiting.remove(request)
        request.status = status
        del self._requests[request.request_id]

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if there is no unfinished request with this id."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self, hold: Collection[str] = ()) -> StepPlan:
        """Plan the next step (see the module docstring), allocating the pages it writes.

        `hold`: ids of running requests to give no tokens this step (they keep their slot and pages):
        the engine's, for requests the step in flight will finish. When only held requests could run
        the plan is empty."""
        if self._plan_in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous plan")
        token_budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []
        static = self.scheduling == "static"
        if static and not self.running:
            self._form_batch()  # its members run (and are prefilled) by rule 1 below

        # 1. Running requests, oldest first; preempting the newest when pages run out.
        i = 0
        held = False
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            if request.request_id in hold:
                held = True
                i += 1
                continue
            num_left = request.num_tokens - request.num_computed_tokens
            num_new_tokens = min(num_left, token_budget, self.long_prefill_token_threshold)
            num_new_pages = pages_for_tokens(request.num_computed_tokens + num_new_tokens) - len(request.page_ids)
            while not self.allocator.can_allocate(num_new_pages) and request.status is RequestStatus.RUNNING:
                victim = self.running[-1]  # the newest; possibly the request itself
                self._preempt(victim)
                preempted.append(victim)
            if request.status is not RequestStatus.RUNNING:
                break  # it was the newest: nobody after it is left
            scheduled.append(self._schedule_tokens(request, num_new_tokens))
            token_budget -= num_new_tokens
            i += 1

        # 2. Admit waiting requests in FIFO order, unless pages were just too scarce to keep everyone.
        #    Static scheduling admits only whole batches, above.
        while not static and not preempted and self.waiting and self._free_slots and token_budget > 0:
            request = self.waiting[0]
            cached_page_ids = self._find_cached(request)
            num_cached_tokens = len(cached_page_ids) * PAGE_SIZE
            num_new_tokens = min(request.num_tokens - num_cached_tokens, token_budget, self.long_prefill_token_threshold)
            num_new_pages = pages_for_tokens(num_cached_tokens + num_new_tokens) - len(cached_page_ids)
            # Cached pages that are free leave the free pages when shared: they count against them too.
            if not self.allocator.can_allocate(num_new_pages + self.allocator.num_free_among(cached_page_ids)):
                break  # strict FIFO: later requests do not overtake the head
            self.waiting.popleft()
            self._admit(request, cached_page_ids)
            scheduled.append(self._schedule_tokens(request, num_new_tokens))
            token_budget -= num_new_tokens

        if not scheduled and not preempted and not held and self.has_unfinished():
            raise SchedulerStalledError(
                f"{len(self.running)} running / {len(self.waiting)} waiting requests but none can be scheduled "
                f"({self.allocator.num_free_pages} free pages); was a request not finished at max_model_len="
                f"{self.max_model_len}?"
            )
        scheduled.sort(key=lambda s: s.slot)
        plan = StepPlan(
            sequences=scheduled,
            preempted_request_ids=[r.request_id for r in reversed(preempted)],
            num_free_pages=self.allocator.num_free_pages,
            num_waiting=len(self.waiting),
            num_cached_pages=self.allocator.num_cached_pages,
        )
        self._plan_in_flight = plan
        return plan

    def update(self, plan: StepPlan, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Record that ``plan`` ran: advance each request's computed tokens and append its sampled
        token where the step sampled; with prefix caching, record the full pages the step filled.
        Returns the sampling requests, in plan order, for the engine to check stopping rules on.
        Requests aborted while the step ran are skipped. A token may be None: the step was only
        launched, and `fill` puts the token in once it is known (before the next `update`, so the
        pages recorded then hold known tokens only)."""
        if plan is not self._plan_in_flight:
            raise ValueError("update() needs the plan returned by the last schedule()")
        # Check everything before changing anything, so a bad call changes nothing.
        live = [seq for seq in plan.sequences if not seq.request.is_finished]
        sampling_ids = {seq.request.request_id for seq in plan.sequences if seq.samples}
        unexpected = sorted(set(sampled_token_ids) - sampling_ids)
        if unexpected:
            raise ValueError(f"sampled tokens given for {', '.join(unexpected)}, which did not reach their last token this step")
        missing = [seq.request.request_id for seq in live if seq.samples and seq.request.request_id not in sampled_token_ids]
        if missing:
            raise ValueError(f"no sampled token given for {', '.join(missing)}, which reached their last token")
        self._plan_in_flight = None
        sampled_requests = []
        for seq in live:
            request = seq.request
            assert request.num_computed_tokens == seq.start_position, f"request {request.request_id} moved during the step"
            request.num_computed_tokens += seq.num_new_tokens
            if self.prefix_cache is not None and request.num_computed_tokens // PAGE_SIZE > seq.start_position // PAGE_SIZE:
                self.prefix_cache.cache_full_pages(request, seq.start_position, request.num_computed_tokens)  # a page filled
            if seq.samples:
                token = sampled_token_ids[request.request_id]
                request.output_token_ids.append(None if token is None else int(token))
                sampled_requests.append(request)
        return sampled_requests

    def fill(self, plan: StepPlan, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Put in the tokens of ``plan`` that `update` recorded as None, now that they are known.
        Returns the requests that got one, in plan order; requests finished since are skipped (a
        request preempted since still gets its token: it was computed before its pages went)."""
        filled = []
        for seq in plan.sequences:
            request = seq.request
            if not seq.samples or request.is_finished:
                continue
            index = seq.context_len - request.num_prompt_tokens  # the sampled token's place in the output
            if request.output_token_ids[index] is not None:
                raise ValueError(f"request {request.request_id}: output token {index} is already known")
            request.output_token_ids[index] = int(sampled_token_ids[request.request_id])
            filled.append(request)
        return filled

    def discard(self, plan: StepPlan) -> None:
        """Forget ``plan``: its step did not run (the runner raised). Nothing advanced, so every
        request stays as `schedule` left it, still consistent: a request keeps the pages allocated
        for the step (within its known tokens) and computes the same tokens when next scheduled.
        Preempted requests stay preempted. The engine then finishes the requests it gives up on."""
        if plan is not self._plan_in_flight:
            raise ValueError("discard() needs the plan returned by the last schedule()")
        self._plan_in_flight = None

    # ---- helpers -------------------------------------------------------------------------------
    def _form_batch(self) -> None:
        """Static scheduling, with nothing running (so every page is free, cached or not): admit the
        head of the queue, FIFO, into slots 0, 1, ... while slots last and all the members' known
        tokens fit the free pages together. A member's cached prefix joins its block table now; the
        rest of its pages are allocated later, as rule 1 schedules its tokens. The head always fits
        unless it outgrew the cache (then `schedule` reports a stall)."""
        num_pages = 0  # pages the members admitted so far will still allocate
        members = 0
        while self.waiting and self._free_slots:
            request = self.waiting[0]
            cached_page_ids = self._find_cached(request)
            num_new_pages = pages_for_tokens(request.num_tokens) - len(cached_page_ids)
            if not self.allocator.can_allocate(num_pages + num_new_pages + self.allocator.num_free_among(cached_page_ids)):
                break
            num_pages += num_new_pages
            self.waiting.popleft()
            self._admit(request, cached_page_ids)
            members += 1
        if members:
            self.num_batches += 1

    def _find_cached(self, request: Request) -> list[int]:
        """The cached pages that begin a waiting request's known tokens ([] without prefix caching, and
        for a request that asks for prompt logprobs: they need the logits of every prompt position)."""
        if self.prefix_cache is None or request.sampling_params.prompt_logprobs is not None:
            return []
        return self.prefix_cache.find(request)

    def _admit(self, request: Request, cached_page_ids: list[int]) -> None:
        """A waiting request takes the lowest free slot and its cached prefix (counted as computed)."""
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        self.running.append(request)
        if self.prefix_cache is not None:
            self.allocator.share(cached_page_ids)
            request.page_ids = list(cached_page_ids)
            request.num_computed_tokens = len(cached_page_ids) * PAGE_SIZE
            self.prefix_cache.count(request, request.num_computed_tokens)
            if request.num_preemptions == 0:  # its first admission: what the caller is told
                request.num_cached_tokens = request.num_computed_tokens

    def _schedule_tokens(self, request: Request, num_new_tokens: int) -> ScheduledSequence:
        """Allocate the pages ``num_new_tokens`` more tokens need and describe the request's step."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        request.page_ids.extend(self.allocator.allocate(pages_for_tokens(end) - len(request.page_ids)))
        return ScheduledSequence(
            request=request,
            slot=request.slot,
            start_position=start,
            token_ids=request.token_ids_between(start, end),
            page_ids=list(request.page_ids),  # a snapshot: the request's list keeps growing
            samples=end == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's cache, keep its tokens, queue it first."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        """Give back a running request's pages and slot."""
        self.allocator.free(request.page_ids)
        request.page_ids = []
        heapq.heappush(self._free_slots, request.slot)
        request.slot = None

    def check_invariants(self) -> None:
        """Page and slot accounting is exact, reference counts included, and no page that another
        request may read is ever written (for tests: cheap enough to call every step)."""
        self.allocator.check_invariants()
        assert len(set(map(id, self.running))) == len(self.running), "a request runs twice"
        assert {id(r) for r in self.running}.isdisjoint(map(id, self.waiting)), "a request both runs and waits"
        assert len(self.running) + len(self.waiting) == len(self._requests), "a request is lost or duplicated"
        assert all(self._requests.get(r.request_id) is r for r in [*self.running, *self.waiting])
        holders: dict[int, int] = {}  # page id -> block tables it is in
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and r.slot is not None
            assert 0 <= r.num_computed_tokens < r.num_tokens <= self.max_model_len
            assert pages_for_tokens(r.num_computed_tokens) <= len(r.page_ids) <= pages_for_tokens(r.num_tokens)
            assert len(set(r.page_ids)) == len(r.page_ids), f"a page twice in {r.request_id}'s block table"
            for i, page_id in enumerate(r.page_ids):
                holders[page_id] = holders.get(page_id, 0) + 1
                if self.allocator.is_cached(page_id):  # readable by others: full, computed, never written again
                    assert (i + 1) * PAGE_SIZE <= r.num_computed_tokens, f"cached page {page_id} is still to be written"
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and r.slot is None
            assert r.num_computed_tokens == 0 and not r.page_ids
        assert holders.keys() == self.allocator.allocated_page_ids, "allocated pages differ from the block tables"
        for page_id, count in holders.items():
            assert self.allocator.ref_count(page_id) == count, f"page {page_id}: reference count off"
            assert count == 1 or self.allocator.is_cached(page_id), f"page {page_id} is shared but holds no cached prefix"
        slots = [r.slot for r in self.running]
        assert sorted(slots + self._free_slots) == list(range(self.max_num_seqs)), "slot accounting is off"
