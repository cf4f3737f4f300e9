"""The engine end to end on a tiny random Llama: batch invariance on NumPy, and the kernels (in the
simulator) agreeing with NumPy across page edges and with GQA."""

import io
import re
import sys

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine, StepFailedError
from numba_vllm.kernels import gemm_wgmma
from numba_vllm.loading.checkpoint import load_checkpoint
from tests.helpers.tiny_llama import tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PAGE_EDGE_PROMPTS = [[5], list(range(3, 18)), list(range(3, 19)), list(range(3, 20)), list(range(1, 34))]  # 1/15/16/17/33


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128)  # GQA 2


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory):
    """tiny_dir's model with one layer, for the simulated runs of one kernel's path (the GQA test below
    takes two layers through the simulator)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("one_layer"), num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=1, max_position_embeddings=128)  # fmt: skip


@pytest.fixture(scope="module")
def alone(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy")
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PAGE_EDGE_PROMPTS]


def test_batched_equals_alone(tiny_dir, alone):
    outs = LLM(str(tiny_dir), backend="numpy", max_num_seqs=3).generate(PAGE_EDGE_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_staggered_arrivals_and_chunked_prefill_equal_alone(tiny_dir, alone):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", max_num_seqs=4, max_num_batched_tokens=8))
    outputs = {}
    pending = list(enumerate(PAGE_EDGE_PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step
            i, p = pending.pop(0)
            outputs[i] = engine.add_request(f"r{i}", p, GREEDY)
        engine.step()
    assert [outputs[i].outputs[0].token_ids for i in range(len(PAGE_EDGE_PROMPTS))] == alone


def test_preempted_and_recomputed_equals_alone(tiny_dir, alone):
    # 5 usable pages: the first four prompts take all of them (1+1+1+2), so when the 15-token one grows
    # onto a second page the newest running request is preempted, re-prefilled later, and must still
    # produce the same tokens.
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=5, num_pages=6)
    outs = llm.generate(PAGE_EDGE_PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full_alone = [LLM(str(tiny_dir), backend="numpy").generate([p], longer)[0].outputs[0].token_ids for p in PAGE_EDGE_PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == full_alone
    assert llm.engine.num_preemptions > 0


def test_seeded_sampling_is_batch_invariant(tiny_dir):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=5, ignore_eos=True) for s in range(3)]
    llm = LLM(str(tiny_dir), backend="numpy")
    together = [o.outputs[0].token_ids for o in llm.generate(PAGE_EDGE_PROMPTS[:3], params)]
    apart = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(PAGE_EDGE_PROMPTS[:3], params, strict=True)]
    assert together == apart


def test_a_too_long_prompt_is_rejected_alone(tiny_dir):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy"))
    ok = engine.add_request("ok", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="the prompt has 128 tokens; this model's maximum context length is 128"):
        engine.add_request("long", [1] * 128, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 6


def test_abort_frees_pages(tiny_dir):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", num_pages=20))
    out = engine.add_request("a", list(range(40)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().num_pages_free == 19 - 3  # 40 tokens on 3 of the 19 usable pages
    engine.abort_request("a")
    assert out.outputs[0].finish_reason == "abort" and engine.stats().num_pages_free == 19
    assert not engine.has_unfinished_requests()


# ---- head-of-line blocking on the CPU backends -------------------------------------------------


def test_a_short_request_interleaves_with_a_long_prefill_on_numpy(tmp_path):
    engine = LLMEngine(
        load_checkpoint(tiny_checkpoint(tmp_path, max_position_embeddings=4096)),
        EngineConfig(backend="numpy"),  # the defaults: the CPU backends' small step budget
    )
    long = engine.add_request("long", [3] * 3000, GREEDY)
    engine.step()
    short = engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1))
    while not short.finished:
        engine.step()
    (running,) = engine.stats(requests=True).running
    assert running.request_id == "long" and not long.outputs[0].token_ids
    # The short one waited for one 128-token chunk, not for 3000 tokens (a third chunk was launched
    # while its token came back: overlapped scheduling).
    assert running.num_computed_tokens <= 3 * 128


def test_numpy_steps_run_on_one_blas_thread_and_leave_the_setting_alone(tiny_dir):
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy"))
    seen = []
    forward = engine.runner.model.forward

    def spy(*args, **kwargs):
        seen.append(blas_threads())
        return forward(*args, **kwargs)

    engine.runner.model.forward = spy
    with threadpool_limits(limits=2, user_api="blas"):  # the process's own setting, whatever it is
        engine.add_request("a", [1, 2, 3], GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        assert blas_threads() == {2}
    assert seen and all(s == {1} for s in seen)


# ---- a step that fails -------------------------------------------------------------------------


def test_a_failed_step_fails_only_its_requests_and_the_engine_goes_on(tiny_dir, alone):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", max_num_seqs=2))
    outputs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PAGE_EDGE_PROMPTS[:3])]  # r2 waits
    engine.step()  # r0 and r1 prefilled: they hold pages and slots
    launch = engine.runner.launch

    def failing(plan, previous=None):
        raise FloatingPointError("NaN in the sampler")

    engine.runner.launch = failing
    failed = engine.step()
    assert [o.request_id for o in failed] == ["r0", "r1"]
    assert all(o.outputs[0].finish_reason == "error" and "FloatingPointError: NaN in the sampler" in o.error for o in failed)
    engine.scheduler.check_invariants()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_pages_used, stats.num_failed_steps) == (0, 1, 0, 1)

    engine.runner.launch = launch  # the next steps run r2, then a new request, as on a fresh engine
    while engine.has_unfinished_requests():
        engine.step()
    late = engine.add_request("late", PAGE_EDGE_PROMPTS[3], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert outputs[2].outputs[0].token_ids == alone[2] and late.outputs[0].token_ids == alone[3]
    assert engine.stats().num_pages_used == 0


def test_an_interrupted_step_fails_nobody(tiny_dir, alone):
    engine = LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy"))
    out = engine.add_request("a", PAGE_EDGE_PROMPTS[4], GREEDY)
    engine.step()
    launch = engine.runner.launch

    def interrupted(plan, previous=None):
        raise KeyboardInterrupt

    engine.runner.launch = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.runner.launch = launch
    while engine.has_unfinished_requests():
        engine.step()
    assert out.outputs[0].token_ids == alone[4] and engine.stats().num_failed_steps == 0


def test_llm_generate_raises_for_a_failed_step_and_stays_usable(tiny_dir, alone):
    llm = LLM(str(tiny_dir), backend="numpy")
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda plan, previous=None: 1 / 0
    with pytest.raises(StepFailedError, match="ZeroDivisionError"):
        llm.generate(PAGE_EDGE_PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.engine.runner.launch = launch
    assert [o.outputs[0].token_ids for o in llm.generate(PAGE_EDGE_PROMPTS[:2], GREEDY, use_tqdm=False)] == alone[:2]


def test_a_tiny_temperature_is_greedy(tiny_dir, alone):
    llm = LLM(str(tiny_dir), backend="numpy")
    params = SamplingParams(temperature=1e-310, max_tokens=6, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PAGE_EDGE_PROMPTS[:2], params, use_tqdm=False)] == alone[:2]


@pytest.mark.slow  # three prefill steps of the whole model in the simulator
def test_simulated_chunk_steps_that_sample_nothing(one_layer_dir):
    """A prompt longer than the token budget, alone: its first chunks sample no token (no logits)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    want = LLM(str(one_layer_dir), backend="numpy").generate([PAGE_EDGE_PROMPTS[4]], params, use_tqdm=False)[0]
    sim = LLM(str(one_layer_dir), backend="sim", max_num_seqs=1, max_num_batched_tokens=16, num_pages=8)
    out = sim.generate([PAGE_EDGE_PROMPTS[4]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids  # 33 tokens: chunks of 16 and 16 (no sample), then 1


@pytest.mark.slow  # five prompts through the whole model in the simulator: ~90 s on 2 cores
@pytest.mark.timeout(900)
def test_simulated_kernels_match_numpy_across_page_edges_with_gqa(tiny_dir, alone):
    """The cuda code path, run in the simulator, gives NumPy's greedy tokens (bf16 KV cache)."""
    sim = LLM(str(tiny_dir), backend="sim", max_num_seqs=8, num_pages=24)
    outs = sim.generate(PAGE_EDGE_PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [a[:3] for a in alone]


@pytest.mark.slow  # prefill steps through the wgmma attention (288-thread blocks) in the simulator
def test_simulated_wgmma_prefill_attention_gives_numpy_tokens(tmp_path):
    """prefill_attention_wgmma (whole 64-dim panels: a head dim of 64) in the engine, beside gemm_wgmma's
    products as on a Hopper GPU: prompts across page edges, one chunked after its first 16 tokens,
    give NumPy's greedy tokens."""
    path = tiny_checkpoint(tmp_path, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_hidden_layers=1, max_position_embeddings=128)  # fmt: skip
    prompts = [[5], list(range(3, 19)), list(range(1, 34))]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), backend="numpy").generate(prompts, params, use_tqdm=False)]
    sim = LLM(str(path), backend="sim", prefill_attention="wgmma", prefill_gemm="wgmma", max_num_seqs=4,
              max_num_batched_tokens=32, num_pages=16)  # fmt: skip
    assert [o.outputs[0].token_ids for o in sim.generate(prompts, params, use_tqdm=False)] == want


@pytest.mark.slow  # three steps of 9 sequences through the whole model in the simulator
def test_simulated_wgmma_products_give_numpy_tokens_with_bf16_x_from_norm_and_swiglu(one_layer_dir, monkeypatch):
    """gemm_wgmma (the Hopper GEMM, which the simulator runs when asked) on every product of more than 8
    tokens: a 27-token prefill step (3-token prompts) and decode steps of 9 sequences give NumPy's greedy tokens, and
    only the o products (x: the attention output) run the conversion pass; the norms and SwiGLU (in
    the gate/up product's epilogue) write the bf16 x themselves."""
    launches = []  # every kernel gemm_wgmma launches
    real = gemm_wgmma.launch

    def recording(kernel_, *args, **kwargs):
        launches.append(kernel_)
        return real(kernel_, *args, **kwargs)

    monkeypatch.setattr(gemm_wgmma, "launch", recording)
    prompts = [[3 + i, 40 + 2 * i, 90 - i] for i in range(9)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(one_layer_dir), backend="numpy").generate(prompts, params, use_tqdm=False)]
    sim = LLM(str(one_layer_dir), backend="sim", prefill_gemm="wgmma", max_num_seqs=16, max_num_batched_tokens=64, num_pages=24)
    assert [o.outputs[0].token_ids for o in sim.generate(prompts, params, use_tqdm=False)] == want
    layers = load_checkpoint(one_layer_dir).config.num_hidden_layers
    conversions = launches.count(gemm_wgmma._x_to_bf16_kernel)
    products = len(launches) - conversions  # (a K split sums its parts inside the product's kernel)
    assert products == 3 * (4 * layers + 1)  # 3 steps (prefill, 2 decodes): qkv, o, gate_up, down a layer; the head
    assert conversions == 3 * layers  # the o products'
    fused = {gemm_wgmma.gemm_wgmma_kernel_for(config, True) for config in gemm_wgmma.TILE_CONFIGS}
    assert sum(kernel_ in fused for kernel_ in launches) == 3 * layers  # gate/up with SwiGLU in the epilogue


# ---- static batching ---------------------------------------------------------------------------


def run_recording_admissions(engine: LLMEngine, prompts, params) -> tuple[list, list[tuple[set, set]]]:
    """Run every prompt; per step, the requests running before it and those it admitted (running
    after it, or finished by it, and not running before)."""
    outputs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    steps = []
    while engine.has_unfinished_requests():
        before = {r.request_id for r in engine.stats(requests=True).running}
        stepped = {o.request_id for o in engine.step()}
        after = {r.request_id for r in engine.stats(requests=True).running}
        steps.append((before, (after | stepped) - before))
    return outputs, steps


MIXED = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 6, 1, 3)]


def test_static_scheduling_gives_the_same_tokens_and_admits_batch_by_batch(tiny_dir):
    def engine(scheduling):
        return LLMEngine(load_checkpoint(tiny_dir), EngineConfig(backend="numpy", max_num_seqs=2, scheduling=scheduling))

    continuous, static = engine("continuous"), engine("static")
    c_outputs, _ = run_recording_admissions(continuous, PAGE_EDGE_PROMPTS, MIXED)
    s_outputs, steps = run_recording_admissions(static, PAGE_EDGE_PROMPTS, MIXED)
    assert [o.outputs[0].token_ids for o in s_outputs] == [o.outputs[0].token_ids for o in c_outputs]
    assert [len(o.outputs[0].token_ids) for o in s_outputs] == [9, 2, 6, 1, 3]
    batches = []
    for before, admitted in steps:
        if before:  # a batch is running: nobody joins it
            assert not admitted
        elif admitted:
            batches.append(sorted(admitted))
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    # Static waits for each batch's longest request (9 + 6 + 3 steps); continuous refills slots as they free.
    assert static.num_steps == 18 > continuous.num_steps


def test_static_scheduling_with_preemption_equals_alone(tiny_dir):
    longer = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=5, num_pages=4, scheduling="static")  # 3 usable pages
    outs = llm.generate(PAGE_EDGE_PROMPTS, longer)
    full_alone = [LLM(str(tiny_dir), backend="numpy").generate([p], longer)[0].outputs[0].token_ids for p in PAGE_EDGE_PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == full_alone
    assert llm.engine.num_preemptions > 0


def test_bad_scheduling_mode_is_a_one_line_error():
    with pytest.raises(ValueError, match="^scheduling: 'dynamic' is not one of continuous, static$"):
        EngineConfig(scheduling="dynamic")


# ---- offline progress bar ----------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir), backend="numpy", max_num_seqs=2)
    for stderr, use_tqdm in ((io.StringIO(), True), (_Terminal(), False)):  # not a terminal; not asked for
        monkeypatch.setattr(sys, "stderr", stderr)
        llm.generate(PAGE_EDGE_PROMPTS, GREEDY, use_tqdm=use_tqdm)
        assert stderr.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    llm.generate(PAGE_EDGE_PROMPTS, GREEDY)
    final = terminal.getvalue().split("\r")[-1]  # tqdm redraws the line in place
    rates = r"input [\d.]+ tok/s, output [\d.]+ tok/s"
    assert re.match(rf"Processed prompts: 100%.*\| 5/5 \[\d\d:\d\d<00:00, .*prompt/s, {rates}\]\n$", final)
