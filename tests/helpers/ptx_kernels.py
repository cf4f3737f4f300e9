"""Every kernel the PTX tests compile, as (module, kernel attribute, signature, hot) specs.

tests/helpers/ptx.py compiles a kernel by importing its module in a child process, so the kernels that
factories build per configuration (attention per query group and head dim, gemm_tc per tiling,
gemv per token tile and fusion) are bound to names in this module. ``hot``: on the per-token path,
where local memory is a defect (ptx.ptx_problems). Signatures use ptx.py's shorthands.
"""

from numba_vllm.kernels.decode_attention import decode_attention_kernel_for, decode_attention_merge_kernel
from numba_vllm.kernels.gemm_tc import LARGE, SMALL, gemm_tc_kernel_for
from numba_vllm.kernels.gemv import gemv_kernel_for
from numba_vllm.kernels.prefill_attention import prefill_attention_kernel_for

HERE = __name__

# ---- attention ---------------------------------------------------------------------------------
DECODE_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), float32, f32(3))"
PREFILL_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), i32(1), float32, f32(3))"

# (group, head_dim): Llama 3.2 1B / 3B / 8B / 70B-style groups at HD 64 and 128, tiny test models.
DECODE_CONFIGS = [(1, 64), (3, 64), (4, 64), (8, 64), (4, 128), (8, 128), (2, 16), (2, 8)]
PREFILL_CONFIGS = [(1, 64), (4, 64), (8, 64), (4, 128), (2, 16), (2, 8)]

# Names for the compiler child: decode_g4_hd64, decode_g4_hd64_w8, prefill_g4_hd64, ...
for _group, _head_dim in DECODE_CONFIGS:
    globals()[f"decode_g{_group}_hd{_head_dim}"] = decode_attention_kernel_for(_group, _head_dim)
decode_g4_hd64_w8 = decode_attention_kernel_for(4, 64, 8)  # the small-batch build (8 warps a block)
decode_g4_hd64_split = decode_attention_kernel_for(4, 64, 8, True)  # split context: partials to a workspace
decode_merge = decode_attention_merge_kernel
for _group, _head_dim in PREFILL_CONFIGS:
    globals()[f"prefill_g{_group}_hd{_head_dim}"] = prefill_attention_kernel_for(_group, _head_dim)

ATTENTION = (
    [(HERE, f"decode_g{g}_hd{hd}", DECODE_SIG, True) for g, hd in DECODE_CONFIGS]
    + [(HERE, "decode_g4_hd64_w8", DECODE_SIG, True), (HERE, "decode_g4_hd64_split", DECODE_SIG, True)]
    + [(HERE, "decode_merge", "(f32(3), f32(3))", True)]
    + [(HERE, f"prefill_g{g}_hd{hd}", PREFILL_SIG, True) for g, hd in PREFILL_CONFIGS]
)

# ---- matrix products ---------------------------------------------------------------------------
gemm_tc_large = gemm_tc_kernel_for(LARGE)
gemm_tc_small = gemm_tc_kernel_for(SMALL)
gemv_t1_kernel, gemv_t2_kernel, gemv_t4_kernel = (gemv_kernel_for(t) for t in (1, 2, 4))
gemv_t1_norm_kernel = gemv_kernel_for(1, normalize=True)
gemv_t4_norm_silu_kernel = gemv_kernel_for(4, normalize=True, silu_mul=True)
GEMV = "numba_vllm.kernels.gemv"
GEMM = "numba_vllm.kernels.gemm"
LINEAR_SIG = "(f32(2), u16(2), f32(2), int64, int64)"
GEMV_SIG = "(f32(2), u16(2), f32(2), int64, int64, u16(1), float32)"  # + norm weight bits, eps
GEMM_TC_SIG = "(f32(2), u16(2), f32(2), int64, int64, int64)"  # + K slices per split
MATMUL = [
    (HERE, "gemv_t1_kernel", GEMV_SIG, True),
    (HERE, "gemv_t2_kernel", GEMV_SIG, True),
    (HERE, "gemv_t4_kernel", GEMV_SIG, True),
    (HERE, "gemv_t1_norm_kernel", GEMV_SIG, True),
    (HERE, "gemv_t4_norm_silu_kernel", GEMV_SIG, True),
    (GEMV, "gemv_unaligned_kernel", "(f32(2), u16(2), f32(2), int64)", False),
    (GEMM, "gemm_kernel", LINEAR_SIG, True),
    (HERE, "gemm_tc_large", GEMM_TC_SIG, True),
    (HERE, "gemm_tc_small", GEMM_TC_SIG, True),
]

# ---- pointwise and row kernels: all on the per-token path ---------------------------------------
# bf16 weights arrive as their uint16 view, eps as float32, as the launchers pass them.
POINTWISE = [
    ("numba_vllm.kernels.embedding", "embedding_kernel", "(i32(1), u16(2), f32(2))", True),
    ("numba_vllm.kernels.rmsnorm", "rms_norm_kernel", "(f32(2), u16(1), f32(2), float32)", True),
    ("numba_vllm.kernels.rmsnorm", "add_rms_norm_kernel", "(f32(2), f32(2), u16(1), f32(2), float32)", True),
    ("numba_vllm.kernels.activation", "silu_and_mul_kernel", "(f32(2), f32(2))", True),
    ("numba_vllm.kernels.sample", "argmax_kernel", "(f32(2), int64, i32(1), f32(1), i32(1))", True),
    ("numba_vllm.kernels.sample", "sample_gumbel_kernel",
     "(f32(2), f32(1), u32(1), i32(1), int64, i32(1), f32(1), i32(1))", True),  # fmt: skip
    ("numba_vllm.kernels.sample", "reduce_parts_kernel", "(f32(1), i32(1), int64, i32(1))", True),
    ("numba_vllm.kernels.rope", "rope_kernel", "(f32(3), i32(1), f32(1), i32(1), f32(3), u16(4), u16(4))", True),
]
