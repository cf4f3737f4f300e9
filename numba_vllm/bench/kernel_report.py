"""Kernel resources without a GPU: registers, spills, shared memory, and the occupancy they allow on an H200.

Why a kernel is fast (or not) is mostly decided before it runs: how many registers each thread needs,
whether some spilled to local memory, how much shared memory a block takes, how many threads a block
has. Together they fix how many blocks an SM can hold at once, and so how many warps it can switch
between while some wait on memory. This module computes that table on any machine:

1. every kernel variant the engine launches (``REGISTRY``: one place, with the argument types and
   block sizes of its launcher) is compiled to PTX for sm_90 by numba-cuda's NVVM
   (``cuda.compile_ptx``, with the kernel's own ``fastmath`` and ``launch_bounds``), in a child
   process with the simulator off;
2. the PTX is assembled for sm_90 by ``ptxas -v`` (with the kernel's ``max_registers`` cap), which
   reports registers per thread, spill bytes, stack frame and static shared memory. The ptxas must be
   as new as the NVVM that wrote the PTX: the ``nvidia-cuda-nvcc`` wheel of the same CUDA release
   (the ``dev`` extra asks for ``cuda-toolkit[nvcc]``, which pip resolves to the cuda-toolkit release
   numba-cuda's NVVM comes from), else a ``ptxas`` on the PATH that is not older;
3. ``occupancy`` turns those numbers into resident blocks and warps per SM of an H200 (``SM90``).

``numba-vllm bench kernels --static`` and ``make kernel-report`` print the table; the PTX tests
(``tests/test_ptx_*.py``) compile the same registry and check its PTX; ``tests/test_kernel_report.py``
checks that no hot kernel spills. docs/benchmarks.md explains the columns.

The registry holds text, not kernels: a kernel is named by ``module:expression``, evaluated in that
module of ``numba_vllm.kernels`` (so factories such as ``gemv_kernel_for(4, True, True)`` and
constants such as ``BLOCK_THREADS`` are the launcher's own), and its signature is written over the
shorthands of ``SIGNATURE_NAMES``. So importing this module imports no numba, and only the child
process builds and compiles kernels.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from numba_vllm.bench.common import BenchError, format_table

PTXAS_PACKAGE = "nvidia-cuda-nvcc"  # the wheel whose ptxas matches numba-cuda's NVVM (setup.cfg's dev extra)
NVVM_PACKAGE = "nvidia-nvvm"  # the wheel numba-cuda's NVVM comes from
TARGET = "sm_90"  # H100 / H200


class ReportError(BenchError):
    """The report cannot be made here (no usable ptxas, a kernel that does not compile): one line."""


# ---- the kernel variants the engine launches ------------------------------------------------------
KERNELS_PACKAGE = "numba_vllm.kernels"


@dataclass(frozen=True)
class KernelVariant:
    """One compiled build of a kernel, as its launcher runs it."""

    name: str  # the kernel, as the table lists it (its function name without ``_kernel``)
    variant: str  # which compile-time build ("t4 norm+silu", "g4 hd64 w8 split"); "" if only one
    kernel: str  # "module:expression" giving the dispatcher, evaluated in numba_vllm.kernels.<module>
    signature: str  # argument types as the launcher passes them, over SIGNATURE_NAMES
    threads: str  # threads per block: an expression over the module's (the launcher's) constants
    dynamic_shared: str = "0"  # dynamic shared memory per block the launcher asks for, bytes (an expression too)
    hot: bool = True  # on the engine's per-step path: must not use local memory (no spills, no stack) ...
    spill_budget: int = 0  # ... beyond this many bytes per thread, where a register cap trades spills for occupancy
    arch_specific: bool = False  # uses sm_90a-only instructions (wgmma, setmaxnreg): assembled for sm_90a

    @property
    def key(self) -> str:
        return f"{self.name} {self.variant}".strip()


# Signature shorthands (evaluated in the child): f32(n), bf16(n), i32(n), u32(n), u16(n) are
# C-contiguous arrays of n dimensions; bf16 weights arrive as their uint16 bits; Python ints as int64.
SIGNATURE_NAMES = ("types", "f32", "bf16", "i32", "u32", "u16", "int32", "float32", "uint32", "int64")
GEMV_SIG = "(f32(2), u16(2), f32(2), int64, int64, u16(1), float32)"  # x, w, out, accumulate, group shift, norm w, eps
LINEAR_SIG = "(f32(2), u16(2), f32(2), int64, int64)"  # x, w, out, accumulate, vectors_ok
GEMM_TC_SIG = "(f32(2), u16(2), f32(2), int64, int64, int64)"  # ... + K slices per split
TENSOR_MAP = "types.Array(types.uint64, 1, 'C')"  # a CUtensorMap's 16 words on the device
GEMM_WGMMA_SIG = f"({TENSOR_MAP}, {TENSOR_MAP}, u16(2), u16(2), f32(2), f32(1), i32(1), int64, int64)"
GEMM_WGMMA_SILU_SIG = f"({TENSOR_MAP}, {TENSOR_MAP}, u16(2), u16(2), u32(2), f32(1), i32(1), int64, int64)"
DECODE_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), float32, f32(3))"  # q, k/v caches, tables, lengths, scale, out
DECODE_FAST_SIG = "(f32(3), u16(1), u16(1), i32(2), i32(1), float32, int32, f32(3))"  # flat caches; + pages per split
PREFILL_SIG = "(f32(3), u16(4), u16(4), i32(2), i32(1), i32(1), float32, f32(3))"  # ... cu_seqlens, start_pos ...
PREFILL_TC_SIG = "(f32(3), u16(1), u16(1), i32(2), i32(1), i32(1), float32, f32(3))"  # flat caches
# q, the caches' tensor maps and (num_pages * PAGE_SIZE, KVH * HD) views, tables, cu_seqlens, start_pos, scale, out
PREFILL_WGMMA_SIG = f"(f32(3), {TENSOR_MAP}, {TENSOR_MAP}, u16(2), u16(2), i32(2), i32(1), i32(1), float32, f32(3), int32)"
# flat qkv, positions, inv_freq, kv indices, flat q, k/v caches as rows of slots, H, KVH
ROPE_SIG = "(f32(1), i32(1), f32(1), i32(1), f32(1), u16(2), u16(2), int32, int32)"
PICK_TAIL = "int64, i32(1), f32(1), i32(1)"  # the samplers': part_cols, token_ids, the workspace's values and indices

# gemv, per token tile: the engine's fusions (q/k/v and the head take the norm, gate/up the norm and
# SwiGLU, o and down neither).
GEMV_FUSIONS = (("", "False, False"), (" norm", "True, False"), (" norm+silu", "True, True"))
# Attention (query heads per kv head, head dim): Llama 3.2 1B / 3B / 8B / 70B-style groups at HD 64
# and 128 (SmolLM2-135M: group 3), and the tiny test models.
DECODE_CONFIGS = ((1, 64), (3, 64), (4, 64), (8, 64), (4, 128), (8, 128), (2, 16), (2, 8))
PREFILL_CONFIGS = ((1, 64), (4, 64), (8, 64), (4, 128), (2, 16), (2, 8))
PREFILL_TC_CONFIGS = tuple((g, hd) for g, hd in PREFILL_CONFIGS if hd >= 16)  # (head dims 16..128, multiples of 16)
# Decode attention with group <= 4 is capped at 128 registers (its MAX_REGISTERS): at group 4 a 4th
# block per SM for ~60 bytes of spills (L1-resident), measured faster on an H200 than 160 registers.
DECODE_SPILL_BUDGET = 64

# Block sizes that depend on the shapes (row width, vocabulary, heads) are the largest the launcher
# picks: rows of 4096+ columns, the vocabulary at batch >= 133, 32+ heads (Llama 3.2 1B has 48).
REGISTRY: tuple[KernelVariant, ...] = (
    *(
        KernelVariant("gemv", f"t{t}{label}", f"gemv:gemv_kernel_for({t}, {flags})", GEMV_SIG, "BLOCK_THREADS")
        for t in (1, 2, 4)
        for label, flags in GEMV_FUSIONS
    ),
    KernelVariant("gemv_unaligned", "", "gemv:gemv_unaligned_kernel", "(f32(2), u16(2), f32(2), int64)", "BLOCK_THREADS",
                  hot=False),  # fmt: skip  # odd K or alignment only
    KernelVariant("gemm_tc", "LARGE 128x256", "gemm_tc:gemm_tc_kernel_for(LARGE)", GEMM_TC_SIG, "LARGE.threads"),
    KernelVariant("gemm_tc", "SMALL 64x64", "gemm_tc:gemm_tc_kernel_for(SMALL)", GEMM_TC_SIG, "SMALL.threads"),
    KernelVariant("sum_splits", "", "gemm_tc:_sum_splits_kernel", "(f32(2), f32(2), int64)", "SUM_THREADS"),
    *(  # Hopper's wgmma GEMM: TMA tensor maps, x and w as bf16 bits, out, split parts and counters, accumulate,
        # m_fastest; silu_mul: the gate/up product with SwiGLU in its epilogue, out (M, F / 2) uint32 (bf16
        # pairs); cluster N: K split over N blocks of a cluster, the parts summed in their shared memory
        KernelVariant("gemm_wgmma", f"{tile} {cfg}{label}", f"gemm_wgmma:gemm_wgmma_kernel_for({tile}{flag})", sig,
                      f"{tile}.threads", dynamic_shared=f"{tile}.shared_bytes_for({cluster})", arch_specific=True)  # fmt: skip
        for label, flag, sig, cluster in (("", "", GEMM_WGMMA_SIG, 1), (" silu_mul", ", True", GEMM_WGMMA_SILU_SIG, 1),
                                          (" cluster 2", ", False, 2", GEMM_WGMMA_SIG, 2),
                                          (" cluster 4", ", False, 4", GEMM_WGMMA_SIG, 4))  # fmt: skip
        for tile, cfg in (("LARGE", "128x256"), ("SMALL", "64x128"), ("SMALL_DEEP", "64x128"), ("TINY", "64x64"),
                          ("TINY_SHALLOW", "64x64"), ("MEDIUM", "128x128"), ("TALL", "128x64"))
        if cluster == 1 or tile != "LARGE"  # (LARGE's parts would not fit beside its stages)
    ),
    *(  # tiles' copies multicast in a cluster (benchmarks and sweeps: pick_plan does not choose them)
        KernelVariant("gemm_wgmma", f"{tile} {cfg} multicast {a}x{b}",
                      f"gemm_wgmma:gemm_wgmma_kernel_for({tile}, False, 1, ({a}, {b}))", GEMM_WGMMA_SIG, f"{tile}.threads",
                      dynamic_shared=f"{tile}.shared_bytes", arch_specific=True, hot=False)  # fmt: skip
        for tile, cfg, (a, b) in (("TINY", "64x64", (2, 1)), ("SMALL", "64x128", (1, 2)))
    ),
    KernelVariant("x_to_bf16", "", "gemm_wgmma:_x_to_bf16_kernel", "(f32(2), u32(2))", "CONVERT_THREADS"),
    KernelVariant("gemm", "", "gemm:gemm_kernel", LINEAR_SIG, "BLOCK_THREADS"),
    # capped at 128 registers for two blocks per SM: spills by design (gemm.py)
    KernelVariant("gemm_two_blocks", "", "gemm:gemm_two_blocks_kernel", LINEAR_SIG, "BLOCK_THREADS", hot=False),
    *(
        KernelVariant("decode_attention", f"g{g} hd{hd}", f"decode_attention:decode_attention_kernel_for({g}, {hd})",
                      DECODE_SIG, "NUM_WARPS * WARP_SIZE", spill_budget=DECODE_SPILL_BUDGET if g <= 4 else 0)  # fmt: skip
        for g, hd in DECODE_CONFIGS
    ),
    # small batches: 8 warps a block, and with long contexts split over blocks
    KernelVariant("decode_attention", "g4 hd64 w8", "decode_attention:decode_attention_kernel_for(4, 64, SMALL_GRID_WARPS)",
                  DECODE_SIG, "SMALL_GRID_WARPS * WARP_SIZE", spill_budget=DECODE_SPILL_BUDGET),  # fmt: skip
    KernelVariant("decode_attention", "g4 hd64 w8 split",
                  "decode_attention:decode_attention_kernel_for(4, 64, SMALL_GRID_WARPS, True)", DECODE_SIG,
                  "SMALL_GRID_WARPS * WARP_SIZE", spill_budget=DECODE_SPILL_BUDGET),  # fmt: skip
    KernelVariant("decode_attention_merge", "", "decode_attention:decode_attention_merge_kernel", "(f32(3), f32(3))",
                  "MERGE_THREADS"),  # fmt: skip
    *(  # the bandwidth build the model runs, for 8 kv heads (Llama 3.2 1B's; the count only moves constant offsets)
        KernelVariant("decode_attention_fast", f"g{g} hd{hd}{' split' if split else ''}",
                      f"decode_attention_fast:launched_kernel({g}, {hd}, 8, {split})", DECODE_FAST_SIG,
                      "NUM_WARPS * WARP_SIZE", spill_budget=DECODE_SPILL_BUDGET if g <= 4 else 0)  # fmt: skip
        for g, hd in DECODE_CONFIGS
        for split in (False, True)
        if not split or (g, hd) == (4, 64)
    ),
    *(  # the tensor-core build, for 8 kv heads, at the head dims it serves
        KernelVariant("decode_attention_tc", f"g{g} hd{hd}{' split' if split else ''}",
                      f"decode_attention_tc:launched_kernel({g}, {hd}, 8, {split})", DECODE_FAST_SIG, "NUM_WARPS * WARP_SIZE",
                      spill_budget=DECODE_SPILL_BUDGET)
        for g, hd in DECODE_CONFIGS
        for split in (False, True)
        if hd in (64, 128) and (not split or (g, hd) == (4, 64))
    ),  # fmt: skip
    *(  # full unsplit grids, in blocks of 4, 2 or 1 warps (full_grid_warps); one-warp blocks as a block per
        # sequence of a warp per kv head where the kv heads divide an SM's 16 warps (head_warp_blocks), else not
        KernelVariant("decode_attention_tc", f"g{g} hd64 full grid w{w}{label}",
                      f"decode_attention_tc:launched_kernel({g}, 64, {kvh}, False, True, {w})", DECODE_FAST_SIG,
                      f"{threads} * WARP_SIZE", spill_budget=DECODE_SPILL_BUDGET)
        for g, kvh, w, threads, label in ((4, 8, 4, 4, ""), (4, 8, 2, 2, ""), (4, 8, 1, 8, " kv-head warps"), (3, 3, 1, 1, ""))
    ),  # fmt: skip
    KernelVariant("decode_attention_fast_merge", "", "decode_attention_fast:decode_attention_fast_merge_kernel",
                  "(f32(3), f32(3))", "MERGE_THREADS"),  # fmt: skip
    *(
        KernelVariant("prefill_attention", f"g{g} hd{hd}", f"prefill_attention:prefill_attention_kernel_for({g}, {hd})",
                      PREFILL_SIG, "THREADS")  # fmt: skip
        for g, hd in PREFILL_CONFIGS
    ),
    *(  # the launcher's default tiling for the head dim (default_tiling)
        KernelVariant("prefill_attention_tc", f"g{g} hd{hd}",
                      f"prefill_attention_tc:prefill_attention_tc_kernel_for({g}, {hd}, *default_tiling({hd}), 8)",
                      PREFILL_TC_SIG, "THREADS")  # fmt: skip
        for g, hd in PREFILL_TC_CONFIGS
    ),
    *(  # the launcher's tilings for the head dim (default_tiling): short contexts, and at head dim 64 long ones
        KernelVariant("prefill_attention_wgmma", f"g{g} hd{hd}{label}",
                      f"prefill_attention_wgmma:prefill_attention_wgmma_kernel_for({g}, {hd}, {tiling})",
                      PREFILL_WGMMA_SIG, f"{tiling}.threads", f"{tiling}.shared_bytes({hd})", arch_specific=True)  # fmt: skip
        for g, hd in PREFILL_TC_CONFIGS
        if hd in (64, 128)
        for label, tiling in (("", f"default_tiling({hd})"), (" long", f"default_tiling({hd}, LONG_CONTEXT)"))
        if hd == 64 or not label  # (head dim 128 runs one tiling at every length)
    ),
    # the softmax beside the previous tile's P V: 64-key tiles (128 would spill at the 168 registers of 9
    # warps), or 128-key ones with a producer warpgroup handing its registers to the consumers (setmaxnreg);
    # with the warpgroups' ping-pong turns; the default tiles on a persistent grid
    *(
        KernelVariant("prefill_attention_wgmma", f"g4 hd64 {label}",
                      f"prefill_attention_wgmma:prefill_attention_wgmma_kernel_for(4, 64, {name})", PREFILL_WGMMA_SIG,
                      f"{name}.threads", f"{name}.shared_bytes(64)", arch_specific=True)  # fmt: skip
        for label, name in (("overlap", "OVERLAP_TILING"), ("overlap wide", "OVERLAP_WIDE_TILING"),
                            ("pingpong", "PINGPONG_TILING"), ("persistent", "PERSISTENT_TILING"))
    ),
    KernelVariant("rope", "", "rope:rope_kernel", ROPE_SIG, "WARP_SIZE * ROPE_WARPS"),
    KernelVariant("rms_norm", "", "rmsnorm:rms_norm_kernel", "(f32(2), u16(1), f32(2), float32)", "RMSNORM_MAX_THREADS"),
    # its output as bf16 bits, into gemm_wgmma's x workspace
    KernelVariant("rms_norm", "bf16", "rmsnorm:rms_norm_bf16_kernel", "(f32(2), u16(1), u16(2), float32)",
                  "RMSNORM_MAX_THREADS"),  # fmt: skip
    KernelVariant("add_rms_norm", "", "rmsnorm:add_rms_norm_kernel", "(f32(2), f32(2), u16(1), f32(2), float32)",
                  "RMSNORM_MAX_THREADS"),  # fmt: skip
    KernelVariant("silu_and_mul", "", "activation:silu_and_mul_kernel", "(f32(2), f32(2))", "ACTIVATION_THREADS"),
    KernelVariant("silu_and_mul_bf16", "", "activation:silu_and_mul_bf16_kernel", "(f32(2), f32(2), u16(2))",
                  "ACTIVATION_THREADS"),  # fmt: skip
    KernelVariant("embedding", "", "embedding:embedding_kernel", "(i32(1), u16(2), f32(2))", "EMBEDDING_MAX_THREADS"),
    KernelVariant("gather_rows", "", "gather:gather_rows_kernel", "(f32(2), i32(1), f32(2))", "GATHER_THREADS"),
    KernelVariant("argmax", "", "sample:argmax_kernel", f"(f32(2), {PICK_TAIL})", "SAMPLE_MAX_THREADS"),
    KernelVariant("sample_gumbel", "", "sample:sample_gumbel_kernel", f"(f32(2), f32(1), u32(1), i32(1), {PICK_TAIL})",
                  "SAMPLE_MAX_THREADS"),  # fmt: skip
    KernelVariant("reduce_parts", "", "sample:reduce_parts_kernel", "(f32(1), i32(1), int64, i32(1))", "WARP_SIZE"),
    KernelVariant("logits_mask", "", "logits_mask:logits_mask_kernel", "(f32(2), i32(1), i32(2))", "MASK_THREADS"),
    KernelVariant("logits_edits", "", "logits_edits:logits_edits_kernel",
                  "(f32(2), i32(1), i32(1), i32(1), i32(1), i32(1), f32(1), f32(2))", "EDIT_THREADS"),  # fmt: skip
    # hot=False: each thread's top k is a local array indexed at run time (only rows asking for logprobs run it)
    KernelVariant("logprobs", "", "logprobs:logprobs_kernel", "(f32(2), i32(1), i32(1), int64, f32(2), i32(2))",
                  "LOGPROBS_MAX_THREADS", hot=False),  # fmt: skip
)


def select(names: Sequence[str] = (), only: str | None = None) -> list[KernelVariant]:
    """The registry's variants of the kernels ``names`` (all if empty) whose key contains ``only``."""
    chosen = [v for v in REGISTRY if (not names or v.name in names) and (not only or only in v.key)]
    if names and {v.name for v in chosen} != set(names):
        raise ReportError(f"no kernel named {sorted(set(names) - {v.name for v in chosen})} in the registry")
    return chosen


# ---- 1. PTX, compiled in a child process with the simulator off -----------------------------------
# The child answers one request line (a variant) with one result line, so a caller can hand out the
# variants one at a time (tests/helpers/ptx.py shares them among the test workers). Lines of the
# protocol carry a prefix: whatever else the child prints goes to the same stdout.
_ANSWER = "PTX-RESULT "
_CHILD = r"""
import importlib, json, sys, types as pytypes
from numba import cuda
from numba.cuda import dispatcher, types
# Device functions are compiled for the current device's compute capability; there is no device
# here, so answer for the Hopper target the PTX is built for.
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
def _arr(dt):
    return lambda n: types.Array(dt, n, "C")
names = dict(types=types, f32=_arr(types.float32), bf16=_arr(types.bfloat16), i32=_arr(types.int32),
             u32=_arr(types.uint32), u16=_arr(types.uint16), int32=types.int32, float32=types.float32,
             uint32=types.uint32, int64=types.int64)
package, lineinfo, answer = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
for line in sys.stdin:
    kernel, signature, threads, dynamic_shared = json.loads(line)
    module_name, expression = kernel.split(":", 1)
    scope = vars(importlib.import_module(package + "." + module_name))
    try:
        dispatcher_ = eval(expression, scope)
        options = dispatcher_.targetoptions
        ptx, _ = cuda.compile_ptx(dispatcher_.py_func, eval(signature, names), cc=(9, 0), lineinfo=lineinfo,
                                  fastmath=options.get("fastmath", False), launch_bounds=options.get("launch_bounds"))
        out = {"ptx": ptx, "threads": eval(threads, scope), "dynamic_shared": eval(dynamic_shared, scope),
               "max_registers": options.get("max_registers")}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(answer + json.dumps(out), flush=True)
"""


class PtxCompiler:
    """A child process that compiles variants to PTX for sm_90, one at a time, no GPU needed.

    The child runs with the simulator off (``cuda.compile_ptx`` needs the real target) and imports
    this same package; it starts once (numba's import takes seconds) and serves every ``compile``
    until ``close``. lineinfo: compile as ``make profile`` does (``NUMBA_VLLM_LINEINFO=1``: line
    tables in every kernel and device function).
    """

    def __init__(self, lineinfo: bool = False):
        package_root = str(Path(__file__).resolve().parents[2])  # the directory holding numba_vllm/
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", NUMBA_VLLM_LINEINFO="1" if lineinfo else "0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: no one reads it while the child runs
        command = [sys.executable, "-c", _CHILD, KERNELS_PACKAGE, str(int(lineinfo)), _ANSWER]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=env)  # fmt: skip

    def compile(self, variant: KernelVariant) -> dict:
        """{'ptx', 'threads', 'dynamic_shared', 'max_registers'} or {'error': message} for ``variant``."""
        request = [variant.kernel, variant.signature, variant.threads, variant.dynamic_shared]
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child has exited: reported below
        for line in self._proc.stdout:
            if line.startswith(_ANSWER):
                return json.loads(line[len(_ANSWER):])
        self._proc.wait()
        self._stderr.seek(0)
        raise ReportError(f"PTX compilation child failed:\n{self._stderr.read()[-3000:]}")

    def close(self) -> None:
        """End the child after the variant it compiles (its input ends)."""
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()
        self._proc.wait()
        self._proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> PtxCompiler:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:  # interrupted (a test's timeout): do not wait for the child's compile
            self._proc.kill()
        self.close()


def compile_ptx(variants: Sequence[KernelVariant], lineinfo: bool = False) -> dict[str, dict]:
    """{key: PtxCompiler.compile's result} for ``variants``, in one child process."""
    with PtxCompiler(lineinfo) as compiler:
        return {v.key: compiler.compile(v) for v in variants}


# ---- 2. ptxas ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ptxas:
    """The assembler the report runs."""

    path: str
    release: tuple[int, int]  # CUDA release, e.g. (13, 5)
    source: str  # where it was found: the wheel (with its version) or the PATH


def _release(path: str) -> tuple[int, int]:
    text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+)\.(\d+)", text)
    if not found:
        raise ReportError(f"{path} --version does not name a CUDA release")
    return int(found[1]), int(found[2])


def find_ptxas() -> Ptxas:
    """The ptxas of the installed ``nvidia-cuda-nvcc`` wheel, else the one on the PATH."""
    try:
        dist = importlib.metadata.distribution(PTXAS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for file in dist.files or ():
            if file.name == "ptxas" and file.parent.name == "bin":
                path = str(dist.locate_file(file))
                if os.access(path, os.X_OK):
                    return Ptxas(path, _release(path), f"{PTXAS_PACKAGE} {dist.version}")
    path = shutil.which("ptxas")
    if path is None:
        raise ReportError(f"no ptxas: install the {PTXAS_PACKAGE} wheel matching numba-cuda's NVVM ({install_hint()})")
    release, nvvm = _release(path), nvvm_release()
    if nvvm is not None and release < nvvm:
        raise ReportError(f"the ptxas on the PATH ({path}) is CUDA {release[0]}.{release[1]}, older than numba-cuda's "
                          f"NVVM {nvvm[0]}.{nvvm[1]}: {install_hint()}")  # fmt: skip
    return Ptxas(path, release, "PATH")


def nvvm_release() -> tuple[int, int] | None:
    """The CUDA release of the NVVM wheel numba-cuda compiles with, if it came from a wheel."""
    try:
        major, minor = importlib.metadata.version(NVVM_PACKAGE).split(".")[:2]
    except importlib.metadata.PackageNotFoundError:
        return None
    return int(major), int(minor)


def install_hint() -> str:
    nvvm = nvvm_release()
    return f"pip install '{PTXAS_PACKAGE}=={nvvm[0]}.{nvvm[1]}.*'" if nvvm else f"pip install {PTXAS_PACKAGE}"


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for a kernel: per thread, then per block."""

    registers: int
    spill_stores: int  # bytes per thread written to local memory because registers ran out
    spill_loads: int  # bytes per thread read back
    stack: int  # bytes per thread of stack frame (local memory: spills and arrays kept in memory)
    shared: int  # static shared memory per block, bytes (dynamic shared memory is the launcher's to add)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> Resources:
    """The kernel's resources from ``ptxas -v`` output (its entry function: numba inlines device functions)."""
    start = _ENTRY.search(text)
    if start is None:
        raise ReportError(f"ptxas -v reported no entry function:\n{text[-2000:]}")
    section = text[start.end():]
    frame, used = _FRAME.search(section), _USED.search(section)
    if frame is None or used is None:
        raise ReportError(f"unexpected ptxas -v output:\n{text[-2000:]}")
    smem = _SMEM.search(section[used.start():].splitlines()[0])
    return Resources(int(used[1]), int(frame[2]), int(frame[3]), int(frame[1]), int(smem[1]) if smem else 0)


def assemble(ptxas: Ptxas, ptx: str, max_registers: int | None = None, arch_specific: bool = False) -> Resources:
    """Assemble one kernel's PTX for sm_90 (as the driver would, with its register cap) and read its resources.

    ``arch_specific``: the kernel uses sm_90a-only instructions (wgmma). The PTX is compiled without a
    GPU for plain sm_90 (numba picks sm_90a only when it sees a Hopper device), so its target is
    retargeted to sm_90a, as the driver builds it on an H100 or H200."""
    target = TARGET + ("a" if arch_specific else "")
    if arch_specific:
        ptx = re.sub(r"^\.target sm_90\b", f".target {target}", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        cap = [f"--maxrregcount={max_registers}"] if max_registers else []
        command = [ptxas.path, "-v", f"--gpu-name={target}", *cap, str(source), "-o", str(Path(tmp) / "kernel.cubin")]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        stated = re.search(r"^\.version (\d+\.\d+)", ptx, re.M)
        if "Unsupported .version" in proc.stderr and stated:
            raise ReportError(f"{ptxas.path} (CUDA {ptxas.release[0]}.{ptxas.release[1]}, from {ptxas.source}) is older "
                              f"than the NVVM that wrote PTX {stated[1]}: {install_hint()}")  # fmt: skip
        raise ReportError(f"ptxas failed: {proc.stderr.strip()[-2000:]}")
    return parse_ptxas(proc.stderr + proc.stdout)


# ---- 3. occupancy -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmLimits:
    """What one SM holds at once (CUDA's occupancy calculator's figures for the architecture)."""

    registers: int  # 32-bit registers per SM
    register_quarters: int  # the register file is split among this many schedulers; a warp lives in one
    register_granularity: int  # registers are given to a warp in units of this many
    max_registers_per_thread: int
    shared_bytes: int  # shared memory per SM, at the largest carveout
    max_shared_per_block: int
    reserved_shared_per_block: int  # taken by the system from every block's share
    shared_granularity: int  # a block's shared memory is rounded up to this
    threads: int  # resident threads per SM
    blocks: int  # resident blocks per SM
    warp_size: int = 32

    @property
    def warps(self) -> int:
        return self.threads // self.warp_size


SM90 = SmLimits(registers=65536, register_quarters=4, register_granularity=256, max_registers_per_thread=255,
                shared_bytes=228 * 1024, max_shared_per_block=227 * 1024, reserved_shared_per_block=1024,
                shared_granularity=128, threads=2048, blocks=32)  # fmt: skip


@dataclass(frozen=True)
class Occupancy:
    """Blocks per SM allowed by each resource, the binding one, and the warps that leaves resident."""

    by_registers: int
    by_shared: int
    by_threads: int  # allowed by the SM's 64 warps, and at most its 32 blocks
    blocks: int  # the smallest of the three: 0 means the block cannot launch at all
    limit: str  # which resource binds: "registers", "shared", "threads" or "blocks"
    warps: int  # resident warps per SM
    fraction: float  # warps / the SM's maximum (64)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def occupancy(registers: int, shared: int, threads: int, sm: SmLimits = SM90) -> Occupancy:
    """Blocks (and warps) one SM can hold of a kernel with ``registers`` per thread, ``shared`` bytes of
    shared memory per block (static plus dynamic) and ``threads`` per block.

    - registers: a warp gets ``registers x 32`` rounded up to ``register_granularity``, from one quarter
      of the register file; warps per SM = warps per quarter x quarters; blocks = that // warps per block.
    - shared memory: a block takes ``shared + reserved`` rounded up to ``shared_granularity``; blocks =
      the SM's shared memory // that; none if ``shared`` exceeds the per-block maximum.
    - threads: blocks = warps per SM // warps per block, and at most ``sm.blocks``.
    """
    warps_per_block = -(-threads // sm.warp_size)
    per_warp = _round_up(max(registers, 1) * sm.warp_size, sm.register_granularity)
    if registers > sm.max_registers_per_thread or per_warp * _round_up(warps_per_block, sm.register_quarters) > sm.registers:
        by_registers = 0
    else:
        by_registers = (sm.registers // sm.register_quarters // per_warp) * sm.register_quarters // warps_per_block
    if shared > sm.max_shared_per_block:
        by_shared = 0
    else:
        by_shared = sm.shared_bytes // _round_up(shared + sm.reserved_shared_per_block, sm.shared_granularity)
    by_threads = sm.warps // warps_per_block
    # On a tie the first binds: a block size at the SM's thread or block limit is no resource's fault.
    limits = {"threads": by_threads, "blocks": sm.blocks, "registers": by_registers, "shared": by_shared}
    limit = min(limits, key=limits.get)
    blocks = limits[limit]
    return Occupancy(by_registers, by_shared, min(by_threads, sm.blocks), blocks, limit, blocks * warps_per_block,
                     blocks * warps_per_block / sm.warps)  # fmt: skip


# ---- the report ---------------------------------------------------------------------------------------
def kernel_report(variants: Sequence[KernelVariant] = REGISTRY, ptx: dict[str, dict] | None = None,
                  ptxas: Ptxas | None = None) -> dict:  # fmt: skip
    """Compile (unless ``ptx`` is given, as from ``compile_ptx``), assemble and size every variant.

    Returns {target, ptxas, nvvm, sm, rows}: a row per variant with its resources, block size and occupancy.
    """
    ptxas = ptxas or find_ptxas()
    ptx = ptx if ptx is not None else compile_ptx(variants)
    failed = {v.key: ptx[v.key]["error"] for v in variants if "error" in ptx[v.key]}
    if failed:
        raise ReportError(f"kernels that do not compile: {failed}")
    rows = []
    for v in variants:
        built = ptx[v.key]
        res = assemble(ptxas, built["ptx"], built["max_registers"], v.arch_specific)
        occ = occupancy(res.registers, res.shared + built["dynamic_shared"], built["threads"])
        launch = {k: built[k] for k in ("threads", "dynamic_shared", "max_registers")}  # the launcher's settings
        rows.append(dict(kernel=v.name, variant=v.variant, hot=v.hot, **launch, **asdict(res), **asdict(occ)))
    nvvm = nvvm_release()
    return {
        "benchmark": "kernel resources (static)",
        "target": TARGET,
        "ptxas": {"path": ptxas.path, "release": ".".join(map(str, ptxas.release)), "source": ptxas.source},
        "nvvm": None if nvvm is None else ".".join(map(str, nvvm)),
        "sm": asdict(SM90),
        "rows": rows,
    }


HEADERS = ("kernel", "variant", "regs", "spill st", "spill ld", "stack", "smem", "threads", "blocks/SM", "limit",
           "warps", "occupancy")  # fmt: skip


def table_rows(report: dict) -> list[list]:
    """The report's rows as table cells, in HEADERS order."""
    return [
        [r["kernel"], r["variant"] or "-", str(r["registers"]) + ("*" if r["max_registers"] else ""), r["spill_stores"],
         r["spill_loads"], r["stack"], r["shared"] + r["dynamic_shared"], r["threads"], r["blocks"], r["limit"], r["warps"],
         f"{100 * r['fraction']:.0f}%"]  # fmt: skip
        for r in report["rows"]
    ]


def format_report(report: dict) -> str:
    p = report["ptxas"]
    title = (f"# {report['target']} (H200: 64K registers, 228 KB shared memory, 64 warps, 32 blocks per SM); "
             f"ptxas {p['release']} ({p['source']}), NVVM {report['nvvm'] or 'unknown'}; bytes per thread "
             "(spills, stack) or per block (smem: static + dynamic); regs*: capped by max_registers")  # fmt: skip
    return format_table(HEADERS, table_rows(report), title=title)


def run_static_report(only: str | None = None, emit: Callable[[str], None] = print) -> dict:
    """The table for the variants whose key contains ``only`` (all by default), printed through ``emit``."""
    variants = select(only=only)
    if not variants:
        raise ReportError(f"no kernel variant contains {only!r}")
    report = kernel_report(variants)
    emit(format_report(report))
    return report
