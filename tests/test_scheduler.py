"""Scheduler policy, exact on the CPU: FIFO admission, slots, chunked prefill, preemption, abort.
These run with prefix caching off (`PageAllocator`'s default); tests/test_prefix_cache.py has the
same policy with it on, and the randomized simulation here runs both ways.

A fake model stands in for the runner: the token it "samples" depends only on the request's known
tokens, so a request must produce the same tokens whatever else runs and however often it is
preempted; and a fake cache checks that every token a sequence attends to is still in its pages.
"""

import numpy as np
import pytest

from numba_vllm.engine.kv_cache import PageAllocator, pages_for_tokens
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.scheduler import Scheduler, SchedulerStalledError, StepPlan
from numba_vllm.executor.inputs import kv_index
from numba_vllm.model.config import PAGE_SIZE
from tests.helpers.scheduling import FakeModel, make_request, next_token, step, summary


def test_admission_is_fifo_and_slots_are_reused():
    allocator = PageAllocator(64)
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, allocator=allocator, max_model_len=256)
    model = FakeModel(64)
    a, b, c, d = (make_request(r, 4) for r in "abcd")
    for r in (a, b, c, d):
        scheduler.add(r)
    plan, sampled = step(scheduler, model)
    assert summary(plan) == [("a", 0, 0, 4, True), ("b", 1, 0, 4, True)]
    assert sampled == [a, b] and [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert (a.status, c.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert a.slot is None and a.page_ids == [] and a.finish_reason == "stop"
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("c", 0, 0, 4, True), ("b", 1, 4, 1, True)]  # c takes a's slot; d still waits
    scheduler.finish(b, RequestStatus.FINISHED_LENGTH)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("c", 0, 4, 1, True), ("d", 1, 0, 4, True)]
    assert not scheduler.waiting and plan.num_waiting == 0


def test_chunked_prefill_of_100_tokens_under_a_32_token_budget():
    allocator = PageAllocator(32)
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, allocator=allocator, max_model_len=256)
    model = FakeModel(32)
    request = make_request("long", 100)
    scheduler.add(request)
    chunks = []
    for _ in range(4):
        plan, sampled = step(scheduler, model)
        (seq,) = plan.sequences
        chunks.append((seq.start_position, seq.num_new_tokens, seq.samples, len(seq.page_ids)))
        assert seq.token_ids == request.prompt_token_ids[seq.start_position : seq.context_len]
        assert not seq.is_decode
        assert sampled == ([request] if seq.samples else [])
    assert chunks == [(0, 32, False, 2), (32, 32, False, 4), (64, 32, False, 6), (96, 4, True, 7)]
    assert request.page_ids == [1, 2, 3, 4, 5, 6, 7] and request.num_computed_tokens == 100
    assert request.output_token_ids == [next_token(request.prompt_token_ids)]
    plan, _ = step(scheduler, model)  # then decode, one token
    (seq,) = plan.sequences
    assert (seq.start_position, seq.num_new_tokens, seq.samples, seq.is_decode) == (100, 1, True, True)
    assert seq.page_ids == [1, 2, 3, 4, 5, 6, 7] and kv_index(seq.page_ids, 100) == 7 * PAGE_SIZE + 100 % PAGE_SIZE


def test_update_rejects_unexpected_and_missing_sampled_tokens():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, allocator=PageAllocator(8), max_model_len=64)
    a = make_request("a", 10)
    scheduler.add(a)
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="did not reach their last token"):
        scheduler.update(plan, {"a": 5})  # a is mid-prefill
    with pytest.raises(ValueError, match="nobody"):
        scheduler.update(plan, {"nobody": 5})
    assert scheduler.update(plan, {}) == []  # the failed call changed nothing; this one goes through
    assert a.num_computed_tokens == 8
    scheduler.add(make_request("b", 1))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 0, 8, 2, True), ("b", 1, 0, 1, True)]
    with pytest.raises(ValueError, match="no sampled token given for b"):
        scheduler.update(plan, {"a": 1})


def test_running_requests_are_served_before_new_ones_are_admitted():
    allocator = PageAllocator(64)
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=8, allocator=allocator, max_model_len=256)
    model = FakeModel(64)
    scheduler.add(make_request("a", 4))
    step(scheduler, model)
    scheduler.add(make_request("b", 20))
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 4, 1, True), ("b", 1, 0, 7, False)]  # b gets what a's decode leaves
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 5, 1, True), ("b", 1, 7, 7, False)]


def test_decode_gets_the_last_free_page_before_admission():
    allocator = PageAllocator(4)  # 3 usable pages
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=allocator, max_model_len=48)
    model = FakeModel(4)
    a = make_request("a", 16)
    scheduler.add(a)
    step(scheduler, model)  # a holds page 1 with positions 0..15; its first output token is at 16
    scheduler.add(make_request("b", 32))  # needs 2 pages
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 16, 1, True)]
    assert a.page_ids == [1, 2] and plan.num_free_pages == 1 and plan.num_waiting == 1
    assert plan.preempted_request_ids == []


def test_preemption_by_recompute_keeps_generated_tokens_and_resumes():
    allocator = PageAllocator(5)  # 4 usable pages
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=allocator, max_model_len=64)
    model = FakeModel(5)
    a, b = make_request("a", 24), make_request("b", 24, first_token=500)
    scheduler.add(a)
    scheduler.add(b)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 0, 24, True), ("b", 1, 0, 24, True)]
    assert (a.page_ids, b.page_ids, allocator.num_free_pages) == ([1, 2], [3, 4], 0)
    for _ in range(8):  # decode positions 24 .. 31: no new page
        plan, _ = step(scheduler, model)
        assert plan.preempted_request_ids == []
    assert a.num_output_tokens == b.num_output_tokens == 9
    b_tokens = b.all_token_ids
    plan, _ = step(scheduler, model)  # a needs a page for position 32: b, the newest, is preempted
    assert summary(plan) == [("a", 0, 32, 1, True)]
    assert plan.preempted_request_ids == ["b"]
    assert a.page_ids == [1, 2, 3]  # b's first page is the first handed out again
    assert b.status is RequestStatus.WAITING and b.slot is None and b.page_ids == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and b.all_token_ids == b_tokens
    assert list(scheduler.waiting) == [b]
    plan, _ = step(scheduler, model)  # b needs 3 pages to re-prefill 33 tokens; 1 is free
    assert summary(plan) == [("a", 0, 33, 1, True)] and list(scheduler.waiting) == [b]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    plan, sampled = step(scheduler, model)  # b re-prefills prompt + its 9 generated tokens
    (seq,) = plan.sequences
    assert (seq.request, seq.slot, seq.start_position, seq.num_new_tokens, seq.samples) == (b, 0, 0, 33, True)
    assert seq.token_ids == b_tokens and not seq.is_decode
    assert sampled == [b] and b.num_output_tokens == 10 and b.output_token_ids[-1] == next_token(b_tokens)


def test_newest_request_preempts_itself_when_it_needs_the_page():
    allocator = PageAllocator(4)  # 3 usable pages
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=allocator, max_model_len=48)
    model = FakeModel(4)
    a, b = make_request("a", 17), make_request("b", 16)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, model)
    assert (a.page_ids, b.page_ids) == ([1, 2], [3])
    plan, _ = step(scheduler, model)  # a decodes at 17 (its page 2), b needs a page for 16: none left
    assert summary(plan) == [("a", 0, 17, 1, True)]
    assert plan.preempted_request_ids == ["b"] and list(scheduler.waiting) == [b]
    assert b.num_output_tokens == 1 and allocator.num_free_pages == 1


def test_several_preemptions_in_one_step_keep_their_order_at_the_front_of_the_queue():
    allocator = PageAllocator(5)  # 4 usable pages
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=allocator, max_model_len=64)
    model = FakeModel(5)
    a, b, c, d, e = (make_request(r, 16) for r in "abcde")
    for r in (a, b, c, d, e):
        scheduler.add(r)
    step(scheduler, model)  # a, b, c, d: one full page each; e waits for a slot
    plan, _ = step(scheduler, model)  # a's position 16 takes d's page, b's takes c's
    assert summary(plan) == [("a", 0, 16, 1, True), ("b", 1, 16, 1, True)]
    assert plan.preempted_request_ids == ["c", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d", "e"]
    assert (a.page_ids, b.page_ids) == ([1, 4], [2, 3])
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    plan, _ = step(scheduler, model)  # a's 2 pages: b decodes, c (first in line) re-prefills 17 tokens
    assert summary(plan) == [("c", 0, 0, 17, True), ("b", 1, 17, 1, True)]
    assert [r.request_id for r in scheduler.waiting] == ["d", "e"]


def test_abort_frees_pages_and_slot_for_running_and_waiting_requests():
    allocator = PageAllocator(16)
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=64, allocator=allocator, max_model_len=64)
    model = FakeModel(16)
    a, b = make_request("a", 20), make_request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, model)
    assert allocator.num_free_pages == 13 and scheduler.num_free_slots == 0
    assert scheduler.abort("b") and b.status is RequestStatus.FINISHED_ABORTED and not scheduler.waiting
    assert scheduler.abort("a") and a.finish_reason == "abort"
    assert allocator.num_free_pages == 15 and scheduler.num_free_slots == 1 and not scheduler.has_unfinished()
    assert not scheduler.abort("a") and not scheduler.abort("nobody")
    scheduler.check_invariants()
    c = make_request("c", 5)
    scheduler.add(c)
    plan = scheduler.schedule()
    assert scheduler.abort("c")  # aborted while its step runs: update skips it
    assert scheduler.update(plan, model.run(plan)) == [] and c.output_token_ids == []
    assert allocator.num_free_pages == 15
    scheduler.check_invariants()


def test_too_long_requests_are_rejected_alone():
    """The engine's length policy rejects such prompts first (tests/test_lengths.py); the scheduler
    still refuses one that leaves no room, and a max_model_len the cache cannot hold."""
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=PageAllocator(64), max_model_len=64)
    scheduler.add(make_request("fits", 63))
    with pytest.raises(ValueError, match="leave no room"):
        scheduler.add(make_request("too-long", 64))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_request("fits", 3))
    assert [r.request_id for r in scheduler.waiting] == ["fits"]
    with pytest.raises(ValueError, match="does not fit the 2 pages of the cache"):
        Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=PageAllocator(3), max_model_len=33)
    small = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=PageAllocator(3), max_model_len=32)
    small.add(make_request("ok", 31))
    plan, sampled = step(small, FakeModel(3))
    assert summary(plan) == [("ok", 0, 0, 31, True)] and len(sampled) == 1


def test_a_request_not_finished_at_max_model_len_stalls_loudly():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, allocator=PageAllocator(3), max_model_len=32)
    model = FakeModel(3)
    request = make_request("a", 31)
    scheduler.add(request)
    for _ in range(2):  # prefill, then position 31: the cache is full and the engine should finish it
        plan = scheduler.schedule()
        scheduler.update(plan, model.run(plan))
    assert request.num_tokens == 33 > scheduler.max_model_len
    plan = scheduler.schedule()  # position 32 needs a third page: it preempts itself
    assert plan.preempted_request_ids == ["a"]
    scheduler.update(plan, {})
    with pytest.raises(SchedulerStalledError):
        scheduler.schedule()


def test_bad_scheduler_arguments():
    for kwargs in ({"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_model_len": -1}):
        args = {"max_num_seqs": 2, "max_num_batched_tokens": 8, "allocator": PageAllocator(4), "max_model_len": 16}
        with pytest.raises(ValueError):
            Scheduler(**{**args, **kwargs})
    with pytest.raises(ValueError):
        make_request("empty", 0)


def expected_output(request: Request, max_model_len: int) -> list[int]:
    """What the request generates alone, under the engine rules of the simulation below."""
    tokens = list(request.prompt_token_ids)
    output: list[int] = []
    while True:
        output.append(next_token(tokens))
        tokens.append(output[-1])
        if engine_stops(output, len(tokens), request.sampling_params.max_tokens, max_model_len):
            return output


def engine_stops(output: list[int], num_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    return output[-1] % 50 == 0 or len(output) >= max_tokens or num_tokens >= max_model_len


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("scheduling", ["continuous", "static"])
@pytest.mark.parametrize(
    "seed, num_pages, max_num_seqs, budget, max_model_len",
    [(0, 12, 4, 24, 100), (1, 7, 8, 16, 200), (2, 40, 16, 64, 128), (3, 9, 3, 7, 90), (4, 6, 5, 100, 64)],
)
def test_randomized_simulation_loses_and_duplicates_nothing(seed, num_pages, max_num_seqs, budget, max_model_len, scheduling,
                                                            caching):  # fmt: skip
    """Random arrivals, lengths and aborts. More often than not a prompt is a string of pages drawn
    from two 16-token blocks, so with prefix caching requests share pages (and preempted ones find
    theirs), and equal pages often follow different prefixes: only a chained hash tells them apart."""
    rng = np.random.default_rng(seed)
    allocator = PageAllocator(num_pages, enable_caching=caching)
    limit = min(max_model_len, (num_pages - 1) * PAGE_SIZE)  # as capacity planning shrinks it
    scheduler = Scheduler(max_num_seqs, budget, allocator, limit, scheduling=scheduling)
    model = FakeModel(num_pages, allocator)
    blocks = [rng.integers(0, 1000, PAGE_SIZE).tolist() for _ in range(2)]
    requests: dict[str, Request] = {}
    finished: list[str] = []
    num_preemptions = 0
    for step_index in range(3000):
        if len(requests) < 60 and rng.random() < 0.3:
            request_id = f"r{len(requests)}"
            num_prompt_tokens = int(rng.integers(1, 80))
            request = make_request(request_id, num_prompt_tokens, int(rng.integers(1, 40)), int(rng.integers(1000)))
            if rng.random() < 0.6:  # the same length, made of blocks
                pages = [blocks[int(rng.integers(len(blocks)))] for _ in range(pages_for_tokens(num_prompt_tokens))]
                prompt = [t for page in pages for t in page][:num_prompt_tokens]
                request = Request(request_id, prompt, request.sampling_params, request.arrival_index)
            if num_prompt_tokens + 1 > limit:
                with pytest.raises(ValueError):
                    scheduler.add(request)
                continue
            scheduler.add(request)
            requests[request_id] = request
        if rng.random() < 0.01 and scheduler.running:
            victim = scheduler.running[int(rng.integers(len(scheduler.running)))]
            assert scheduler.abort(victim.request_id)
            finished.append(victim.request_id)
        if not scheduler.has_unfinished():
            if len(requests) >= 60:
                break
            continue
        running_before = {r.request_id: r.slot for r in scheduler.running}
        plan, sampled_requests = step(scheduler, model)
        num_preemptions += len(plan.preempted_request_ids)
        if scheduling == "static":
            check_static_admission(running_before, scheduler, plan)
        assert plan.num_batched_tokens <= budget and len(plan.sequences) <= max_num_seqs
        assert [s.slot for s in plan.sequences] == sorted({s.slot for s in plan.sequences})
        assert plan.num_free_pages == allocator.num_free_pages
        for request in sampled_requests:
            if engine_stops(request.output_token_ids, request.num_tokens, request.sampling_params.max_tokens, limit):
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request.request_id)
        scheduler.check_invariants()
    assert not scheduler.has_unfinished(), "the simulation did not drain"
    assert sorted(finished) == sorted(requests) and len(set(finished)) == len(finished)
    assert allocator.num_free_pages == allocator.num_usable_pages
    for request in requests.values():
        expected = expected_output(request, limit)
        if request.status is RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected, request.request_id
    if seed in (0, 1, 3, 4):  # small pools: preemption must have happened
        assert num_preemptions > 0
    if caching:
        assert scheduler.prefix_cache.num_hits > 0


# ---- static batching ---------------------------------------------------------------------------


def check_static_admission(running_before: dict[str, int], scheduler: Scheduler, plan: StepPlan) -> None:
    """Static scheduling: a step admits nobody while a batch runs; a new batch takes slots 0, 1, ..."""
    running_after = {r.request_id: r.slot for r in scheduler.running}
    if running_before:
        assert running_after.items() <= running_before.items(), "admitted while a batch was running"
        assert {s.request.request_id for s in plan.sequences} <= running_before.keys()
    else:  # a new batch: all its prompts fit the free pages, so nobody is preempted in its first step
        assert sorted(running_after.values()) == list(range(len(running_after)))
        assert not plan.preempted_request_ids


def test_static_batch_takes_its_slots_at_once_and_admits_nothing_until_it_finishes():
    allocator = PageAllocator(64)
    scheduler = Scheduler(max_num_seqs=3, max_num_batched_tokens=8, allocator=allocator, max_model_len=256, scheduling="static")
    model = FakeModel(64)
    a, b, c, d = make_request("a", 4), make_request("b", 10), make_request("c", 3), make_request("d", 2)
    for r in (a, b, c, d):
        scheduler.add(r)
    plan, _ = step(scheduler, model)  # a, b, c form a batch; c holds slot 2 though the budget leaves it nothing
    assert summary(plan) == [("a", 0, 0, 4, True), ("b", 1, 0, 4, False)]
    assert scheduler.running == [a, b, c] and c.slot == 2 and c.page_ids == [] and list(scheduler.waiting) == [d]
    assert scheduler.num_batches == 1
    plan, _ = step(scheduler, model)  # the batch's prompts are prefilled in chunks under the budget
    assert summary(plan) == [("a", 0, 4, 1, True), ("b", 1, 4, 6, True), ("c", 2, 0, 1, False)]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    plan, _ = step(scheduler, model)  # slot 0 stays empty: d waits for the whole batch
    assert summary(plan) == [("b", 1, 10, 1, True), ("c", 2, 1, 2, True)]
    assert list(scheduler.waiting) == [d] and scheduler.num_free_slots == 1
    scheduler.finish(b, RequestStatus.FINISHED_STOPPED)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("c", 2, 3, 1, True)] and list(scheduler.waiting) == [d]
    scheduler.finish(c, RequestStatus.FINISHED_LENGTH)
    plan, _ = step(scheduler, model)  # the next batch
    assert summary(plan) == [("d", 0, 0, 2, True)] and scheduler.num_batches == 2


def test_static_batch_is_limited_by_pages_for_all_its_prompts():
    allocator = PageAllocator(5)  # 4 usable pages
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=allocator, max_model_len=64, scheduling="static")
    model = FakeModel(5)
    a, b, c = make_request("a", 24), make_request("b", 24, first_token=500), make_request("c", 4)
    for r in (a, b, c):
        scheduler.add(r)
    plan, _ = step(scheduler, model)  # a and b need 2 pages each: c (1 more page) waits for the next batch
    assert summary(plan) == [("a", 0, 0, 24, True), ("b", 1, 0, 24, True)] and list(scheduler.waiting) == [c]
    for _ in range(8):  # decode positions 24 .. 31: no new page
        plan, _ = step(scheduler, model)
        assert plan.preempted_request_ids == []
    b_tokens = b.all_token_ids
    plan, _ = step(scheduler, model)  # a needs a page for position 32: b, the newest, is preempted
    assert summary(plan) == [("a", 0, 32, 1, True)] and plan.preempted_request_ids == ["b"]
    assert list(scheduler.waiting) == [b, c] and b.num_computed_tokens == 0 and b.all_token_ids == b_tokens
    plan, _ = step(scheduler, model)  # b left the batch: it and c wait for a to finish
    assert summary(plan) == [("a", 0, 33, 1, True)] and scheduler.running == [a]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    plan, sampled = step(scheduler, model)  # the next batch: b first (33 tokens, 3 pages), then c
    assert summary(plan) == [("b", 0, 0, 33, True), ("c", 1, 0, 4, True)]
    assert sampled == [b, c] and b.output_token_ids[-1] == next_token(b_tokens) and scheduler.num_batches == 2


def test_static_needs_more_steps_than_continuous_on_mixed_lengths():
    def run(scheduling: str) -> tuple[int, dict[str, list[int]]]:
        scheduler = Scheduler(4, 64, PageAllocator(64), 256, scheduling=scheduling)
        model = FakeModel(64)
        requests = [make_request(f"{scheduling}{i}", 5 + 3 * i, max_tokens=2 if i % 2 else 20) for i in range(8)]
        for r in requests:
            scheduler.add(r)
        steps = 0
        while scheduler.has_unfinished():
            _, sampled = step(scheduler, model)
            steps += 1
            for r in sampled:
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
        return steps, [r.output_token_ids for r in requests]

    continuous_steps, continuous_tokens = run("continuous")
    static_steps, static_tokens = run("static")
    assert static_tokens == continuous_tokens
    # Static: two batches of 4 (each 20 steps long: its longest request). Continuous: each short
    # request's slot is refilled 2 steps after admission, so the last long one starts at step 5.
    assert (continuous_steps, static_steps) == (24, 40)


def test_bad_scheduling_mode():
    with pytest.raises(ValueError, match="scheduling must be one of continuous, static, got 'dynamic'"):
        Scheduler(2, 8, PageAllocator(4), 16, scheduling="dynamic")
