"""The Llama forward pass on the device: the layer loop, calling the kernel launchers in order.

One call runs one engine step: a ragged batch of T new tokens in which the prefilling sequences'
tokens come first (prompts or prompt chunks, attended by the prefill kernel) and the decoding
sequences' single tokens last (attended by the paged decode kernel). Activations are float32, weights
bf16, the KV cache bf16 in 16-token pages. Per layer:

    h = rmsnorm(x)                       attn_norm
    qkv = h @ [Wq; Wk; Wv].T             (q, k and v as one product)
    rope(q, k) at each token's position  (Llama-3 scaled frequencies from the host), fused with
      storing k and v at the tokens' kv indices in the paged cache; q goes to its own buffer
    a = prefill_attention(q[:Tp]) | decode_attention(q[Tp:])   over the pages in the block tables
    x += a @ Wo.T                        (the residual add is fused into the product)
    h = rmsnorm(x)                       mlp_norm
    a = silu(h @ Wg.T) * (h @ Wu.T)      (gate and up as one product)
    x += a @ Wd.T                        (the add fused again)

Each norm is handed to the product after it (`linear(..., norm=...)`), and SwiGLU to the gate/up
product (`silu_mul`): in a decode-sized step gemv applies the norm as it loads x and SwiGLU as it
stores, so they cost no launch and no pass over memory; in a prefill they run as their own kernels.
then the last token of every sampling sequence is gathered, normed and multiplied by the head (`head`).
Sizes: T tokens, Tp of them prefill; D hidden, H heads, KVH kv heads, HD head dim, F MLP width,
V vocabulary, B sampled rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import cuda

from numba_vllm.kernels import matmul
from numba_vllm.kernels._launch import num_sms
from numba_vllm.kernels.decode_attention import decode_attention
from numba_vllm.kernels.decode_attention import split_workspace_floats as attention_workspace_floats
from numba_vllm.kernels.embedding import embedding
from numba_vllm.kernels.gather import gather_rows
from numba_vllm.kernels.gemm_tc import split_workspace_floats as gemm_tc_workspace_floats
from numba_vllm.kernels.prefill_attention import prefill_attention as prefill_attention_cuda_cores
from numba_vllm.kernels.prefill_attention_tc import prefill_attention_tc
from numba_vllm.kernels.rmsnorm import rms_norm
from numba_vllm.kernels.rope import rope_and_cache_write
from numba_vllm.kernels.sample import SAMPLE_WORKSPACE_SLOTS, PartWinners
from numba_vllm.loading.bf16 import bf16_from_bits, empty_bf16_device, to_bf16, upload_bf16
from numba_vllm.model.config import LAYER_TENSORS, PAGE_SIZE, ModelConfig, layer_tensor_name
from numba_vllm.model.rope_scaling import rope_inv_freq

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

PREFILL_ATTENTIONS = {  # by EngineConfig.prefill_attention
    "cuda_cores": prefill_attention_cuda_cores,
    "tensor_cores": prefill_attention_tc,
}


@dataclass
class StepInputs:
    """One step's device arrays (int32), built from the scheduler's plan by `executor/inputs.py`.

    The CUDA-graph path leaves the prefill fields None (its steps have no prefill tokens)."""

    token_ids: DeviceNDArray  # (T,) prefill tokens first, then one token per decoding sequence
    positions: DeviceNDArray  # (T,)
    kv_indices: DeviceNDArray  # (T,) page_id * PAGE_SIZE + offset: where each token's K/V is written
    num_prefill_tokens: int  # Tp
    prefill_cu_seqlens: DeviceNDArray | None  # (Sp + 1,) offsets of each prefilling sequence's tokens in [0, Tp)
    prefill_start_pos: DeviceNDArray | None  # (Sp,) position of each prefilling sequence's first new token
    prefill_block_tables: DeviceNDArray | None  # (Sp, max_pages)
    prefill_max_new_tokens: int  # the longest prefill chunk (sizes the prefill grid)
    decode_block_tables: DeviceNDArray  # (Sd, W) W = inputs.table_width(longest)
    decode_context_lens: DeviceNDArray  # (Sd,) cached tokens each decoding sequence attends to, itself included
    sample_rows: DeviceNDArray  # (B,) rows of the T tokens whose logits are needed


class DeviceModel:
    """A Llama model's bf16 weights on the device, its KV cache, and `forward`."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, np.ndarray], prefill_gemm: str = "tensor_cores",
        prefill_attention: str = "tensor_cores",
    ):
        """Upload the weights. `prefill_gemm` and `prefill_attention` name the kernels of steps with more
        than a few tokens (`EngineConfig`'s fields of the same names; one of `PREFILL_GEMMS` and
        `PREFILL_ATTENTIONS`)."""
        self.config = c = config
        self.gemm = prefill_gemm
        self.prefill_attention = PREFILL_ATTENTIONS[prefill_attention]
        self.embed = upload_bf16(to_bf16(weights["model.embed_tokens.weight"]))  # (V, D)
        self.lm_head = self.embed if c.tie_word_embeddings else upload_bf16(to_bf16(weights["lm_head.weight"]))
        self.final_norm = upload_bf16(to_bf16(weights["model.norm.weight"]))  # (D,)
        self.layers = []
        for i in range(c.num_hidden_layers):
            w = {key: weights[layer_tensor_name(i, key)] for key in LAYER_TENSORS}
            qkv = np.concatenate([to_bf16(w["q"]), to_bf16(w["k"]), to_bf16(w["v"])])  # ((H + 2*KVH)*HD, D): one product
            gate_up = np.concatenate([to_bf16(w["gate"]), to_bf16(w["up"])])  # (2F, D): one product
            self.layers.append(
                {
                    "attn_norm": upload_bf16(to_bf16(w["attn_norm"])),  # (D,)
                    "qkv": upload_bf16(qkv),  # ((H + 2*KVH)*HD, D)
                    "o": upload_bf16(to_bf16(w["o"])),  # (D, H*HD)
                    "mlp_norm": upload_bf16(to_bf16(w["mlp_norm"])),  # (D,)
                    "gate_up": upload_bf16(gate_up),  # (2F, D)
                    "down": upload_bf16(to_bf16(w["down"])),  # (D, F)
                }
            )
        self.inv_freq = cuda.to_device(rope_inv_freq(c))  # (HD/2,) f32, Llama-3 scaling applied on the host
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.k_cache = self.v_cache = None
        self.buffers = None  # name -> device array, made by `allocate`
        self.sampler_workspace = None  # the samplers' PartWinners (views of two buffers)

    def allocate(self, num_pages: int, max_num_tokens: int, max_num_seqs: int) -> None:
        """The KV pools (L, num_pages, PAGE_SIZE, KVH, HD) bf16 and every other buffer a step uses
        (`buffer_specs`: activations for up to `max_num_tokens` tokens and `max_num_seqs` sampled rows,
        the kernels' split scratch), allocated once and reused: their addresses never change, so
        recorded CUDA graphs stay valid."""
        c = self.config
        shape = (c.num_hidden_layers, num_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        self.k_cache, self.v_cache = empty_bf16_device(shape), empty_bf16_device(shape)
        specs = buffer_specs(c, max_num_tokens, max_num_seqs, num_sms())
        self.buffers = {name: cuda.device_array(shape, dtype) for name, (shape, dtype) in specs.items()}
        self.sampler_workspace = PartWinners(self.buffers["sample_values"], self.buffers["sample_indices"])

    def forward(self, s: StepInputs, trace=None):
        """Run one step; returns the logits (B, V) f32 device array of the sampled rows.

        `trace(name, layer, host_array)`, if given, receives a host copy of every intermediate under
        the reference model's names (`reference.TRACE_POINTS`): the way to find which kernel first
        disagrees with NumPy. Without it nothing is copied.
        """
        c, b = self.config, self.buffers

        def report(name, layer, array):
            if trace is not None:
                trace(name, layer, array.copy_to_host())

        t, tp = s.token_ids.shape[0], s.num_prefill_tokens
        x, h = b["x"][:t], b["h"][:t]  # (T, D)
        qkv, q, attn = b["qkv"][:t], b["q"][:t], b["attn"][:t]  # (T, H + 2*KVH, HD), (T, H, HD), (T, H, HD)
        qkv2, attn2 = (a.reshape(t, a.shape[1] * a.shape[2]) for a in (qkv, attn))  # (T, heads*HD)
        gate_up, act = b["gate_up"][:t], b["act"][:t]  # (T, 2F), (T, F)
        attention_ws = b["attention_partials"]  # split-context scratch
        gemm_ws = matmul.GemmWorkspace(b["gemm_partials"], b["gemm_x_bf16"])  # split-K parts, x as bf16

        def linear(x, w, out, **fusions):  # every product of the step: the chosen GEMM and its split scratch
            matmul.linear(x, w, out, gemm=self.gemm, workspace=gemm_ws, **fusions)

        embedding(s.token_ids, self.embed, x)
        report("embed", None, x)
        eps = c.rms_norm_eps
        for i, w in enumerate(self.layers):
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]  # (P, PAGE_SIZE, KVH, HD) this layer's pages
            linear(x, w["qkv"], qkv2, norm=(w["attn_norm"], eps), normed=h)  # the norm fused in when gemv runs
            if trace is not None:
                rms_norm(x, w["attn_norm"], h, eps)  # the fused norm leaves no h behind: make one to report
                report("attn_norm", i, h)
                trace("v", i, qkv.copy_to_host()[:, c.num_attention_heads + c.num_key_value_heads :])
            rope_and_cache_write(qkv, s.positions, self.inv_freq, s.kv_indices, q, k_cache, v_cache)
            report("q_rope", i, q)
            if trace is not None:
                trace("k_rope", i, _cached_rows(k_cache, s.kv_indices))
            if tp:
                self.prefill_attention(
                    q[:tp], k_cache, v_cache, s.prefill_block_tables, s.prefill_cu_seqlens, s.prefill_start_pos,
                    self.scale, attn[:tp], s.prefill_max_new_tokens,
                )  # fmt: skip
            if tp < t:
                decode_attention(
                    q[tp:], k_cache, v_cache, s.decode_block_tables, s.decode_context_lens, self.scale, attn[tp:],
                    attention_ws,
                )  # fmt: skip
            report("attn", i, attn)
            linear(attn2, w["o"], x, accumulate=True)  # x += attention output
            report("attn_residual", i, x)
            if trace is not None:
                rms_norm(x, w["mlp_norm"], h, eps)
                report("mlp_norm", i, h)
            linear(x, w["gate_up"], act, norm=(w["mlp_norm"], eps), silu_mul=True, normed=h, gate_up=gate_up)
            report("mlp_act", i, act)
            linear(act, w["down"], x, accumulate=True)  # x += MLP output
            report("mlp_residual", i, x)

        return self.head(s.sample_rows)  # (B, V); B = 0 when every sequence is in the middle of its prompt

    def head(self, rows):
        """The logits (R, V) f32 of rows (R,) int32 (device) of the last step's tokens: their final
        hidden states gathered, normed and multiplied by the head, into the `logits` buffer (R at most
        `max_num_seqs`; a later call overwrites it). `forward` calls it for the sampled rows; prompt
        logprobs call it again for the other positions of a prompt, a chunk of rows at a time."""
        b, nb = self.buffers, rows.shape[0]
        last, logits = b["last"][:nb], b["logits"][:nb]
        if nb:
            gather_rows(b["x"], rows, last)
            matmul.linear(last, self.lm_head, logits, gemm=self.gemm, norm=(self.final_norm, self.config.rms_norm_eps),
                          normed=last, workspace=matmul.GemmWorkspace(b["gemm_partials"], b["gemm_x_bf16"]))  # fmt: skip
        return logits


def buffer_specs(c: ModelConfig, max_num_tokens: int, max_num_seqs: int, num_sms: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Every device buffer `forward` uses besides weights and KV cache, by name: (shape, dtype), for
    steps of up to `max_num_tokens` tokens and `max_num_seqs` sampled rows on a GPU of `num_sms`
    multiprocessors. The one list: `allocate` makes them, capacity planning counts them
    (`buffer_bytes`) before sizing the KV cache."""
    t = max_num_tokens
    f32 = np.float32
    return {
        "x": ((t, c.hidden_size), f32),  # residual stream
        "h": ((t, c.hidden_size), f32),  # normed input of a block
        "qkv": ((t, c.num_attention_heads + 2 * c.num_key_value_heads, c.head_dim), f32),  # q, k, v heads of a token
        "q": ((t, c.num_attention_heads, c.head_dim), f32),  # rotated queries
        "attn": ((t, c.num_attention_heads, c.head_dim), f32),
        "gate_up": ((t, 2 * c.intermediate_size), f32),
        "act": ((t, c.intermediate_size), f32),
        "last": ((max_num_seqs, c.hidden_size), f32),
        "logits": ((max_num_seqs, c.vocab_size), f32),
        # split scratch: the GEMMs' K-split parts and x's bf16 copy (gemm_wgmma's TMA source), decode
        # attention's context-split states, the samplers' part winners
        "gemm_partials": ((gemm_tc_workspace_floats(num_sms),), f32),
        "gemm_x_bf16": ((t * max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim),), np.uint16),
        "attention_partials": ((attention_workspace_floats(c.num_attention_heads, c.num_key_value_heads, c.head_dim),), f32),
        "sample_values": ((SAMPLE_WORKSPACE_SLOTS,), f32),
        "sample_indices": ((SAMPLE_WORKSPACE_SLOTS,), np.int32),
    }


def buffer_bytes(c: ModelConfig, max_num_tokens: int, max_num_seqs: int, num_sms: int) -> int:
    """Device bytes of `buffer_specs`."""
    specs = buffer_specs(c, max_num_tokens, max_num_seqs, num_sms).values()
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs)


def _cached_rows(cache, kv_indices) -> np.ndarray:
    """Host copy of the cache rows (T, KVH, HD) at `kv_indices`, as float32 (for `trace` only)."""
    pool = bf16_from_bits(cache.view(np.uint16).copy_to_host()).astype(np.float32)  # (P, PAGE_SIZE, KVH, HD)
    return pool.reshape(-1, *pool.shape[2:])[kv_indices.copy_to_host()]
