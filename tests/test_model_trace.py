"""The device forward against the NumPy reference, op by op (`trace`), on a ragged prefill batch.

A wrong token only says that something differs; comparing every intermediate names the first kernel
that disagrees. The device model runs the same step the engine would (several prompts of different
lengths in one batch, pages from the allocator); the reference runs each prompt alone and its rows
are stacked in the batch's order. Tolerance: weights are the same bf16 values on both sides; the
device stores K/V in bf16 and accumulates in a different order, so each intermediate must agree to
2e-2 relative (by norm), which a wrong kernel misses by far.
"""

import numpy as np
import pytest

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.checkpoint import load_checkpoint
from numba_vllm.model.reference import TRACE_POINTS, KVCache, ReferenceModel
from tests.helpers.tiny_llama import tiny_checkpoint

PROMPTS = [[5], list(range(3, 18)), list(range(3, 20))]  # 1, 15 and 17 tokens: one page, a page edge, two pages


def first_disagreement(path, backend: str) -> tuple[str, int | None, float] | None:
    """(name, layer, relative error) of the first intermediate that differs, or None."""
    ckpt = load_checkpoint(path)
    engine = LLMEngine(ckpt, EngineConfig(backend=backend, max_num_seqs=4, num_pages=16))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=1))
    plan = engine.scheduler.schedule()
    seqs = sorted(plan.sequences, key=lambda s: s.is_decode)  # the runner's order: prefill first
    device = {}
    inputs = engine.runner.inputs_for(seqs)  # what the runner hands the model (padded: rows past the step's are ignored)
    engine.runner.model.forward(inputs, trace=lambda n, layer, a: device.setdefault((n, layer), a))

    reference = ReferenceModel(ckpt.config, ckpt.weights)
    rows: dict = {}
    for seq in seqs:
        cache = KVCache(ckpt.config, len(seq.token_ids))
        reference.forward(
            np.asarray(seq.token_ids), 0, cache, trace=lambda n, layer, a: rows.setdefault((n, layer), []).append(a)
        )
    for layer in [None] + list(range(ckpt.config.num_hidden_layers)):
        for name in TRACE_POINTS:
            if (name, layer) not in rows:
                continue
            want = np.concatenate(rows[(name, layer)])
            got = device[(name, layer)][: len(want)]
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not np.isfinite(err) or err > 2e-2:
                return name, layer, err
    return None


def _checkpoint(tmp_path, heads, kv_heads, head_dim, hidden):
    return tiny_checkpoint(tmp_path, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, intermediate_size=64, vocab_size=64, num_hidden_layers=1,
                           max_position_embeddings=64)  # fmt: skip


@pytest.mark.slow  # the whole model in the simulator
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(3, 1, 16)])  # GQA 3 (the engine test covers GQA 2)
def test_simulated_forward_matches_reference_op_by_op(tmp_path, heads, kv_heads, head_dim):
    assert first_disagreement(_checkpoint(tmp_path, heads, kv_heads, head_dim, 32), "sim") is None


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (12, 4, 64), (16, 2, 128)])
def test_gpu_forward_matches_reference_op_by_op(tmp_path, heads, kv_heads, head_dim):
    assert first_disagreement(_checkpoint(tmp_path, heads, kv_heads, head_dim, 256), "cuda") is None
