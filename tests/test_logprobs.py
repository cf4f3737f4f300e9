"""Logprobs and prompt logprobs end to end, against transformers' log-softmax.

The model is the tiny random Llama whose float32 logits transformers computed for 37 tokens
(`tests/helpers/hf_tiny.py`, `tests/data/tiny_llama_hf_logits.npz`); the reference here is the
log-softmax of those logits in float64. On the numpy backend (float32 weights) the values agree to
~1e-4; in the simulator the weights and KV cache are bf16, so to ~0.05, and only the top ids that
transformers separates clearly are compared. The prompt logprobs come through a prefill cut in chunks
(and, in the simulator, the head run again over the prompt positions a few rows at a time).
"""

import numpy as np
import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.executor.cuda_graph import DecodeGraphs
from numba_vllm.executor.piecewise_graphs import PiecewiseGraphs
from tests.helpers import GPU_TEST_MEMORY_SHARE
from tests.helpers.hf_tiny import hf_tiny_case
from tests.helpers.tiny_llama import write_checkpoint

K = 4
PROMPT_LEN = 20  # the first 20 of the 37 tokens (the logits are causal: a prefix's are the same)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    cfg, _, weights, tokens, logits = hf_tiny_case("a")
    path = write_checkpoint(tmp_path_factory.mktemp("hf_a"), cfg, weights)
    z = logits.astype(np.float64)
    log_softmax = z - (np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) + z.max(1, keepdims=True))
    return str(path), [int(t) for t in tokens[:PROMPT_LEN]], log_softmax  # (37, V)


def _check(out, prompt, log_softmax, atol, gap):
    """out's prompt logprobs and first sampled token's logprobs against rows of log_softmax."""
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    positions = [(d, prompt[i + 1], log_softmax[i]) for i, d in enumerate(out.prompt_logprobs[1:])]
    completion = out.outputs[0]
    positions.append((completion.logprobs[0], completion.token_ids[0], log_softmax[len(prompt) - 1]))
    for d, token, ref in positions:
        order = np.argsort(-ref, kind="stable")  # transformers' ranking
        assert d[token].logprob == pytest.approx(ref[token], abs=atol)
        rank = int((ref >= ref[token]).sum())  # vLLM's rank: tokens at least as likely, itself included
        assert d[token].rank == rank or np.sort(np.abs(ref - ref[token]))[1] < gap
        tops = sorted((lp.rank, t) for t, lp in d.items() if lp.rank <= K and not (t == token and len(d) > K))
        assert [r for r, _ in tops] == list(range(1, K + 1)) and len(d) in (K, K + 1)
        for (r, t), want in zip(tops, order[:K], strict=True):
            assert t == want or abs(ref[t] - ref[want]) < gap, f"rank {r}: token {t}, transformers {want}"
            assert d[t].logprob == pytest.approx(ref[t], abs=atol)
    sampled = zip(completion.logprobs, completion.token_ids, strict=True)
    assert completion.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in sampled))


def test_numpy_backend_matches_transformers(case):
    path, prompt, log_softmax = case
    llm = LLM(path, backend="numpy", max_num_batched_tokens=8, long_prefill_token_threshold=8)  # the prompt in 3 chunks
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    out = llm.generate([prompt], p, use_tqdm=False)[0]
    _check(out, prompt, log_softmax, atol=2e-4, gap=1e-3)
    assert len(out.outputs[0].logprobs) == 3


def test_logprobs_are_of_the_raw_logits(case):
    """Temperature and penalties change the draw, not the logprobs (vLLM's default)."""
    path, prompt, log_softmax = case
    llm = LLM(path, backend="numpy")
    p = SamplingParams(temperature=0.5, seed=3, max_tokens=1, logprobs=0, repetition_penalty=2.0, logit_bias={5: 4.0})
    c = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    (token,) = c.token_ids
    assert list(c.logprobs[0]) == [token]
    assert c.logprobs[0][token].logprob == pytest.approx(log_softmax[PROMPT_LEN - 1][token], abs=2e-4)


def test_no_logprobs_asked_gives_none(case):
    path, prompt, _ = case
    out = LLM(path, backend="numpy").generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


@pytest.mark.slow  # the model in the simulator, its head over the prompt in chunks of 4 rows
def test_simulator_matches_transformers(case):
    path, prompt, log_softmax = case
    llm = LLM(path, backend="sim", max_num_seqs=4, num_pages=8)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    out = llm.generate([prompt], p, use_tqdm=False)[0]
    _check(out, prompt, log_softmax, atol=0.05, gap=0.1)


@pytest.mark.slow  # the model in the simulator, through the emulated graph paths: ~190 s alone on a slow 2-core machine
@pytest.mark.timeout(900)  # (a whole-model simulation, as test_engine's: the default 300 s was reached under load)
def test_simulator_prompt_logprobs_of_chunks_behind_other_rows_in_graph_steps(case):
    """Prompt chunks that do not lead their step (another prompt's rows first, then a decoding row)
    in padded steps run through the emulated piecewise and decode graphs: each chunk's positions are
    found where the packed step put them."""
    path, prompt, log_softmax = case
    llm = LLM(path, backend="sim", max_num_seqs=4, num_pages=8, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    runner = llm.engine.runner
    runner.decode_graphs, runner.piecewise_graphs = DecodeGraphs(runner.model), PiecewiseGraphs(runner.model)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    prompt = prompt[:10]  # two chunks: rows 3-7 of a step behind a 3-token prompt, then 5 rows before a decode
    outs = llm.generate([prompt[:3], prompt], [plain, p], use_tqdm=False)
    _check(outs[1], prompt, log_softmax, atol=0.05, gap=0.1)
    assert runner.piecewise_graphs.token_counts and outs[0].prompt_logprobs is None


@pytest.mark.gpu
def test_gpu_matches_transformers(case):
    """The cuda backend: prompt logprobs through the head in chunks, sampled tokens' logprobs from
    replayed decode graphs, with a request without logprobs beside it."""
    path, prompt, log_softmax = case
    llm = LLM(path, backend="cuda", max_num_seqs=4, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    out, plain = llm.generate([prompt, prompt], [p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)], use_tqdm=False)
    _check(out, prompt, log_softmax, atol=0.05, gap=0.1)
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(case):
    """A request asking for prompt logprobs computes every prompt position even when its prefix is
    cached; one that is preempted and recomputed keeps each position's logprobs once."""
    path, prompt, _ = case
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    alone = LLM(path, backend="numpy", enable_prefix_caching=False).generate([prompt], p, use_tqdm=False)[0]
    llm = LLM(path, backend="numpy", enable_prefix_caching=True)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prompt's first page
    again = llm.generate([prompt], p, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and _values(again) == _values(alone)
    crowded = LLM(path, backend="numpy", max_num_seqs=4, num_pages=6)  # 5 usable pages for 4 prompts of 2 pages at the end
    outs = crowded.generate([prompt[:15], prompt[:14], prompt[:13], prompt], p, use_tqdm=False)
    assert crowded.engine.num_preemptions > 0
    assert _values(outs[3]) == _values(alone)
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)


def _values(out):
    return [None if d is None else sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in out.prompt_logprobs]


def test_n_sequences_each_have_their_logprobs_and_the_prompt_has_one_list(case):
    path, prompt, log_softmax = case
    p = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=2, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    out = LLM(path, backend="numpy").generate([prompt], p, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt)
    for c in out.outputs:
        first = c.token_ids[0]
        assert c.logprobs[0][first].logprob == pytest.approx(log_softmax[PROMPT_LEN - 1][first], abs=2e-4)
        sampled = zip(c.logprobs, c.token_ids, strict=True)
        assert len(c.logprobs) == 2 and c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in sampled))
