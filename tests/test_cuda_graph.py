"""The CUDA-graph paths: buckets, and their padded packed inputs run (eagerly) in the simulator.

Recording needs a GPU (tests/test_engine_gpu.py replays graphs and compares with eager launches);
here the graph classes without a recorder run every step on the graphs' own inputs: decode steps
padded to a batch bucket, steps with prefill tokens to a token bucket and cut into pieces with the
attention between them, one packed upload. The tokens must be NumPy's, and the eager path's.
"""

import numpy as np
import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.executor.cuda_graph import DecodeGraphs
from numba_vllm.executor.inputs import MIN_TABLE_WIDTH, batch_buckets
from numba_vllm.executor.piecewise_graphs import PiecewiseGraphs
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model import llama as model
from numba_vllm.model.config import PAGE_SIZE
from tests.helpers.tiny_llama import tiny_checkpoint


@pytest.mark.parametrize(
    "max_num_seqs, want",
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
     (160, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160])],
)  # fmt: skip
def test_batch_buckets(max_num_seqs, want):
    assert batch_buckets(max_num_seqs) == want


def test_batch_buckets_pad_by_at_most_an_eighth_past_eight():
    sizes = batch_buckets(512)
    for n in range(9, 513):
        bucket = min(b for b in sizes if b >= n)
        assert bucket - n < max(8, n / 8), n


PROMPTS = [[5], list(range(3, 18)), list(range(3, 20))]  # 3 sequences: bucket 4 has a padding row; 15 and 17 tokens
GREEDY3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer GQA model and its NumPy greedy tokens for PROMPTS."""
    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    return str(path), [o.outputs[0].token_ids for o in LLM(str(path), backend="numpy").generate(PROMPTS, GREEDY3)]


def _emulate_graphs(runner):
    runner.decode_graphs, runner.piecewise_graphs = DecodeGraphs(runner.model), PiecewiseGraphs(runner.model)


def _sim_with_emulated_graphs(path, **engine_args):
    sim = LLM(path, backend="sim", **engine_args)
    _emulate_graphs(sim.engine.runner)
    return sim


@pytest.mark.slow  # the whole model in the simulator, here and below
def test_padded_graph_inputs_give_numpy_tokens_in_the_simulator(tiny):
    path, want = tiny
    sim = _sim_with_emulated_graphs(path, max_num_seqs=4, num_pages=8)
    assert [o.outputs[0].token_ids for o in sim.generate(PROMPTS, GREEDY3)] == want
    runner = sim.engine.runner
    assert set(runner.decode_graphs._graphs) == {(4, MIN_TABLE_WIDTH)}  # every decode step took the graph path
    assert runner.piecewise_graphs.token_counts == {40}  # the 33-token prefill, padded to a token bucket


@pytest.mark.slow
def test_mixed_steps_in_pieces_give_the_eager_and_numpy_tokens(tiny):
    """An 8-token budget chunks a prompt while others decode: a step mixing a prefill chunk with two
    decodes (whose tokens, overlapped, come from the previous step on the device) runs in pieces, and
    the tokens are the eager path's (same padding, launch by launch) and NumPy's."""
    path, _ = tiny
    prompts, params = [[5], list(range(3, 9)), list(range(3, 12))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, backend="numpy").generate(prompts, params)]
    args = dict(max_num_seqs=4, num_pages=8, max_num_batched_tokens=8)
    graph = _sim_with_emulated_graphs(path, **args)
    graph_tokens = [o.outputs[0].token_ids for o in graph.generate(prompts, params)]
    eager = LLM(path, backend="sim", **args)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == graph_tokens == want
    assert eager.engine.runner.piecewise_graphs is None
    # 1 + 6 + 1 prompt tokens; 2 decodes beside 6 more of the third prompt; its last 2 (the others held: finishing)
    assert graph.engine.runner.piecewise_graphs.token_counts == {8, 2}


@pytest.mark.slow
def test_padding_writes_only_the_null_page(tiny):
    """One step of 33 prompt tokens padded to 40: the K/V pools change only at the prompts' kv indices
    and in the null page."""
    path, _ = tiny
    engine = LLMEngine(load_checkpoint(path), EngineConfig(backend="sim", max_num_seqs=4, num_pages=8))
    _emulate_graphs(engine.runner)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY3)
    plan = engine.scheduler.schedule()
    pools = engine.runner.model.k_cache, engine.runner.model.v_cache
    before = [pool.view(np.uint16).copy_to_host() for pool in pools]  # (L, P, PAGE_SIZE, KVH, HD)
    engine.runner.execute(plan)
    written = {(s.page_ids[pos // PAGE_SIZE], pos % PAGE_SIZE) for s in plan.sequences for pos in range(s.context_len)}
    for pool, old in zip(pools, before, strict=True):
        changed = np.argwhere((pool.view(np.uint16).copy_to_host() != old).any(axis=(0, 3, 4)))  # (page, slot) pairs
        assert {(int(p), int(o)) for p, o in changed} - written <= {(0, 0)}
    assert engine.runner.piecewise_graphs.token_counts == {40}


@pytest.mark.slow  # ~80 s alone on 2 cores: six token buckets, two decode graphs, then three prompts
@pytest.mark.timeout(900)  # (the default 300 s was reached under load, as test_engine's whole-model simulations)
def test_warm_up_runs_every_bucket_on_the_null_page_and_changes_no_output(tiny, monkeypatch):
    """Warm-up steps (one per token bucket, a prompt beside max_num_seqs - 1 decodes; then every
    decode graph) write only the null page: the requests that follow still give NumPy's tokens."""
    path, want = tiny
    prefill_rows = []  # the prefill attention grid's longest chunk, per call
    kernel = model.prefill_attention_name(EngineConfig().prefill_attention, 16)  # the default's kernel here (tiny: HD 16)
    prefill_attention = model.PREFILL_ATTENTIONS[kernel]

    def spy(*args):
        prefill_rows.append(args[-1])
        return prefill_attention(*args)

    monkeypatch.setitem(model.PREFILL_ATTENTIONS, kernel, spy)
    sim = _sim_with_emulated_graphs(path, max_num_seqs=2, num_pages=8, max_num_batched_tokens=16)
    sim.engine.warm_up()
    runner = sim.engine.runner
    assert runner.layout.token_sizes == [1, 2, 4, 8, 16, 18]
    assert prefill_rows == [1, 1, 3, 7, 15, 17]  # one layer: each bucket's prompt, beside one decode from 2 tokens on
    assert runner.piecewise_graphs.token_counts == {1, 2, 4, 8, 16, 18}
    assert set(runner.decode_graphs._graphs) == {(1, MIN_TABLE_WIDTH), (2, MIN_TABLE_WIDTH)}
    assert [o.outputs[0].token_ids for o in sim.generate(PROMPTS, GREEDY3)] == want


@pytest.mark.slow
def test_sampling_inside_the_graph_matches_the_eager_sampler(tiny):
    """A batch mixing greedy, seeded temperature and top-k rows: the graph path (sampler recorded with
    the step, its inputs packed as float32/uint32 bits) gives the eager path's tokens, and NumPy's
    for the greedy row."""
    path, want = tiny
    params = [
        GREEDY3,
        SamplingParams(temperature=0.9, seed=7, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=5, seed=3, max_tokens=3, ignore_eos=True),
    ]
    graph = _sim_with_emulated_graphs(path, max_num_seqs=4, num_pages=8).generate(PROMPTS[:3], params)
    eager = LLM(path, backend="sim", max_num_seqs=4, num_pages=8).generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]
    assert graph[0].outputs[0].token_ids == want[0]
