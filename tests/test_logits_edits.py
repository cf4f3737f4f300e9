"""Penalties, logit_bias, min_tokens, bad_words and min_p, end to end, against formulas written here.

The reference is a greedy loop over the NumPy reference model (`model/reference.py`, independent of
the kernels) with each edit spelled out token by token below, as vLLM and transformers define it:
repetition_penalty over prompt and output tokens (a positive logit divided, a negative multiplied,
as transformers' RepetitionPenaltyLogitsProcessor), frequency and presence over output tokens,
logit_bias added before the penalties, min_tokens masking EOS. The engine must give the same tokens
on the numpy backend, in the simulator (the edits kernel), and through the emulated CUDA-graph path
(a replayed step sampled again on the edited logits). A step whose rows use none of it must launch
no edits or logprobs kernel.
"""

import numpy as np
import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.engine.sampling import sampling_probs
from numba_vllm.executor import kernel_runner
from numba_vllm.executor.cuda_graph import DecodeGraphs
from numba_vllm.executor.piecewise_graphs import PiecewiseGraphs
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model.reference import KVCache, ReferenceModel
from tests.helpers import GPU_TEST_MEMORY_SHARE
from tests.helpers.tiny_llama import tiny_checkpoint

PROMPT = [5, 6, 7, 8, 6]
EDITS = dict(repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={7: 3.0, 9: -100.0, 40: 1.5})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, vocab_size=64, max_position_embeddings=64)  # fmt: skip
    return str(path)


def _edited(logits, prompt, output, p: SamplingParams):
    """vLLM's edits of one row, one token at a time (float32 as the engine)."""
    z = logits.astype(np.float32).copy()
    eos = 2
    for t in range(len(z)):
        if t == eos and len(output) < p.min_tokens:
            z[t] = -np.inf
            continue
        v = z[t] + np.float32((p.logit_bias or {}).get(t, 0.0))
        if t in prompt or t in output:
            v = v / np.float32(p.repetition_penalty) if v > 0 else v * np.float32(p.repetition_penalty)
        n = output.count(t)
        if n:
            v = v - np.float32(p.frequency_penalty) * np.float32(n) - np.float32(p.presence_penalty)
        z[t] = v
    return z


def _reference_greedy(path, prompt, p: SamplingParams, n):
    ckpt = load_checkpoint(path)
    model = ReferenceModel(ckpt.config, ckpt.weights)
    cache = KVCache(ckpt.config, 64)
    logits = model.forward(np.array(prompt), 0, cache)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(_edited(logits, prompt, out, p))))
        logits = model.forward(np.array(out[-1:]), len(prompt) + len(out) - 1, cache)
    return out


def test_penalties_and_bias_on_numpy_match_the_formula(tiny):
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **EDITS)
    got = LLM(tiny, backend="numpy").generate([PROMPT], p, use_tqdm=False)[0]
    want = _reference_greedy(tiny, PROMPT, p, 8)
    plain = _reference_greedy(tiny, PROMPT, SamplingParams(temperature=0), 8)
    assert _tokens(got) == want and want != plain  # the edits changed the text, and as the formula says


def test_min_tokens_masks_eos_until_reached(tiny):
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={2: 100.0})  # EOS (2) wins once allowed
    out = _tokens(LLM(tiny, backend="numpy").generate([PROMPT], p, use_tqdm=False)[0])
    assert len(out) == 4 and out[-1] == 2 and 2 not in out[:3]


@pytest.mark.slow  # the model in the simulator: eager steps, then emulated graph steps
def test_penalties_and_bias_in_the_simulator_eager_and_graph(tiny):
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **EDITS)
    want = _reference_greedy(tiny, PROMPT, p, 4)
    sim = LLM(tiny, backend="sim", max_num_seqs=2, num_pages=8)
    assert _tokens(sim.generate([PROMPT], p, use_tqdm=False)[0]) == want
    runner = sim.engine.runner
    runner.decode_graphs, runner.piecewise_graphs = DecodeGraphs(runner.model), PiecewiseGraphs(runner.model)
    assert _tokens(sim.generate([PROMPT], p, use_tqdm=False)[0]) == want
    assert runner.decode_graphs._graphs and runner.piecewise_graphs.token_counts  # both graph paths ran


@pytest.mark.slow
def test_rows_without_edits_or_logprobs_launch_nothing_more(tiny, monkeypatch):
    calls = []  # (gather_rows also feeds overlapped steps' tokens: the raw rows' copy is not counted)
    for name in ("edit_logits", "logprobs"):
        real = getattr(kernel_runner, name)
        monkeypatch.setattr(kernel_runner, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    sim = LLM(tiny, backend="sim", max_num_seqs=2, num_pages=8)
    sim.generate([PROMPT, PROMPT[:2]], SamplingParams(temperature=0.7, seed=1, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert calls == []
    sim.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, presence_penalty=0.5), use_tqdm=False)
    assert calls == ["edit_logits"]


def test_min_p_keeps_tokens_above_min_p_times_the_top():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03]))
    for min_p, temperature in ((0.2, 1.0), (0.05, 1.0), (0.5, 2.0)):
        scaled = np.exp(logits / temperature)
        probs = scaled / scaled.sum()
        keep = probs >= min_p * probs.max()  # transformers' MinPLogitsWarper
        want = np.where(keep, probs, 0) / probs[keep].sum()
        got = sampling_probs(logits.astype(np.float32), SamplingParams(min_p=min_p, temperature=temperature))
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be non-negative token ids"),
        ({"logit_bias": {3: 101}}, "logit_bias values must be in [-100, 100]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be at most max_tokens"),
        ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer in [0, 20]"),
        ({"skip_special_tokens": 1}, "skip_special_tokens must be true or false"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    with pytest.raises(ValueError, match="logit_bias: token id 64 is outside the vocabulary"):
        LLM(tiny, backend="numpy").generate([PROMPT], SamplingParams(logit_bias={64: 1.0}), use_tqdm=False)


def _tokens(output):
    return output.outputs[0].token_ids if hasattr(output, "outputs") else output.token_ids


@pytest.mark.gpu
def test_penalties_and_bias_on_the_gpu_with_graphs_beside_plain_rows(tmp_path):
    """The cuda backend (decode steps replayed from CUDA graphs, edited rows sampled again), on a model
    of the sizes the GPU tests use. Teacher-forced, as test_engine_gpu: along the GPU's own tokens,
    each pick must be the argmax of the reference's edited logits up to bf16's error (random weights
    have near ties, so token lists are not compared), for the edited request and the plain ones."""
    path = str(tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                               intermediate_size=512, vocab_size=512, max_position_embeddings=512))  # fmt: skip
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **EDITS)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gpu = LLM(path, backend="cuda", max_num_seqs=4, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)
    prompts = [PROMPT, PROMPT, PROMPT[:3]]
    outs = gpu.generate(prompts, [p, plain, plain], use_tqdm=False)
    ckpt = load_checkpoint(path)
    model = ReferenceModel(ckpt.config, ckpt.weights)
    for prompt, params, out in zip(prompts, [p, plain, plain], outs, strict=True):
        tokens = _tokens(out)
        cache = KVCache(ckpt.config, 64)
        logits = model.forward(np.array(prompt), 0, cache)
        for i, token in enumerate(tokens):
            z = _edited(logits, prompt, tokens[:i], params)
            assert z[token] >= z.max() - 0.05 * max(1.0, abs(z.max())), (i, token, int(np.argmax(z)))
            logits = model.forward(np.array([token]), len(prompt) + i, cache)
    assert _tokens(outs[0]) != _tokens(outs[1])  # the edits changed the output


@pytest.mark.slow  # a few steps in the simulator
def test_min_p_one_keeps_only_the_top_token_on_every_backend(tiny):
    """min_p = 1 leaves only the most likely token: sampling at temperature 1 is then greedy, on the
    numpy backend and on the kernel path (whose device sampler hands min-p rows to the host)."""
    want = _reference_greedy(tiny, PROMPT, SamplingParams(temperature=0), 3)
    p = SamplingParams(temperature=1.0, min_p=1.0, seed=11, max_tokens=3, ignore_eos=True)
    assert _tokens(LLM(tiny, backend="numpy").generate([PROMPT], p, use_tqdm=False)[0]) == want
    assert _tokens(LLM(tiny, backend="sim", max_num_seqs=2, num_pages=8).generate([PROMPT], p, use_tqdm=False)[0]) == want


@pytest.mark.slow  # the model in the simulator, decode steps through the emulated graph path
def test_logprobs_of_edited_rows_in_replayed_steps_are_of_the_raw_logits(tiny):
    """A replayed decode step whose row both edits and asks for logprobs: the raw row is set aside
    before the edits, so the logprobs are the numpy backend's (raw logits), and the tokens the formula's."""
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, **EDITS)
    want = LLM(tiny, backend="numpy").generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    sim = LLM(tiny, backend="sim", max_num_seqs=2, num_pages=8)
    runner = sim.engine.runner
    runner.decode_graphs, runner.piecewise_graphs = DecodeGraphs(runner.model), PiecewiseGraphs(runner.model)
    got = sim.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids == _reference_greedy(tiny, PROMPT, p, 3)
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert set(g) == set(w) and all(abs(g[t].logprob - w[t].logprob) < 0.05 for t in g)
