"""The engine end to end on a tiny random Llama: batch invariance on NumPy, and the kernels (in the
simulator) agreeing with NumPy across page edges and with GQA."""

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.loading.checkpoint import load_checkpoint
from tests.helpers.tiny_llama import tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PAGE_EDGE_PROMPTS = [[5], list(range(3, 18)), list(range(3, 19)), list(range(3, 20)), list(range(1, 34))]  # 1/15/16/17/33


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128)  # GQA 2


@pytest.fixture(scope="module")
def alone(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy")
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PAGE_EDGE_PROMPTS]


def test_batched_equals_alone(tiny_dir, alone):
    outs = LLM(str(tiny_dir), backend="numpy", max_num_seqs=3).generate(PAGE_EDGE_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone


def test_staggered_arrivals_and_chunked_prefill_equal_alone(tiny_dir, alone):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", max_num_seqs=4, max_num_batched_tokens=8))
    outputs = {}
    pending = list(enumerate(PAGE_EDGE_PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step
            i, p = pending.pop(0)
            outputs[i] = engine.add_request(f"r{i}", p, GREEDY)
        engine.step()
    assert [outputs[i].token_ids for i in range(len(PAGE_EDGE_PROMPTS))] == alone


def test_preempted_and_recomputed_equals_alone(tiny_dir, alone):
    # 5 usable pages: the first four prompts take all of them (1+1+1+2), so when the 15-token one grows
    # onto a second page the newest running request is preempted, re-prefilled later, and must still
    # produce the same tokens.
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=5, num_pages=6)
    outs = llm.generate(PAGE_EDGE_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full_alone = [LLM(str(tiny_dir), backend="numpy").generate([p], longer)[0].token_ids for p in PAGE_EDGE_PROMPTS]
    assert [o.token_ids for o in outs] == full_alone
    assert llm.engine.num_preemptions > 0


def test_seeded_sampling_is_batch_invariant(tiny_dir):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=5, ignore_eos=True) for s in range(3)]
    llm = LLM(str(tiny_dir), backend="numpy")
    together = [o.token_ids for o in llm.generate(PAGE_EDGE_PROMPTS[:3], params)]
    apart = [llm.generate([p], sp)[0].token_ids for p, sp in zip(PAGE_EDGE_PROMPTS[:3], params, strict=True)]
    assert together == apart


def test_a_too_long_prompt_is_rejected_alone(tiny_dir):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy"))
    ok = engine.add_request("ok", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="the prompt has 128 tokens; the model's limit is 128"):
        engine.add_request("long", [1] * 128, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert ok.finish_reason == "length" and len(ok.token_ids) == 6


def test_abort_frees_pages(tiny_dir):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", num_pages=20))
    free = engine.scheduler.allocator.num_free_pages
    out = engine.add_request("a", list(range(40)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.scheduler.allocator.num_free_pages < free
    engine.abort_request("a")
    assert out.finish_reason == "abort" and engine.scheduler.allocator.num_free_pages == free
    assert not engine.has_unfinished_requests()


@pytest.mark.slow  # three prefill steps of the whole model in the simulator
def test_simulated_chunk_steps_that_sample_nothing(tiny_dir, alone):
    """A prompt longer than the token budget, alone: its first chunks sample no token (no logits)."""
    sim = LLM(str(tiny_dir), backend="sim", max_num_seqs=1, max_num_batched_tokens=16, num_pages=8)
    out = sim.generate([PAGE_EDGE_PROMPTS[4]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    assert out.token_ids == alone[4][:1]  # 33 tokens: chunks of 16 and 16 (no sample), then 1


@pytest.mark.slow  # five prompts through the whole model in the simulator: ~90 s on 2 cores
@pytest.mark.timeout(900)
def test_simulated_kernels_match_numpy_across_page_edges_with_gqa(tiny_dir, alone):
    """The cuda code path, run in the simulator, gives NumPy's greedy tokens (bf16 KV cache)."""
    sim = LLM(str(tiny_dir), backend="sim", max_num_seqs=8, num_pages=24)
    outs = sim.generate(PAGE_EDGE_PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [a[:3] for a in alone]


# ---- static batching ---------------------------------------------------------------------------


def run_recording_plans(engine: LLMEngine, prompts, params) -> tuple[list, list[tuple[set, set, set]]]:
    """Run every prompt; per step, the running request ids before and after scheduling, and the
    request ids in the step's plan."""
    outputs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    schedule, steps = engine.scheduler.schedule, []

    def recording_schedule():
        before = {r.request_id for r in engine.scheduler.running}
        plan = schedule()
        steps.append((before, {r.request_id for r in engine.scheduler.running}, {s.request.request_id for s in plan.sequences}))
        return plan

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished_requests():
        engine.step()
    return outputs, steps


MIXED = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 6, 1, 3)]


def test_static_scheduling_gives_the_same_tokens_and_admits_batch_by_batch(tiny_dir):
    def engine(scheduling):
        return LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", max_num_seqs=2, scheduling=scheduling))

    continuous, static = engine("continuous"), engine("static")
    c_outputs, _ = run_recording_plans(continuous, PAGE_EDGE_PROMPTS, MIXED)
    s_outputs, steps = run_recording_plans(static, PAGE_EDGE_PROMPTS, MIXED)
    assert [o.token_ids for o in s_outputs] == [o.token_ids for o in c_outputs]
    assert [len(o.token_ids) for o in s_outputs] == [9, 2, 6, 1, 3]
    batches = []
    for before, after, scheduled in steps:
        if before:  # a batch is running: nobody joins it
            assert after <= before and scheduled <= before
        elif after:
            batches.append(sorted(after))
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4"]] and static.scheduler.num_batches == 3
    # Static waits for each batch's longest request (9 + 6 + 3 steps); continuous refills slots as they free.
    assert static.num_steps == 18 > continuous.num_steps


def test_static_scheduling_with_preemption_equals_alone(tiny_dir):
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=5, num_pages=4, scheduling="static")  # 3 usable pages
    outs = llm.generate(PAGE_EDGE_PROMPTS, longer)
    full_alone = [LLM(str(tiny_dir), backend="numpy").generate([p], longer)[0].token_ids for p in PAGE_EDGE_PROMPTS]
    assert [o.token_ids for o in outs] == full_alone
    assert llm.engine.num_preemptions > 0


def test_bad_scheduling_mode_is_a_one_line_error():
    with pytest.raises(ValueError, match="^scheduling: 'dynamic' is not one of continuous, static$"):
        EngineConfig(scheduling="dynamic")
