"""The attention kernels compile for sm_90 without a GPU, with no FP64 and no local memory.

Decode and prefill kernels are built per (query heads per kv head, head dim) by factories; the
configurations checked are the kernel registry's (``numba_vllm/bench/kernel_report.py``: Llama-style
groups at HD 64 and 128, the tiny test models, decode's small-batch and split-context builds). No
local memory in the PTX means the per-lane register arrays were fully unrolled. Compiling also
type-checks the GPU-only paths (the 16-byte ``load_u32x4`` intrinsic), which the simulator never runs.
"""

import pytest

from numba_vllm.bench.kernel_report import select
from tests.helpers import ptx as ptx_check

pytestmark = pytest.mark.slow  # compiles every variant (seconds each)

VARIANTS = select(("decode_attention", "decode_attention_merge", "decode_attention_fast", "decode_attention_fast_merge",
                   "decode_attention_tc", "prefill_attention"))  # fmt: skip


@pytest.fixture(scope="module")
def ptx():
    return ptx_check.compile_ptx(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_kernel_compiles_clean(ptx, variant):
    result = ptx[variant.key]
    assert "error" not in result, result.get("error")
    assert ptx_check.ptx_problems(result["ptx"], variant.hot) == []


@pytest.mark.parametrize(
    "key",
    ["decode_attention g4 hd64", "decode_attention g4 hd64 w8 split", "decode_attention g8 hd128",
     "decode_attention_fast g4 hd64", "decode_attention_fast g4 hd64 split", "decode_attention_fast g8 hd128",
     "prefill_attention g4 hd64", "prefill_attention g2 hd8"],
)  # fmt: skip
def test_kv_reads_use_16_byte_loads(ptx, key):
    assert "ld.global.nc.v4.u32" in ptx[key]["ptx"]  # 8 bf16 of K or V per load


@pytest.mark.parametrize("key", ["decode_attention_fast g4 hd64", "decode_attention_fast g4 hd64 split"])
def test_fast_decode_uses_hardware_exp2_and_l2_prefetch(ptx, key):
    assert "ex2.approx.ftz.f32" in ptx[key]["ptx"]  # one MUFU per probability, no expf range reduction
    assert "prefetch.global.L2" in ptx[key]["ptx"]  # the next step's K/V rows requested while computing


@pytest.mark.parametrize(
    "key, streamed",
    [("decode_attention_tc g4 hd64", True), ("decode_attention_tc g4 hd64 split", True), ("decode_attention_tc g8 hd128", False),
     ("decode_attention_tc g4 hd64 full grid w4", True), ("decode_attention_tc g4 hd64 full grid w1 kv-head warps", False),
     ("decode_attention_tc g3 hd64 full grid w1", False)],
)  # fmt: skip
def test_tensor_core_decode_uses_mma_and_16_byte_loads(ptx, key, streamed):
    """16-byte K/V loads; four-warp blocks at head dim 64 stream them past L1."""
    text = ptx[key]["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert ("ld.global.nc.L1::no_allocate.v4.u32" in text) == streamed
    assert ("ld.global.nc.v4.u32" in text) != streamed
