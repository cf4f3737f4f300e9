"""A fake model and step helpers for the scheduler tests: every scheduled token's K/V is written, and
checked, where the block table says."""

from __future__ import annotations

from numba_vllm.engine.kv_cache import NULL_PAGE_ID, PageAllocator
from numba_vllm.engine.request import Request
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import Scheduler, StepPlan
from numba_vllm.executor.inputs import kv_indices, positions
from numba_vllm.model.config import PAGE_SIZE

_arrivals = iter(range(10**9))


def prefix_keys(token_ids: list[int]) -> list[int]:
    """Entry i names token_ids[: i + 1], the tokens the K/V at position i depends on (a chained
    Python hash: an independent stand-in for the engine's SHA-256 page hashes)."""
    keys, key = [], 0
    for token in token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int | None = 16, first_token: int = 1) -> Request:
    prompt = [(first_token + i) % 1000 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), next(_arrivals))


def next_token(token_ids: list[int]) -> int:
    """The fake model: a deterministic function of all tokens so far."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 7919 + len(token_ids)) % 1000


class FakeModel:
    """Runs a plan: writes (position, prefix key) at each kv index as the K/V of that prefix, checks
    that every attended position still holds its own prefix's K/V (whoever wrote it: with prefix
    caching another request may have), and samples `next_token` where the plan samples. Given the
    allocator, it also checks that no write lands in a page another block table holds or the
    prefix cache lists: such a page may be read by someone else."""

    def __init__(self, num_pages: int, allocator: PageAllocator | None = None) -> None:
        self.cache: list[tuple[int, int] | None] = [None] * (num_pages * PAGE_SIZE)
        self.allocator = allocator

    def run(self, plan: StepPlan) -> dict[str, int]:
        sampled = {}
        for seq in plan.sequences:
            request = seq.request
            known = request.all_token_ids[: seq.context_len]
            keys = prefix_keys(known)
            indices = kv_indices(seq.page_ids, positions(seq))  # where the runner writes the new tokens' K/V
            assert len(indices) == seq.num_new_tokens
            for pos, token, index in zip(positions(seq), seq.token_ids, indices, strict=True):
                page_id = index // PAGE_SIZE
                assert page_id != NULL_PAGE_ID and token == known[pos]
                if self.allocator is not None:
                    assert self.allocator.ref_count(page_id) == 1, f"write into page {page_id}, which others hold"
                    assert not self.allocator.is_cached(page_id), f"write into page {page_id}, which the prefix cache lists"
                self.cache[index] = (int(pos), keys[pos])
            for pos in range(seq.context_len):  # attention reads the whole context through the block table
                page_id = seq.page_ids[pos // PAGE_SIZE]
                assert self.cache[page_id * PAGE_SIZE + pos % PAGE_SIZE] == (pos, keys[pos]), (request.request_id, pos)
            if seq.samples:
                sampled[request.request_id] = next_token(known)
        return sampled


def step(scheduler: Scheduler, model: FakeModel) -> tuple[StepPlan, list[Request]]:
    plan = scheduler.schedule()
    scheduler.check_invariants()
    sampled_requests = scheduler.update(plan, model.run(plan))
    scheduler.check_invariants()
    return plan, sampled_requests


def summary(plan: StepPlan) -> list[tuple[str, int, int, int, bool]]:
    """(request id, slot, start position, num new tokens, samples) per scheduled sequence."""
    return [(s.request.request_id, s.slot, s.start_position, s.num_new_tokens, s.samples) for s in plan.sequences]

