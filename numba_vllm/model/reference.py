"""The NumPy float32 Llama model: the oracle for every kernel, and the `numpy` backend.

Written for clarity, not speed: one function per operation, in the order a token flows through a
layer, each with its shapes. Kernel tests compare against these functions, and the engine can run
whole models with them on a machine without a GPU.

Names of sizes: T tokens in this call, D hidden size, H query heads, KVH key/value heads,
HD head dim, F MLP width, V vocabulary, L cached length (past + current tokens).
"""

from __future__ import annotations

import numpy as np

from numba_vllm.model.config import LAYER_TENSORS, ModelConfig, layer_tensor_name
from numba_vllm.model.rope_scaling import rope_cos_sin, rope_inv_freq


# ---- the operations ------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x (..., D) f32, weight (D,)."""
    x = x.astype(np.float32)
    inv_rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv_rms * weight).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate channel pairs (i, i + HD/2) of every head. x (T, heads, HD); cos, sin (T, HD/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, HD/2): the same angle for every head
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention of T queries over L cached keys.

    q (T, H, HD), k and v (L, KVH, HD), q_positions (T,): query t sees keys 0..q_positions[t].
    Query head h reads K/V head h // (H // KVH). Returns (T, H, HD) f32.
    """
    t, h, hd = q.shape
    kvh = k.shape[1]
    group = h // kvh
    qg = q.reshape(t, kvh, group, hd)  # (T, KVH, G, HD): heads sharing a K/V head side by side
    scores = np.einsum("tkgd,lkd->kgtl", qg, k) / np.sqrt(np.float32(hd))  # (KVH, G, T, L)
    visible = np.arange(k.shape[0])[None, :] <= q_positions[:, None]  # (T, L) causal mask
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("kgtl,lkd->tkgd", p, v)  # (T, KVH, G, HD)
    return out.reshape(t, h, hd).astype(np.float32)


def silu_and_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's elementwise part: silu(gate) * up, both (T, F)."""
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


# ---- the KV cache --------------------------------------------------------------------------------
class KVCache:
    """Keys and values of one sequence, contiguous in position order.

    k, v: (num_layers, max_len, KVH, HD) f32. The engine's paged pool offers the same two methods,
    so the model below does not care how the cache is laid out.
    """

    def __init__(self, config: ModelConfig, max_len: int):
        shape = (config.num_hidden_layers, max_len, config.num_key_value_heads, config.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)

    def write(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (T, KVH, HD) at the given positions (T,)."""
        self.k[layer, positions] = k
        self.v[layer, positions] = v

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions 0..length-1: two (length, KVH, HD) arrays."""
        return self.k[layer, :length], self.v[layer, :length]


# ---- the model -----------------------------------------------------------------------------------
class ReferenceModel:
    """A Llama forward pass in float32 NumPy over a `KVCache`."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        self.config = config
        f32 = {name: np.asarray(w, dtype=np.float32) for name, w in weights.items()}  # bf16/f16 -> f32 once
        self.embed = f32["model.embed_tokens.weight"]  # (V, D)
        self.lm_head = f32.get("lm_head.weight", self.embed)  # (V, D); tied models reuse the embedding
        self.final_norm = f32["model.norm.weight"]  # (D,)
        self.layers = [
            {key: f32[layer_tensor_name(i, key)] for key in LAYER_TENSORS}
            for i in range(config.num_hidden_layers)
        ]
        self.inv_freq = rope_inv_freq(config)  # (HD/2,)

    def forward(self, token_ids: np.ndarray, start_pos: int, cache: KVCache, all_logits: bool = False, trace=None) -> np.ndarray:
        """Run T new tokens at positions start_pos.. after the cached ones.

        Returns logits (V,) f32 of the last token, or (T, V) of every token when `all_logits`
        (generation needs only the last; tests compare all).

        Writes the new tokens' keys and values into the cache, so the next call continues from
        start_pos + T (prefill is one call over the prompt; each decode step is a call with T = 1).
        `trace(name, layer, array)`, if given, sees every intermediate under the names
        `DeviceModel.forward` uses (TRACE_POINTS), so the two can be compared op by op.
        """
        c = self.config
        trace = trace or _no_trace
        t = len(token_ids)
        positions = np.arange(start_pos, start_pos + t)  # (T,)
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # (T, HD/2) each
        x = self.embed[np.asarray(token_ids)]  # (T, D)
        trace("embed", None, x)
        for i, w in enumerate(self.layers):
            # attention block: x += o_proj(attention(rope(q), rope(k), v))
            h = rms_norm(x, w["attn_norm"], c.rms_norm_eps)  # (T, D)
            trace("attn_norm", i, h)
            q = (h @ w["q"].T).reshape(t, c.num_attention_heads, c.head_dim)  # (T, H, HD)
            k = (h @ w["k"].T).reshape(t, c.num_key_value_heads, c.head_dim)  # (T, KVH, HD)
            v = (h @ w["v"].T).reshape(t, c.num_key_value_heads, c.head_dim)  # (T, KVH, HD)
            trace("v", i, v)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            trace("q_rope", i, q)
            trace("k_rope", i, k)
            cache.write(i, positions, k, v)
            k_all, v_all = cache.read(i, start_pos + t)  # (L, KVH, HD) each
            attn = attention(q, k_all, v_all, positions)  # (T, H, HD)
            trace("attn", i, attn)
            x = x + attn.reshape(t, c.q_size) @ w["o"].T  # (T, D)
            trace("attn_residual", i, x)
            # MLP block: x += down(silu(gate(h)) * up(h))
            h = rms_norm(x, w["mlp_norm"], c.rms_norm_eps)
            trace("mlp_norm", i, h)
            act = silu_and_mul(h @ w["gate"].T, h @ w["up"].T)  # (T, F)
            trace("mlp_act", i, act)
            x = x + act @ w["down"].T  # (T, D)
            trace("mlp_residual", i, x)
        if not all_logits:
            x = x[-1]  # (D,): only the last token's next-token distribution is needed
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return (x @ self.lm_head.T).astype(np.float32)  # (V,) or (T, V)


# The intermediates both forwards report to a `trace` callback, in order ("embed" once, the rest per layer).
TRACE_POINTS = (
    "embed", "attn_norm", "v", "q_rope", "k_rope", "attn", "attn_residual", "mlp_norm", "mlp_act", "mlp_residual",
)  # fmt: skip


def _no_trace(name: str, layer: int | None, array) -> None:
    pass
