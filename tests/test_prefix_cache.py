"""Prefix caching in the scheduler, exact on the CPU: which pages a request takes from the cache,
their reference counts, eviction order, and that caching changes no token. The fake model of
tests/test_scheduler.py runs the plans: it checks every attended position holds the K/V of its own
prefix (whoever computed it) and that nobody writes a page another request holds or the cache lists.
"""

import hashlib

import numpy as np
import pytest

from numba_vllm import LLM
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import PageAllocator
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.prefix_cache import PrefixCache, page_hash, root_hash
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import Scheduler
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model.config import PAGE_SIZE, ModelConfig
from tests.helpers.scheduling import FakeModel, next_token, step, summary
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint


def request(request_id: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), 0)


def caching_scheduler(num_pages: int, max_num_seqs: int = 4, budget: int = 128, max_model_len: int = 128, **kw):
    allocator = PageAllocator(num_pages, enable_caching=True)
    return Scheduler(max_num_seqs, budget, allocator, max_model_len, **kw), allocator, FakeModel(num_pages, allocator)


def refs(allocator: PageAllocator, page_ids) -> list[int]:
    return [allocator.ref_count(p) for p in page_ids]


PROMPT = list(range(100, 140))  # 40 tokens: 2 full pages and 8 more


# ---- the hash chain ------------------------------------------------------------------------------


def test_page_hashes_chain_sha256_over_int64_token_ids():
    root = root_hash(b"model-a")
    assert root == hashlib.sha256(b"numba-vllm prefix cache v1\0model-a").digest() != root_hash(b"model-b")
    tokens = list(range(16))
    want = hashlib.sha256(root + np.arange(16, dtype="<i8").tobytes()).digest()
    assert page_hash(root, tokens) == want
    assert page_hash(want, tokens) != want  # the same tokens after another page: another prefix
    assert page_hash(root, tokens[:15] + [16]) != want
    with pytest.raises(ValueError, match="only full pages"):
        page_hash(root, tokens[:15])


def test_prefix_cache_needs_a_caching_allocator():
    with pytest.raises(ValueError, match="without prefix caching"):
        PrefixCache(PageAllocator(8))
    assert EngineConfig().enable_prefix_caching  # on by default
    with pytest.raises(ValueError, match="enable_prefix_caching: 'yes' must be True or False"):
        EngineConfig(enable_prefix_caching="yes")


# ---- hits ------------------------------------------------------------------------------------------


def test_a_hit_takes_the_shared_full_pages_and_prefills_the_rest():
    scheduler, allocator, model = caching_scheduler(16)
    a = request("a", PROMPT)
    scheduler.add(a)
    step(scheduler, model)  # a: pages 1, 2 full (recorded in the cache), 3 partial
    assert a.page_ids == [1, 2, 3] and allocator.num_cached_pages == 2
    b = request("b", PROMPT[:32] + [7, 8, 9])  # the same two pages, then its own 3 tokens
    scheduler.add(b)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 40, 1, True), ("b", 1, 32, 3, True)]
    assert b.page_ids == [1, 2, 4] and refs(allocator, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert b.num_cached_tokens == 32 and a.num_cached_tokens == 0
    cache = scheduler.prefix_cache
    assert (cache.num_queries, cache.num_hits) == (40 + 35, 32)
    assert b.output_token_ids == [next_token(b.prompt_token_ids)]


def test_a_partial_hit_stops_at_the_first_page_that_differs():
    scheduler, allocator, model = caching_scheduler(16)
    scheduler.add(request("a", PROMPT))
    step(scheduler, model)
    b = request("b", PROMPT[:20] + [1] * 20)  # page 0 equal, page 1 differs from its 5th token
    c = request("c", [5] + PROMPT[1:])  # page 0 differs, so page 1 (equal tokens) is another prefix
    scheduler.add(b)
    scheduler.add(c)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 40, 1, True), ("b", 1, 16, 24, True), ("c", 2, 0, 40, True)]
    assert (b.page_ids, c.page_ids) == ([1, 4, 5], [6, 7, 8])
    assert refs(allocator, range(1, 9)) == [2, 1, 1, 1, 1, 1, 1, 1]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (16, 0)


def test_a_full_hit_still_computes_the_last_token():
    scheduler, allocator, model = caching_scheduler(16)
    scheduler.add(request("a", PROMPT[:33]))
    step(scheduler, model)  # a: pages 1, 2 full and cached, page 3 holds token 32
    b = request("b", PROMPT[:33])  # every full page hits: the last token (32) is computed, as a 1-token prefill
    c = request("c", PROMPT[:32])  # 32 tokens: taking both pages would leave nothing to compute; it takes one
    scheduler.add(b)
    scheduler.add(c)
    plan, sampled = step(scheduler, model)
    assert summary(plan) == [("a", 0, 33, 1, True), ("b", 1, 32, 1, True), ("c", 2, 16, 16, True)]
    assert not plan.sequences[1].is_decode  # a prompt token, though only one
    assert (b.page_ids, c.page_ids) == ([1, 2, 4], [1, 5])
    assert refs(allocator, range(1, 6)) == [3, 2, 1, 1, 1]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (32, 16)
    assert not allocator.is_cached(5) and allocator.num_cached_pages == 2  # c recomputed a's page 2: an uncached copy
    assert b.output_token_ids == [next_token(PROMPT[:33])] and c.output_token_ids == [next_token(PROMPT[:32])]
    assert sampled == [scheduler.running[0], b, c]


def test_pages_filled_by_generated_tokens_are_cached_too():
    scheduler, allocator, model = caching_scheduler(16)
    a = request("a", PROMPT[:30], max_tokens=8)
    scheduler.add(a)
    for _ in range(3):  # prefill 30 tokens, then decode positions 30 and 31: page 2 is full
        step(scheduler, model)
    assert a.num_computed_tokens == 32 and allocator.is_cached(a.page_ids[1])
    b = request("b", a.all_token_ids)  # a's prompt and its first 3 generated tokens
    scheduler.add(b)
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("a", 0, 32, 1, True), ("b", 1, 32, 1, True)] and b.page_ids[:2] == a.page_ids[:2]


# ---- eviction and pressure -----------------------------------------------------------------------


def test_free_cached_pages_are_evicted_least_recently_used_first():
    scheduler, allocator, model = caching_scheduler(8, max_model_len=96)  # 7 usable pages
    a_prompt, b_prompt = PROMPT[:33], list(range(500, 533))
    a, b = request("a", a_prompt), request("b", b_prompt)
    for r in (a, b):
        scheduler.add(r)
    step(scheduler, model)
    assert (a.page_ids, b.page_ids) == ([1, 2, 3], [4, 5, 6])
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    scheduler.finish(b, RequestStatus.FINISHED_STOPPED)
    # Free, least recently used first: the never-used 7, then a's 3, 2, 1, then b's 6, 5, 4 (each
    # block table's tail first). Full pages 1, 2, 4, 5 hold cached prefixes.
    assert allocator.num_free_pages == 7 and allocator.num_cached_pages == 4
    cache = scheduler.prefix_cache
    assert cache.find(request("a2", a_prompt)) == [1, 2] and cache.find(request("b2", b_prompt)) == [4, 5]
    c = request("c", list(range(900, 940)))  # 40 new tokens: 3 pages, evicting a's page 2
    scheduler.add(c)
    step(scheduler, model)
    assert c.page_ids == [7, 3, 2]
    assert cache.find(request("a2", a_prompt)) == [1] and cache.find(request("b2", b_prompt)) == [4, 5]
    f = request("f", list(range(950, 970)))  # 20 tokens: 2 pages, evicting a's page 1
    scheduler.add(f)
    step(scheduler, model)
    assert f.page_ids == [1, 6]
    assert cache.find(request("a2", a_prompt)) == [] and cache.find(request("b2", b_prompt)) == [4, 5]
    assert allocator.num_cached_pages == 2 + 2 + 1  # b's 2, c's 2, f's 1
    e = request("e", b_prompt)
    scheduler.add(e)
    plan, _ = step(scheduler, model)  # e would share 4 and 5, the last free pages: none left for its last token
    assert list(scheduler.waiting) == [e]
    scheduler.finish(c, RequestStatus.FINISHED_STOPPED)  # frees 2 (its partial tail), 3, 7
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("e", 0, 32, 1, True), ("f", 1, 21, 1, True)]
    assert e.page_ids == [4, 5, 2] and e.num_cached_tokens == 32


def test_pressure_evicts_cached_pages_before_preempting_anyone():
    scheduler, allocator, model = caching_scheduler(7, max_model_len=96)  # 6 usable pages
    old = request("old", list(range(700, 748)))  # 48 tokens: 3 full pages, all cached once computed
    scheduler.add(old)
    step(scheduler, model)
    scheduler.finish(old, RequestStatus.FINISHED_STOPPED)
    assert allocator.num_cached_pages == 3 and allocator.num_free_pages == 6  # free: 4, 5, 6, then old's 3, 2, 1
    a, b = request("a", PROMPT[:31], max_tokens=60), request("b", list(range(300, 310)), max_tokens=60)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, model)
    assert (a.page_ids, b.page_ids) == ([4, 5], [6])
    preempted = []
    while allocator.num_free_pages > 0:  # both decode; each new page evicts one of old's, LRU first
        plan, _ = step(scheduler, model)
        preempted += plan.preempted_request_ids
    assert preempted == [] and allocator.lookup(old.page_hashes[0]) is None
    assert (a.page_ids, b.page_ids) == ([4, 5, 3, 1], [6, 2])  # a took 3 at position 32, b 2 at 16, a 1 at 48
    assert allocator.num_cached_pages == (a.num_computed_tokens // PAGE_SIZE) + (b.num_computed_tokens // PAGE_SIZE)
    while not preempted:  # only now that no free page is left, cached or not, is the newest preempted
        plan, _ = step(scheduler, model)
        preempted += plan.preempted_request_ids
    assert preempted == ["b"]


# ---- preemption, abort, chunks, static batches -----------------------------------------------------


def test_a_preempted_request_finds_its_own_pages_when_it_comes_back():
    scheduler, allocator, model = caching_scheduler(6, max_model_len=80)  # 5 usable pages
    a, b = request("a", PROMPT[:24], max_tokens=40), request("b", list(range(600, 633)), max_tokens=40)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, model)
    assert (a.page_ids, b.page_ids) == ([1, 2], [3, 4, 5])  # b's pages 3, 4 are full: cached
    for _ in range(8):  # a decodes positions 24 .. 31
        plan, _ = step(scheduler, model)
    plan, _ = step(scheduler, model)  # a needs a page for 32: b, the newest, is preempted
    assert plan.preempted_request_ids == ["b"] and a.page_ids == [1, 2, 5]  # b's partial tail page went first
    b_tokens = b.all_token_ids  # 33 prompt + 9 generated
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    plan, sampled = step(scheduler, model)
    assert summary(plan) == [("b", 0, 32, 10, True)]  # only its last 10 known tokens are recomputed
    assert b.page_ids[:2] == [3, 4] and b.num_preemptions == 1 and b.num_cached_tokens == 0  # 0: its first admission's
    assert sampled == [b] and b.output_token_ids[-1] == next_token(b_tokens)
    assert (scheduler.prefix_cache.num_queries, scheduler.prefix_cache.num_hits) == (24 + 33 + 42, 32)


def test_abort_of_a_request_sharing_pages_leaves_them_to_the_others():
    scheduler, allocator, model = caching_scheduler(16)
    a, b = request("a", PROMPT), request("b", PROMPT[:32] + [1, 2])
    scheduler.add(a)
    step(scheduler, model)
    scheduler.add(b)
    step(scheduler, model)
    assert b.page_ids == [1, 2, 4] and refs(allocator, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert scheduler.abort("a")
    assert refs(allocator, [1, 2, 3, 4]) == [1, 1, 0, 1] and allocator.num_free_pages == 15 - 3
    scheduler.check_invariants()
    step(scheduler, model)  # b still reads pages 1 and 2: the fake model checks they hold its prefix
    c = request("c", list(range(800, 840)))
    scheduler.add(c)
    plan = scheduler.schedule()
    sampled = model.run(plan)
    assert scheduler.abort("c")  # aborted while its step ran: its pages are freed, and never cached
    scheduler.update(plan, sampled)
    c_pages = next(seq.page_ids for seq in plan.sequences if seq.request is c)
    assert c_pages == [5, 6, 7] and not any(allocator.is_cached(p) for p in c_pages) and allocator.num_cached_pages == 2
    scheduler.check_invariants()


def test_chunked_prefill_after_a_hit_starts_past_the_cached_pages():
    scheduler, allocator, model = caching_scheduler(16, budget=20)
    a = request("a", PROMPT[:32] + [3])
    scheduler.add(a)
    for _ in range(2):  # 20 + 13 tokens
        step(scheduler, model)
    a_pages = a.page_ids
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    b = request("b", PROMPT[:32] + list(range(50)))  # 82 tokens, 32 of them cached
    scheduler.add(b)
    chunks = []
    while not b.output_token_ids:
        plan, _ = step(scheduler, model)
        (seq,) = plan.sequences
        chunks.append((seq.start_position, seq.num_new_tokens, seq.samples))
    assert chunks == [(32, 20, False), (52, 20, False), (72, 10, True)]
    assert b.page_ids[:2] == a_pages[:2] == [1, 2] and b.num_cached_tokens == 32
    assert b.output_token_ids == [next_token(b.prompt_token_ids)]


def test_static_batch_members_take_their_cached_prefix_when_the_batch_forms():
    scheduler, allocator, model = caching_scheduler(6, max_model_len=64, scheduling="static")  # 5 usable pages
    a = request("a", PROMPT[:33])
    scheduler.add(a)
    step(scheduler, model)
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)  # pages 1, 2 cached; free, LRU first: 4, 5, 3, 2, 1
    b, c = request("b", PROMPT[:33] + [9] * 10), request("c", PROMPT[:16] + [8] * 17)
    d = request("d", list(range(400, 420)))
    for r in (b, c, d):
        scheduler.add(r)
    # b: 2 cached pages + 1 new; c: 1 cached (shared with b) + 2 new; d: 2 new pages. Together they
    # need 1 + 2 + 2 = 5 pages besides the shared cached ones (themselves free): 2 + 5 > 5, so d waits.
    plan, _ = step(scheduler, model)
    assert summary(plan) == [("b", 0, 32, 11, True), ("c", 1, 16, 17, True)] and list(scheduler.waiting) == [d]
    assert (b.page_ids, c.page_ids) == ([1, 2, 4], [1, 5, 3]) and refs(allocator, [1, 2]) == [2, 1]
    assert scheduler.num_batches == 2


# ---- the engine: the same greedy tokens with caching on and off -----------------------------------

SHARED = list(range(3, 40))  # 37 tokens: 2 full pages, then 5 more
ENGINE_PROMPTS = [
    SHARED + [50],  # 38 tokens
    SHARED + [51] * 12,  # 49: shares 2 pages with the first, then differs
    SHARED + [52] * 27,  # 64: a multiple of the page size
    SHARED + [50],  # the first again: every full page hits
    SHARED + [52] * 27,  # the third again: 3 of its 4 pages hit, the last is recomputed
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config_dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # GQA 2
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


@pytest.fixture(scope="module")
def uncached(tiny_dir):
    """Each prompt alone on an engine without prefix caching: the tokens every other run must give."""
    llm = LLM(str(tiny_dir), backend="numpy", enable_prefix_caching=False)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in ENGINE_PROMPTS]
    assert all(o.num_cached_tokens == 0 for o in outs) and llm.engine.stats().num_prefix_cache_queries == 0
    assert not llm.engine.stats().prefix_caching
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time_each_prompt_reuses_the_pages_before_it(tiny_dir, uncached):
    llm = LLM(str(tiny_dir), backend="numpy")
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in ENGINE_PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == uncached
    # The first prompt finds nothing; the next three share SHARED's 2 full pages (the fourth is the
    # first again, but its third page was never full: 38 + 5 computed tokens); the fifth finds 3 of
    # the third's pages (its 4th is its last page: recomputed, for the last token's logits).
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32, 48]
    s = llm.engine.stats()
    assert (s.num_prefix_cache_queries, s.num_prefix_cache_hits) == (sum(map(len, ENGINE_PROMPTS)), 32 * 3 + 48)


@pytest.mark.parametrize("max_num_seqs, budget, num_pages", [(5, 2048, None), (3, 8, None), (5, 2048, 6)],
                         ids=["batched", "chunked", "preempted"])  # fmt: skip
def test_batched_chunked_and_preempted_runs_give_the_uncached_tokens(tiny_dir, uncached, max_num_seqs, budget, num_pages):
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_pages=num_pages)
    engine = llm.engine
    outputs = {}
    pending = list(enumerate(ENGINE_PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step: later ones find what earlier ones computed
            i, p = pending.pop(0)
            outputs[i] = engine.add_request(f"r{i}", p, GREEDY)
        engine.step()
        engine.scheduler.check_invariants()
    assert [outputs[i].outputs[0].token_ids for i in range(len(ENGINE_PROMPTS))] == uncached
    assert engine.stats().num_prefix_cache_hits > 0
    if num_pages is not None:
        assert engine.num_preemptions > 0


def test_verbose_steps_show_shared_pages(tiny_dir, capsys):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", verbose=True))
    engine.add_request("first", ENGINE_PROMPTS[0], GREEDY)
    engine.step()
    engine.add_request("second", ENGINE_PROMPTS[1], GREEDY)
    engine.step()
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [
        "step 0:",
        "  slot   0  first        prefill    38 tok  pos 0..37  pages 3 (0 shared)",
        f"  38 tokens, {engine.stats().num_pages - 3} free pages, 0 waiting, 0 cached pages",
    ]
    assert lines[3:] == [
        "step 1:",
        "  slot   0  first        decode      1 tok  pos 38..38  pages 3 (2 shared)",
        "  slot   1  second       prefill    17 tok  pos 32..48  pages 4 (2 shared)",
        f"  18 tokens, {engine.stats().num_pages - 5} free pages, 0 waiting, 2 cached pages",
    ]


@pytest.mark.slow  # a whole model in the simulator
def test_simulated_kernels_read_a_cached_prefix(tiny_dir):
    """The cuda code path in the simulator gives the uncached NumPy tokens for a prompt whose every full
    page hits (a 1-token prefill at position 32) and, in the same step, one with its own tail (a
    9-token chunk at 32). Two steps in all, each of more than GEMV_MAX_TOKENS tokens: the simulator
    is slow, and slowest on the gemv kernels."""
    prompts = [SHARED[:33], SHARED[:33], SHARED[:32] + [60] * 9]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    numpy = LLM(str(tiny_dir), backend="numpy", enable_prefix_caching=False)
    want = [numpy.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    config = EngineConfig(backend="sim", max_num_seqs=2, num_pages=16, async_scheduling=False)  # serial: 2 calls, 2 steps
    sim = LLMEngine(load_checkpoint(tiny_dir), config)
    outs = [sim.add_request("first", prompts[0], params)]
    sim.step()  # computes (and caches) the first two pages
    outs += [sim.add_request(f"r{i}", p, params) for i, p in enumerate(prompts[1:])]
    sim.step()
    assert not sim.has_unfinished_requests() and sim.num_steps == 2
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    assert [o.outputs[0].token_ids for o in outs] == want
