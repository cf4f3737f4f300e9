"""The CUDA-graph decode path: buckets, and its padded packed inputs run (eagerly) in the simulator.

Recording needs a GPU (tests/test_engine_gpu.py replays graphs and compares with eager launches);
here `capture=False` runs every decode step on the graphs' own buffers: batch padded to a bucket,
block tables widened, one upload. The tokens must be NumPy's.
"""

import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.executor import kernel_runner
from numba_vllm.executor.cuda_graph import DecodeGraphs, batch_buckets
from numba_vllm.executor.inputs import MIN_TABLE_WIDTH
from numba_vllm.model import llama as model
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


def _sim_with_emulated_graphs(path, **engine_args):
    sim = LLM(path, backend="sim", **engine_args)
    runner = sim.engine.runner
    runner.decode_graphs = DecodeGraphs(runner.model, runner.max_num_seqs, capture=False)
    return sim


@pytest.mark.slow  # the whole model in the simulator, here and below
def test_padded_graph_inputs_give_numpy_tokens_in_the_simulator(tiny):
    path, want = tiny
    sim = _sim_with_emulated_graphs(path, max_num_seqs=4, num_pages=8)
    assert [o.outputs[0].token_ids for o in sim.generate(PROMPTS, GREEDY3)] == want
    assert set(sim.engine.runner.decode_graphs._graphs) == {(4, MIN_TABLE_WIDTH)}  # every decode step took the graph path


@pytest.mark.slow
def test_warm_up_runs_every_variant_on_the_null_page_and_changes_no_output(tiny, monkeypatch):
    """Warm-up steps (decode of 1 .. GEMV_MAX_TOKENS + 1 tokens, a full prefill, every graph bucket)
    write only the null page: the requests that follow still give NumPy's tokens. (Decode warm-ups
    cut to 1 and 2 tokens: each simulated step costs seconds, and their count changes nothing here.)"""
    path, want = tiny
    monkeypatch.setattr(kernel_runner, "GEMV_MAX_TOKENS", 1)
    prefill_rows = []  # the prefill attention grid's longest chunk, per call
    kernel = EngineConfig().prefill_attention  # the engine's default prefill attention
    prefill_attention = model.PREFILL_ATTENTIONS[kernel]

    def spy(*args):
        prefill_rows.append(args[-1])
        return prefill_attention(*args)

    monkeypatch.setitem(model.PREFILL_ATTENTIONS, kernel, spy)
    sim = _sim_with_emulated_graphs(path, max_num_seqs=2, num_pages=8, max_num_batched_tokens=16)
    sim.engine.warm_up()
    assert prefill_rows == [16]  # one layer: the full-budget prefill ran its attention
    assert set(sim.engine.runner.decode_graphs._graphs) == {(1, MIN_TABLE_WIDTH), (2, MIN_TABLE_WIDTH)}
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
