"""The Llama forward pass on the device: the layer loop, calling the kernel launchers in order.

One call runs one engine step: a ragged batch of T new tokens in which the prefilling sequences'
tokens come first (prompts or prompt chunks, attended by the prefill kernel) and the decoding
sequences' single tokens last (attended by the paged decode kernel). Activations are float32, weights
bf16, the KV cache bf16 in 16-token pages. Per layer:

    h = rmsnorm(x)                       attn_norm
    qkv = h @ [Wq; Wk; Wv].T             (q, k and v as one product)
    rope(q, k) at each token's position  (Llama-3 scaled frequencies from the host), fused with
      storing k and v at the tokens' kv indices in the paged cache; q goes to its own buffer
    a = prefill_attention(q[:Tp]) | decode_attention(q[Tp:Tp+Sd])   over the pages in the block tables
    x += a @ Wo.T                        (the residual add is fused into the product)
    h = rmsnorm(x)                       mlp_norm
    a = silu(h @ Wg.T) * (h @ Wu.T)      (gate and up as one product)
    x += a @ Wd.T                        (the add fused again)

Each norm is handed to the product after it (`linear(..., norm=...)`), and SwiGLU to the gate/up
product (`silu_mul`): in a decode-sized step gemv applies the norm as it loads x and SwiGLU as it
stores, so they cost no launch and no pass over memory; in a prefill they run as their own kernels,
and when gemm_wgmma runs the products they also write the bf16 x it reads (`linear` decides).
Then the last token of every sampling sequence is gathered, normed and multiplied by the head.
Sizes: T tokens (padded, see `executor/inputs.py`), Tp of them prefill, Sd decode rows after them;
D hidden, H heads, KVH kv heads, HD head dim, F MLP width, V vocabulary, B sampled rows.

A step is `num_pieces` pieces with the attention of each layer between two of them (`piece`,
`attention`, `head`; `forward` runs them in order): the pieces' grids depend on T alone, so
`executor/piecewise_graphs.py` can record them once per token count and launch only the attention,
whose grids follow the step's sequences, kernel by kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import cuda

from numba_vllm.kernels import decode_attention_fast as fast_decode
from numba_vllm.kernels import matmul
from numba_vllm.kernels._launch import hopper, num_sms
from numba_vllm.kernels.decode_attention import decode_attention as decode_attention_reference
from numba_vllm.kernels.decode_attention import split_workspace_floats as reference_split_floats
from numba_vllm.kernels.decode_attention_tc import decode_attention_tc
from numba_vllm.kernels.embedding import embedding
from numba_vllm.kernels.gather import gather_rows
from numba_vllm.kernels.gemm_tc import split_workspace_floats as gemm_tc_workspace_floats
from numba_vllm.kernels.gemm_wgmma import TILE_COUNTERS
from numba_vllm.kernels.prefill_attention import prefill_attention as prefill_attention_cuda_cores
from numba_vllm.kernels.prefill_attention_tc import prefill_attention_tc
from numba_vllm.kernels.prefill_attention_wgmma import SUPPORTED_HEAD_DIMS as WGMMA_HEAD_DIMS
from numba_vllm.kernels.prefill_attention_wgmma import check_wgmma_attention, prefill_attention_wgmma
from numba_vllm.kernels.rmsnorm import rms_norm
from numba_vllm.kernels.rope import rope_and_cache_write
from numba_vllm.kernels.sample import SAMPLE_WORKSPACE_SLOTS, PartWinners, sample_gumbel
from numba_vllm.loading.bf16 import bf16_from_bits, empty_bf16_device, to_bf16, upload_bf16
from numba_vllm.model.config import LAYER_TENSORS, PAGE_SIZE, ModelConfig, layer_tensor_name
from numba_vllm.model.rope_scaling import rope_inv_freq

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

PREFILL_ATTENTIONS = {  # by EngineConfig.prefill_attention
    "cuda_cores": prefill_attention_cuda_cores,
    "tensor_cores": prefill_attention_tc,
    "wgmma": prefill_attention_wgmma,
}
DECODE_ATTENTIONS = {  # by EngineConfig.decode_attention
    "reference": decode_attention_reference,
    "fast": fast_decode.decode_attention_fast,
    "tensor_cores": decode_attention_tc,
}


def prefill_attention_name(choice: str, head_dim: int) -> str:
    """The ``PREFILL_ATTENTIONS`` entry ``EngineConfig.prefill_attention`` stands for here: "auto" is the
    Hopper kernel on an H100/H200 where the head dim fits it (docs/benchmarks.md: within 3% of the
    mma.sync one at 8 x 512 tokens, faster from 2,048, 1.26x at 16K), ``tensor_cores`` elsewhere."""
    if choice != "auto":
        return choice
    return "wgmma" if hopper() and head_dim in WGMMA_HEAD_DIMS else "tensor_cores"


def attention_workspace_floats(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of split scratch any decode attention kernel needs at most (the reference kernel's ranges
    and the fast and tensor-core kernels' ranges differ; one buffer serves whichever the model runs)."""
    heads = (num_heads, num_kv_heads, head_dim)
    return max(reference_split_floats(*heads), fast_decode.split_workspace_floats(*heads))


@dataclass
class StepInputs:
    """One step's device arrays (int32), packed from the scheduler's plan by `executor/inputs.py`
    (padded: see there). The prefill fields are None in a step with no prefill tokens."""

    token_ids: DeviceNDArray  # (T,) prefill tokens first, then one token per decoding sequence
    positions: DeviceNDArray  # (T,)
    kv_indices: DeviceNDArray  # (T,) page_id * PAGE_SIZE + offset: where each token's K/V is written
    num_prefill_tokens: int  # Tp
    prefill_cu_seqlens: DeviceNDArray | None  # (Sp + 1,) offsets of each prefilling sequence's tokens in [0, Tp)
    prefill_start_pos: DeviceNDArray | None  # (Sp,) position of each prefilling sequence's first new token
    prefill_block_tables: DeviceNDArray | None  # (Sp, max_pages)
    prefill_max_new_tokens: int  # the longest prefill chunk (sizes the prefill grid)
    decode_block_tables: DeviceNDArray  # (Sd, W) W = inputs.table_width(longest)
    decode_context_lens: DeviceNDArray  # (Sd,) cached tokens each decode row (rows Tp .. Tp + Sd - 1) attends to
    sample_rows: DeviceNDArray  # (B,) rows of the T tokens whose logits are needed


class DeviceModel:
    """A Llama model's bf16 weights on the device, its KV cache, and `forward`."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, np.ndarray], prefill_gemm: str = "tensor_cores",
        prefill_attention: str = "auto", decode_attention: str = "tensor_cores",
    ):
        """Upload the weights. `prefill_gemm` and `prefill_attention` name the kernels of steps with more
        than a few tokens, `decode_attention` the kernel of decoding rows (`EngineConfig`'s fields of
        the same names; one of `PREFILL_GEMMS`, `PREFILL_ATTENTIONS`, `DECODE_ATTENTIONS`)."""
        self.config = c = config
        self.gemm = prefill_gemm
        prefill_attention = prefill_attention_name(prefill_attention, c.head_dim)
        if prefill_attention == "wgmma":
            check_wgmma_attention(c.head_dim)
        self.prefill_attention = PREFILL_ATTENTIONS[prefill_attention]
        self.decode_attention = DECODE_ATTENTIONS[decode_attention]
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
        self.layer_caches = []  # [(k, v)] (P, PAGE_SIZE, KVH, HD) bf16 views per layer, made by `allocate`
        self.buffers = None  # name -> device array, made by `allocate`
        self.sampler_workspace = None  # the samplers' PartWinners (views of two buffers)
        self.gemm_workspace = None  # the GEMMs' scratch: split-K parts, x as bf16 (views of two buffers)
        self._views = {}  # views of the step buffers, by shape (see `_activations`)
        self._attention_key, self._attention = None, None  # the last step's attention views

    def allocate(self, num_pages: int, max_num_tokens: int, max_num_seqs: int) -> None:
        """The KV pools (L, num_pages, PAGE_SIZE, KVH, HD) bf16 and every other buffer a step uses
        (`buffer_specs`: activations for up to `max_num_tokens` tokens and `max_num_seqs` sampled rows,
        the kernels' split scratch), allocated once and reused: their addresses never change, so
        recorded CUDA graphs stay valid."""
        c = self.config
        shape = (c.num_hidden_layers, num_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        self.k_cache, self.v_cache = empty_bf16_device(shape), empty_bf16_device(shape)
        self.layer_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(c.num_hidden_layers)]  # per-layer views
        specs = buffer_specs(c, max_num_tokens, max_num_seqs, num_sms())
        self.buffers = {name: cuda.device_array(shape, dtype) for name, (shape, dtype) in specs.items()}
        self.sampler_workspace = PartWinners(self.buffers["sample_values"], self.buffers["sample_indices"])
        self.buffers["gemm_tile_counters"].copy_to_device(np.zeros(TILE_COUNTERS, np.int32))
        self.gemm_workspace = matmul.GemmWorkspace(
            self.buffers["gemm_partials"], self.buffers["gemm_x_bf16"], self.buffers["gemm_act_bf16"],
            tile_counters=self.buffers["gemm_tile_counters"],
        )
        # Padding rows read stale rows of `attn` and write (and padding decode rows read) slot 0 of the
        # null page: start both at zero, so that what padding computes is always finite.
        self.buffers["attn"].copy_to_device(np.zeros(self.buffers["attn"].shape, np.float32))
        null_page = np.zeros(self.k_cache.shape[2:], np.uint16)  # (PAGE_SIZE, KVH, HD)
        for k_cache, v_cache in self.layer_caches:
            k_cache.view(np.uint16)[0].copy_to_device(null_page)  # page 0: engine.kv_cache.NULL_PAGE_ID
            v_cache.view(np.uint16)[0].copy_to_device(null_page)
        self._views.clear()
        self._attention_key, self._attention = None, None

    def forward(self, s: StepInputs, trace=None):
        """Run one step; returns the logits (B, V) f32 device array of the sampled rows.

        The step is `num_pieces` pieces with each layer's attention between two of them (the
        piecewise CUDA graphs record the pieces and launch the attention eagerly), then the head.

        `trace(name, layer, host_array)`, if given, receives a host copy of every intermediate under
        the reference model's names (`reference.TRACE_POINTS`): the way to find which kernel first
        disagrees with NumPy. Without it nothing is copied.
        """
        for p in range(self.num_pieces):
            self.piece(s, p, trace)
            if p < len(self.layers):
                self.attention(s, p)
        return self.head(s)

    @property
    def num_pieces(self) -> int:
        """Pieces of a step: the embedding and layer 0's qkv, one per layer boundary, the last layer's end."""
        return len(self.layers) + 1

    def piece(self, s: StepInputs, p: int, trace=None) -> None:
        """Piece `p` of the step, everything between two attentions: the embedding (p = 0) or layer
        p - 1's output projection and MLP, then (p < num_layers) layer p's qkv product, RoPE and K/V
        store. Its kernels' grids depend on the token count T only."""
        c, a, eps = self.config, self._activations(s.token_ids.shape[0]), self.config.rms_norm_eps
        report = _reporter(trace)
        if p == 0:
            embedding(s.token_ids, self.embed, a.x)
            report("embed", None, a.x)
        else:
            i, w = p - 1, self.layers[p - 1]
            report("attn", i, a.attn)
            self._linear(a.attn2, w["o"], a.x, accumulate=True)  # x += attention output
            report("attn_residual", i, a.x)
            if trace is not None:
                rms_norm(a.x, w["mlp_norm"], a.h, eps)
                report("mlp_norm", i, a.h)
            # Unless traced, act is the down product's x alone: on Hopper SwiGLU may then run in the gate/up
            # product's epilogue, leaving only act's bf16 copy (`matmul.linear`'s next_product_only).
            self._linear(a.x, w["gate_up"], a.act, norm=(w["mlp_norm"], eps), silu_mul=True, normed=a.h, gate_up=a.gate_up,
                         next_product_only=trace is None)  # fmt: skip
            report("mlp_act", i, a.act)
            self._linear(a.act, w["down"], a.x, accumulate=True)  # x += MLP output
            report("mlp_residual", i, a.x)
        if p < len(self.layers):
            w = self.layers[p]
            k_cache, v_cache = self.layer_caches[p]
            self._linear(a.x, w["qkv"], a.qkv2, norm=(w["attn_norm"], eps), normed=a.h)  # the norm fused in when gemv runs
            if trace is not None:
                rms_norm(a.x, w["attn_norm"], a.h, eps)  # the fused norm leaves no h behind: make one to report
                report("attn_norm", p, a.h)
                trace("v", p, a.qkv.copy_to_host()[:, c.num_attention_heads + c.num_key_value_heads :])
            rope_and_cache_write(a.qkv, s.positions, self.inv_freq, s.kv_indices, a.q, k_cache, v_cache)
            report("q_rope", p, a.q)
            if trace is not None:
                trace("k_rope", p, _cached_rows(k_cache, s.kv_indices))

    def attention(self, s: StepInputs, i: int) -> None:
        """Layer i's attention: the prefill kernel on rows [0, Tp), the decode kernel on the Sd decoding
        rows after them (rows past Tp + Sd are padding, attended by neither). Grids depend on the step's
        sequences, not only on T."""
        q_prefill, attn_prefill, q_decode, attn_decode = self._attention_views(s)
        k_cache, v_cache = self.layer_caches[i]
        if s.num_prefill_tokens:
            self.prefill_attention(
                q_prefill, k_cache, v_cache, s.prefill_block_tables, s.prefill_cu_seqlens, s.prefill_start_pos,
                self.scale, attn_prefill, s.prefill_max_new_tokens,
            )  # fmt: skip
        if q_decode.shape[0]:
            self.decode_attention(
                q_decode, k_cache, v_cache, s.decode_block_tables, s.decode_context_lens, self.scale, attn_decode,
                self.buffers["attention_partials"],
            )  # fmt: skip

    def head(self, s: StepInputs):
        """The logits (B, V) of the sampled rows: gather them (from the whole residual buffer, so the
        launch depends on B only), final norm, vocabulary product. B = 0 (a step of prompt chunks
        that all stop short of their last token) launches nothing."""
        return self.head_rows(s.sample_rows)

    def head_rows(self, rows):
        """The logits (R, V) f32 of rows (R,) int32 (device) of the last step's tokens, into the
        `logits` buffer (R at most `max_num_seqs`; a later call overwrites it): `head` for the
        sampled rows, and for prompt logprobs the other positions of a prompt, some rows at a time."""
        nb = rows.shape[0]
        views = self._views.get(("head", nb))
        if views is None:
            views = self._views[("head", nb)] = (self.buffers["last"][:nb], self.buffers["logits"][:nb])
        last, logits = views
        if nb:
            gather_rows(self.buffers["x"], rows, last)
            self._linear(last, self.lm_head, logits, norm=(self.final_norm, self.config.rms_norm_eps), normed=last)
        return logits

    def sample(self, logits, sampler) -> None:
        """One token per row of `logits` (B, V) into `sampler.tokens` (an `inputs.SamplerInputs`): the
        Gumbel-max sampler, whose greedy rows (temperature 0) take the argmax."""
        s = sampler
        sample_gumbel(logits, s.temperatures, s.seeds, s.steps, s.tokens, self.sampler_workspace)

    def _linear(self, x, w, out, **fusions) -> None:
        """Every product of the step: the chosen GEMM and its split scratch."""
        matmul.linear(x, w, out, gemm=self.gemm, workspace=self.gemm_workspace, **fusions)

    def _activations(self, t: int) -> _Activations:
        """The step buffers' views for T tokens (made once per T: slicing a device array costs tens of us)."""
        a = self._views.get(t)
        if a is None:
            b = self.buffers
            qkv, attn = b["qkv"][:t], b["attn"][:t]  # (T, H + 2*KVH, HD), (T, H, HD)
            a = self._views[t] = _Activations(
                x=b["x"][:t], h=b["h"][:t], qkv=qkv, q=b["q"][:t], attn=attn,
                qkv2=qkv.reshape(t, qkv.shape[1] * qkv.shape[2]), attn2=attn.reshape(t, attn.shape[1] * attn.shape[2]),
                gate_up=b["gate_up"][:t], act=b["act"][:t],
            )  # fmt: skip
        return a

    def _attention_views(self, s: StepInputs) -> tuple:
        """(q, out) of the prefill rows and of the decode rows of this step (kept for the step's layers)."""
        tp, sd = s.num_prefill_tokens, s.decode_context_lens.shape[0]
        key = ("attention", s.token_ids.shape[0], tp, sd)
        if self._attention_key != key:
            q, attn = self.buffers["q"], self.buffers["attn"]
            self._attention_key = key
            self._attention = (q[:tp], attn[:tp], q[tp : tp + sd], attn[tp : tp + sd])
        return self._attention


@dataclass
class _Activations:
    """Views of the step buffers for T tokens."""

    x: DeviceNDArray  # (T, D) residual stream
    h: DeviceNDArray  # (T, D) normed input of a block
    qkv: DeviceNDArray  # (T, H + 2*KVH, HD)
    q: DeviceNDArray  # (T, H, HD) rotated queries
    attn: DeviceNDArray  # (T, H, HD)
    qkv2: DeviceNDArray  # (T, (H + 2*KVH)*HD): qkv as the product's output
    attn2: DeviceNDArray  # (T, H*HD): attn as the next product's input
    gate_up: DeviceNDArray  # (T, 2F)
    act: DeviceNDArray  # (T, F)


def _reporter(trace):
    """`report(name, layer, device_array)`: hand a host copy to `trace`, or nothing without one."""

    def report(name, layer, array):
        if trace is not None:
            trace(name, layer, array.copy_to_host())

    return report


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
        # (written by gemm_wgmma's conversion pass, or by the norm or SwiGLU before the product: `matmul.linear`)
        "gemm_x_bf16": ((t * max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim),), np.uint16),
        # (SwiGLU's bf16 output when the gate/up product computes it in its epilogue: the down product's x)
        "gemm_act_bf16": ((t * c.intermediate_size,), np.uint16),
        # (gemm_wgmma's K splits: per output tile, its parts written so far; zero between products)
        "gemm_tile_counters": ((TILE_COUNTERS,), np.int32),
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
