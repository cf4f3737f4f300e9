"""`LLMEngine.stats()` on the numpy backend, step by step, against counts worked out by hand from the
scheduling rules (PAGE_SIZE 16): admission under the token budget, chunked prefill, page growth,
a preemption, and the prefix cache (the prompts below all start 3, 4, 5, ..., so they share pages)."""

import dataclasses

import pytest

from numba_vllm import SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.stats import EngineStats, RequestStats, ScheduledStats, StepStats
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    cfg = tiny_config_dict(max_position_embeddings=128)
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_weights(ModelConfig.from_dict(cfg)))

    def make() -> LLMEngine:
        # 2 slots, 20 tokens a step, 6 pages: 5 usable, so max_model_len = min(128, 5 * 16) = 80.
        config = EngineConfig(backend="numpy", max_num_seqs=2, max_num_batched_tokens=20, num_pages=6)
        return LLMEngine(load_checkpoint(path), config)

    return make


def waiting(request_id, prompt, output=0, preemptions=0) -> RequestStats:
    return RequestStats(request_id, "waiting", None, prompt, output, 0, 0, preemptions)


def test_a_fresh_engine(engine_factory):
    s = engine_factory().stats(requests=True)
    assert s == EngineStats(
        num_running=0, num_waiting=0, num_free_slots=2, num_pages=5, num_pages_used=0, num_pages_free=5,
        num_preemptions=0, num_steps=0, max_model_len=80, prefix_caching=True, num_cached_pages=0,
        num_prefix_cache_queries=0, num_prefix_cache_hits=0, running=(), waiting=(),
    )  # fmt: skip
    assert s.kv_cache_usage == 0.0 and s.prefix_cache_hit_rate == 0.0


def test_stats_step_by_step_through_chunked_prefill_and_a_preemption(engine_factory):
    engine = engine_factory()
    for request_id, prompt_len in (("a", 17), ("b", 30), ("c", 3)):
        engine.add_request(request_id, list(range(3, 3 + prompt_len)), PARAMS)
    s = engine.stats(requests=True)
    assert (s.num_running, s.num_waiting, s.num_free_slots, s.num_pages_used) == (0, 3, 2, 0)
    assert s.running == () and s.waiting == (waiting("a", 17), waiting("b", 30), waiting("c", 3))

    # Step 1: a's 17-token prompt (2 pages) and 3 of b's 30 (1 page) fill the 20-token budget; no slot for c.
    # Both were looked up (17 + 30 tokens), nothing was cached yet; then a's full first page is.
    engine.step()
    s = engine.stats(requests=True)
    assert s == EngineStats(
        num_running=2, num_waiting=1, num_free_slots=0, num_pages=5, num_pages_used=3, num_pages_free=2,
        num_preemptions=0, num_steps=1, max_model_len=80, prefix_caching=True, num_cached_pages=1,
        num_prefix_cache_queries=47, num_prefix_cache_hits=0,
        running=(RequestStats("a", "decode", 0, 17, 1, 17, 2, 0), RequestStats("b", "prefill", 1, 30, 0, 3, 1, 0)),
        waiting=(waiting("c", 3),),
    )  # fmt: skip
    assert s.running[0].num_tokens == 18 and s.kv_cache_usage == 3 / 5

    # Steps 2-3: a decodes; b prefills 19 more tokens (a second page), then its last 8 and samples.
    engine.step()
    engine.step()
    s = engine.stats(requests=True)
    assert s.running == (RequestStats("a", "decode", 0, 17, 3, 19, 2, 0), RequestStats("b", "decode", 1, 30, 1, 30, 2, 0))
    assert (s.num_pages_used, s.num_pages_free, s.num_steps) == (4, 1, 3)

    # Step n >= 3: a has 16 + n tokens computed, b 27 + n. b takes the last page at step 6 (33 tokens);
    # at step 17 a needs a third page, none is free, and b (the newest) is preempted: its 3 pages go
    # back, a takes one, b waits at the head of the queue with its 14 tokens (steps 3..16) kept.
    # Cached pages: a's first (step 1) and second (32 tokens, step 16), and b's second (step 5); b's
    # first page holds the same 16 tokens as a's, so it stayed an uncached copy.
    for _ in range(3, 17):
        engine.step()
    s = engine.stats(requests=True)
    assert s == EngineStats(
        num_running=1, num_waiting=2, num_free_slots=1, num_pages=5, num_pages_used=3, num_pages_free=2,
        num_preemptions=1, num_steps=17, max_model_len=80, prefix_caching=True, num_cached_pages=3,
        num_prefix_cache_queries=47, num_prefix_cache_hits=0,
        running=(RequestStats("a", "decode", 0, 17, 17, 33, 3, 0),),
        waiting=(waiting("b", 30, output=14, preemptions=1), waiting("c", 3)),
    )  # fmt: skip

    # Step 18: b comes back with 44 known tokens and finds 2 cached pages: a's first (now shared by
    # both) and its own second, which a's new page did not evict (b's tail page was freed first).
    engine.step()
    s = engine.stats(requests=True)
    assert (s.num_prefix_cache_queries, s.num_prefix_cache_hits) == (47 + 44, 32)
    # So it prefilled only its last 12 tokens (on a third page), all in this step, and sampled.
    assert s.running[1] == RequestStats("b", "decode", 1, 30, 15, 44, 3, 1)
    assert s.num_pages_used == 5 and s.prefix_cache_hit_rate == pytest.approx(32 / 91)

    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_free_slots, s.num_pages_used, s.num_pages_free) == (0, 0, 2, 0, 5)
    assert s.num_steps == engine.num_steps and s.num_preemptions == engine.num_preemptions >= 1


def test_counts_alone_unless_requests_are_asked_for_and_a_snapshot_never_changes(engine_factory):
    engine = engine_factory()
    engine.add_request("a", [5, 6, 7], PARAMS)
    before = engine.stats()
    assert before.running is None and before.waiting is None and before.num_waiting == 1
    engine.step()
    assert before.num_waiting == 1 and before.num_steps == 0  # values, not views of the engine
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.num_steps = 5



def test_page_ids_only_when_asked_for(engine_factory):
    engine = engine_factory()
    engine.add_request("a", list(range(3, 20)), PARAMS)  # 17 tokens: 2 pages
    engine.add_request("b", list(range(3, 33)), PARAMS)  # 30 tokens, 3 of them in step 0: 1 page
    engine.add_request("c", [4, 5, 6], PARAMS)
    engine.step()
    assert all(r.page_ids is None for r in engine.stats(requests=True).running)
    s = engine.stats(requests=True, pages=True)
    # A fresh pool hands out 1, 2, 3, ... (page 0 is the null page).
    assert [(r.request_id, r.page_ids) for r in s.running] == [("a", (1, 2)), ("b", (3,))]
    assert [(r.request_id, r.page_ids) for r in s.waiting] == [("c", ())]


def test_last_step_is_what_the_step_ran(engine_factory):
    engine = engine_factory()
    assert engine.last_step() is None
    for request_id, prompt_len in (("a", 17), ("b", 30), ("c", 3)):
        engine.add_request(request_id, list(range(3, 3 + prompt_len)), PARAMS)

    # Step 0: a's whole prompt (17 tokens, pages 1-2, samples), then 3 of b's 30 (page 3): the 20-token budget.
    engine.step()
    assert engine.last_step() == StepStats(
        step=0,
        sequences=(ScheduledStats("a", 0, "prefill", 0, 17, True, (1, 2)), ScheduledStats("b", 1, "prefill", 0, 3, False, (3,))),
        preempted_request_ids=(), num_free_pages=2, num_waiting=1,
    )  # fmt: skip
    assert engine.last_step().num_batched_tokens == 20

    # Step 1: a decodes its first generated token; b prefills 19 more (22 computed: page 4 joins).
    engine.step()
    assert engine.last_step() == StepStats(
        step=1,
        sequences=(
            ScheduledStats("a", 0, "decode", 17, 1, True, (1, 2)), ScheduledStats("b", 1, "prefill", 3, 19, False, (3, 4))
        ),
        preempted_request_ids=(), num_free_pages=1, num_waiting=1,
    )  # fmt: skip

    # Step 16 (the 17th): a needs a third page; b (pages 3-5) is preempted. Its pages join the prefix
    # cache's LRU queue last page first, so a gets page 5 (b's first pages stay findable longest).
    for _ in range(2, 17):
        engine.step()
    last = engine.last_step()
    assert last.step == 16 and last.preempted_request_ids == ("b",) and last.num_waiting == 2
    assert last.sequences == (ScheduledStats("a", 0, "decode", 32, 1, True, (1, 2, 5)),)
