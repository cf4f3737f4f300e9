"""The NumPy reference model against Hugging Face transformers' logits, and its KV-cache bookkeeping."""

import numpy as np
import pytest

from numba_vllm.model.reference import KVCache, ReferenceModel, apply_rope, attention, rms_norm
from tests.helpers.hf_tiny import hf_tiny_case


@pytest.mark.parametrize("case", ["a", "b", "c"])  # MHA-ish + tied; GQA 3 + llama3 rope + untied; MQA
def test_prefill_logits_match_transformers(case):
    _, config, weights, tokens, hf_logits = hf_tiny_case(case)
    model = ReferenceModel(config, weights)
    logits = model.forward(tokens, 0, KVCache(config, len(tokens)), all_logits=True)
    err = np.linalg.norm(logits - hf_logits) / np.linalg.norm(hf_logits)
    assert err < 1e-5, err


@pytest.mark.parametrize("case", ["a", "b"])
def test_chunked_prefill_and_decode_match_transformers(case):
    """Feeding the sequence in pieces through the cache gives transformers' one-shot logits."""
    _, config, weights, tokens, hf_logits = hf_tiny_case(case)
    model = ReferenceModel(config, weights)
    cache = KVCache(config, len(tokens))
    rows, pos = [], 0
    for size in (16, 1, 15, 1, 1, 2):  # chunks across the 16-token page edges, then single decodes
        rows.append(model.forward(tokens[pos : pos + size], pos, cache, all_logits=True))
        pos += size
    got = np.concatenate(rows)
    np.testing.assert_allclose(got, hf_logits[:pos], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(model.forward(tokens[pos : pos + 1], pos, cache), hf_logits[pos], rtol=1e-4, atol=1e-4)


def test_rms_norm_by_hand():
    x = np.array([[3.0, 4.0]], np.float32)
    got = rms_norm(x, np.array([1.0, 2.0], np.float32), eps=0.0)
    np.testing.assert_allclose(got, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)


def test_rope_rotates_pairs_i_and_i_plus_half():
    x = np.array([[[1.0, 0.0, 0.0, 2.0]]], np.float32)  # (T=1, heads=1, HD=4): pairs (0, 2) and (1, 3)
    a = np.array([[np.pi / 2, np.pi]], np.float32)  # angles of the two pairs
    got = apply_rope(x, np.cos(a), np.sin(a))
    np.testing.assert_allclose(got, [[[0.0, 0.0, 1.0, -2.0]]], atol=1e-6)


def test_attention_gqa_grouping_and_causality():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)  # 4 query heads
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)  # 2 K/V heads: heads 0,1 -> 0; 2,3 -> 1
    v = rng.standard_normal((3, 2, 8)).astype(np.float32)
    out = attention(q, k, v, np.arange(3))
    np.testing.assert_allclose(out[0, 3], v[0, 1], rtol=1e-6)  # the first query sees only key 0
    s = q[2, 2] @ k[:, 1].T / np.sqrt(8)
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(out[2, 2], p @ v[:, 1], rtol=1e-5)
