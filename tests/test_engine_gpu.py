"""The engine on a real GPU (cuda backend): a tiny GQA model step by step against the reference (also
reading cached prefixes), SmolLM2's greedy answers as on NumPy (with and without prefix caching),
batch invariance, the bf16 x that norms and SwiGLU write for gemm_wgmma (the conversion's logits, bit for bit).

Tolerance: weights and the KV cache are bf16 on the GPU, float32 in the NumPy reference, so logits
differ by ~1e-2 relative; a greedy choice can flip only where the top two logits are that close.
The five reference prompts have greedy margins >= 0.03 over their first 20 tokens, so the first 20
tokens must be identical. Batch invariance on the GPU is held to the same 20 tokens: a row's logits
do depend slightly on its batch, because the batch's token count picks the product's kernel, tiling
and K split (gemv up to 8 tokens, gemm_tc above), whose different summation orders, after bf16
rounding of activations and K/V, move logits by ~1e-3 relative: far below those margins.
"""

import numpy as np
import pytest

from numba_vllm import LLM, SamplingParams
from numba_vllm.kernels import gemm_wgmma, matmul
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model.reference import KVCache, ReferenceModel
from tests.helpers import GPU_TEST_MEMORY_SHARE
from tests.helpers.smollm2 import REF, needs_smollm2
from tests.helpers.tiny_llama import tiny_checkpoint

pytestmark = pytest.mark.gpu
FIRST = 20
LOGIT_RTOL = 2e-2  # bf16 weights and K/V against float32: measured ~4e-3 relative (by norm) on every step
PAGE_EDGE_PROMPTS = [[5], list(range(3, 18)), list(range(3, 19)), list(range(3, 20)), list(range(1, 34)), list(range(2, 300))]


@pytest.mark.parametrize("prefill_attention", ["tensor_cores", "wgmma"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (12, 4, 64), (16, 2, 128)])  # GQA 1, 3, 8
def test_tiny_model_on_cuda_follows_the_reference(tmp_path, heads, kv_heads, head_dim, prefill_attention):
    """Teacher-forced along the GPU's own tokens: every step's logits match the reference's, and the
    greedy pick is the reference's argmax up to that tolerance.

    Comparing token lists with the numpy backend is not a valid test on random weights: their top two
    logits are sometimes within 1e-3 of each other, and bf16 rounding then legitimately flips the pick.
    The prompts cross page edges (1, 15-17, 33 tokens) and one is chunked (298 tokens, 64-token budget),
    with each prefill attention kernel (wgmma on an H100 or H200 only).
    """
    if prefill_attention == "wgmma" and not matmul._hopper():
        pytest.skip("prefill_attention_wgmma needs sm_90a")
    path = tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=512, vocab_size=512, max_position_embeddings=512)  # fmt: skip
    gpu = LLM(str(path), backend="cuda", max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=False,
              prefill_attention=prefill_attention, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)  # fmt: skip
    logits = _record_sampled_logits(gpu.engine.runner)
    outs = gpu.generate(PAGE_EDGE_PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _assert_follows_the_reference(load_checkpoint(path), PAGE_EDGE_PROMPTS, outs, logits)


def test_prefix_cache_on_cuda_follows_the_reference(tmp_path):
    """Prompts sharing a 48-token prefix, with prefix caching: two run one after the other, then three
    together; all but the first reuse the 3 cached pages, so their prefill chunks start at position 48
    (the last, a repeat of the first, prefills only its last token). Every sampled step's logits still
    match the float32 reference over the whole sequence, as in the test above."""
    path = tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           intermediate_size=512, vocab_size=512, max_position_embeddings=512)  # fmt: skip
    gpu = LLM(str(path), backend="cuda", max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=False,
              gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)
    logits = _record_sampled_logits(gpu.engine.runner)
    shared = list(range(2, 50))  # 48 tokens: 3 full pages
    prompts = [shared + [60 + i] * n for i, n in enumerate((1, 15, 16, 17))] + [shared + [60]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [gpu.generate([p], params)[0] for p in prompts[:2]] + gpu.generate(prompts[2:], params)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48, 48, 48]
    _assert_follows_the_reference(load_checkpoint(path), prompts, outs, logits)


def _assert_follows_the_reference(ckpt, prompts, outs, logits) -> None:
    """Teacher-forced along the GPU's own tokens: each sampled step's logits (recorded by
    `_record_sampled_logits`) are within LOGIT_RTOL of the reference's, and the greedy pick is the
    reference's argmax up to that tolerance."""
    reference = ReferenceModel(ckpt.config, ckpt.weights)
    for prompt, out in zip(prompts, outs, strict=True):
        seq = prompt + out.outputs[0].token_ids
        want = reference.forward(np.asarray(seq), 0, KVCache(ckpt.config, len(seq)), all_logits=True)[len(prompt) - 1 : -1]
        got = np.stack(logits[out.request_id])  # (8, V): one row per sampled token
        assert got.shape == want.shape
        for step, (g, w, token) in enumerate(zip(got, want, out.outputs[0].token_ids, strict=True)):
            scale = float(np.sqrt(np.mean(w * w)))
            assert token == int(np.argmax(g)), (len(prompt), step)  # the device argmax picked from these logits
            assert np.linalg.norm(g - w) / np.linalg.norm(w) < LOGIT_RTOL, (len(prompt), step)
            assert w.max() - w[token] <= 2 * LOGIT_RTOL * scale, (len(prompt), step, w.max() - w[token])


def test_cuda_graph_replay_equals_eager_launches(tmp_path):
    """Steps replayed from CUDA graphs (whole decode steps, and the first step's prompts in pieces)
    give the eager path's logits and tokens, as the batch shrinks through the buckets (outputs of
    different lengths) and contexts cross page widths."""
    path = tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           intermediate_size=512, vocab_size=512, max_position_embeddings=1024)  # fmt: skip
    prompts = [list(range(1, 2 + 13 * i)) for i in range(11)]  # 1 .. 131 tokens
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(11)]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), backend="cuda", max_num_seqs=16, num_pages=256, enforce_eager=eager, async_scheduling=False)
        logits = _record_sampled_logits(llm.engine.runner)
        outs = llm.generate(prompts, params)
        runs[eager] = ([o.outputs[0].token_ids for o in outs], [np.stack(logits[o.request_id]) for o in outs], llm.engine.runner)
    assert runs[True][2].decode_graphs is None
    assert runs[False][2].decode_graphs.num_graphs >= 4  # batches of 11, 10 .. 1 use buckets 16, 8, 4, 2, 1
    assert runs[False][2].piecewise_graphs.num_graphs == 3 + 1  # the prompts' step: 3 pieces (2 layers), 1 head
    assert runs[False][0] == runs[True][0]
    for graph_logits, eager_logits in zip(runs[False][1], runs[True][1], strict=True):
        np.testing.assert_allclose(graph_logits, eager_logits, rtol=1e-5, atol=1e-5)


def test_bf16_x_from_norm_and_swiglu_gives_the_conversions_logits(tmp_path, monkeypatch):
    """The products that gemm_wgmma runs (gemm auto on an H100/H200) read the bf16 x that the norms and
    SwiGLU (in the gate/up product's epilogue) wrote: the same bits as SwiGLU on its own and the
    conversion pass, so the same logits, bit for bit, and the same tokens as with every x converted
    (the norm and SwiGLU written in f32 first); and only the o products (x: the attention output)
    launch the conversion. Prompts of 9 to 31 tokens, 12 sequences decoding."""
    if not matmul._hopper():
        pytest.skip("gemm auto runs gemm_wgmma on an H100/H200 only")
    path = tiny_checkpoint(tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           intermediate_size=768, vocab_size=512, max_position_embeddings=512)  # fmt: skip
    prompts = [list(range(2 + i, 11 + 2 * i)) for i in range(12)]  # 9 .. 31 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for producers in (False, True):
        with monkeypatch.context() as patch:
            if not producers:  # no view for a producer: every gemm_wgmma product converts its x, as before
                patch.setattr(matmul, "bf16_x_destination", lambda *args: None)
                patch.setattr(matmul, "silu_mul_destination", lambda *args: None)  # SwiGLU on its own, in f32
            llm = LLM(str(path), backend="cuda", max_num_seqs=16, num_pages=64, async_scheduling=False)
            logits = _record_sampled_logits(llm.engine.runner)
            outs = llm.generate(prompts, params)
            runs.append(([o.outputs[0].token_ids for o in outs], [np.stack(logits[o.request_id]) for o in outs]))
    assert runs[1][0] == runs[0][0]
    for got, want in zip(runs[1][1], runs[0][1], strict=True):
        np.testing.assert_array_equal(got, want)

    launches = []  # (kernel, its arguments) of every launch in gemm_wgmma, eager (no graph replays)
    real = gemm_wgmma.launch

    def recording(kernel_, grid, block, *args, **kwargs):
        launches.append((kernel_, args))
        return real(kernel_, grid, block, *args, **kwargs)

    monkeypatch.setattr(gemm_wgmma, "launch", recording)
    llm = LLM(str(path), backend="cuda", max_num_seqs=16, num_pages=64, async_scheduling=False, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == runs[0][0]
    c = llm.engine.runner.model.config
    o_shape = (c.hidden_size, c.num_attention_heads * c.head_dim)  # (N, K) of the o product alone (F = 768)
    converted = [args[0].shape[1] for kernel_, args in launches if kernel_ is gemm_wgmma._x_to_bf16_kernel]  # K
    # every other launch is a product (a K split sums its parts inside it)
    products = [args[3].shape for kernel_, args in launches if kernel_ is not gemm_wgmma._x_to_bf16_kernel]
    assert len(products) >= 4 * len(converted) > 0  # every step of > 8 tokens: 4 products a layer (and the head)
    assert converted == [o_shape[1]] * products.count(o_shape)  # one conversion per o product, none for the rest


def _record_sampled_logits(runner) -> dict[str, list]:
    """Wrap the runner's collect so each request's logits rows (V,) are kept, in step order (the
    engine must run serially: a step launched before this one is collected would overwrite them)."""
    seen: dict[str, list] = {}
    collect = runner.collect

    def recording(step):
        tokens = collect(step)
        host = runner.model.buffers["logits"].copy_to_host() if step.requests else None  # (>= B, V)
        for i, r in enumerate(step.requests):
            seen.setdefault(r.request_id, []).append(host[i])
        return tokens

    runner.collect = recording
    return seen


@pytest.fixture(scope="module")
def llm():
    return LLM(backend="cuda", max_num_seqs=8, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)


def _conv(case):
    return [{"role": "user", "content": case["prompt"]}]


@needs_smollm2
def test_smollm2_on_cuda_gives_the_reference_first_20_greedy_tokens(llm):
    outs = llm.chat([_conv(c) for c in REF["prompts"]], SamplingParams(temperature=0, max_tokens=FIRST))
    for out, case in zip(outs, REF["prompts"], strict=True):
        assert out.prompt_token_ids == case["prompt_ids"]
        assert out.outputs[0].token_ids == case["greedy_ids"][:FIRST], (case["prompt"], out.outputs[0].text)


@needs_smollm2
def test_smollm2_on_cuda_gives_the_reference_tokens_from_cached_prefixes(llm):
    """The chat template's header (and by now every whole prompt) is cached: the conversations
    prefill only their uncached tails and still give the reference's first 20 greedy tokens."""
    llm.chat([_conv(REF["prompts"][0])], SamplingParams(temperature=0, max_tokens=2))  # caches the header at least
    outs = llm.chat([_conv(c) for c in REF["prompts"]], SamplingParams(temperature=0, max_tokens=FIRST))
    assert all(o.num_cached_tokens > 0 for o in outs)
    for out, case in zip(outs, REF["prompts"], strict=True):
        assert out.outputs[0].token_ids == case["greedy_ids"][:FIRST], (case["prompt"], out.outputs[0].text)
    uncached = LLM(backend="cuda", max_num_seqs=8, enable_prefix_caching=False, gpu_memory_utilization=GPU_TEST_MEMORY_SHARE)
    outs = uncached.chat([_conv(c) for c in REF["prompts"]], SamplingParams(temperature=0, max_tokens=FIRST))
    assert all(o.num_cached_tokens == 0 for o in outs) and uncached.engine.stats().num_prefix_cache_hits == 0
    for out, case in zip(outs, REF["prompts"], strict=True):
        assert out.outputs[0].token_ids == case["greedy_ids"][:FIRST], (case["prompt"], out.outputs[0].text)


@needs_smollm2
def test_batch_invariance_on_cuda(llm):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    convs = [_conv(c) for c in REF["prompts"]]
    alone = [llm.chat([c], params)[0].outputs[0].token_ids[:FIRST] for c in convs]
    batched = [o.outputs[0].token_ids[:FIRST] for o in llm.chat(convs, params)]
    assert batched == alone
    small = LLM(backend="cuda", max_num_seqs=5, num_pages=12)  # 11 usable pages: forces preemption
    preempted = [o.outputs[0].token_ids[:FIRST] for o in small.chat(convs, params)]
    assert small.engine.num_preemptions > 0
    assert preempted == alone
