"""gemm_wgmma (Hopper wgmma product) and the wgmma.py intrinsics under it.

Reference: float64 NumPy on the bf16-rounded inputs, with test_gemv's tolerance (|out - ref| <=
1e-5 * (|x_bf16| @ |w|.T) (+ |out before|)), the output poisoned with NaN so an unwritten element
fails. The same tests run on an H200 with ``NUMBA_VLLM_TEST_GPU=1`` (the ``gpu`` ones only there).

The wgmma probe stages A (64 x 64) and B (16 x 64) in shared memory by the layout written out here
(128-byte rows, chunk c of row r at chunk c ^ (r % 8), from a 1024-byte boundary), runs four k-steps
of ``wgmma m64n16k16`` through ``smem_descriptor``, and writes each thread's 8 accumulators by the
documented fragment layout: on the simulator it checks the emulation against NumPy, on a GPU the
hardware against the same NumPy (the layout and descriptor encoding are the hardware's, not ours).

Without a GPU, the kernels of every tiling are compiled to PTX (for sm_90a) and, where a ptxas is on
the PATH, assembled: no local memory, no spills, and no "wgmma serialized" report (C7515: ptxas
serialises every wgmma when other code touches the accumulators inside a pipeline stage).

Simulator shapes are small (a 128-thread block per warpgroup; every wgmma is a 128-thread
rendezvous): M from 1, N and K not multiples of the tile, K past the pipeline depth, a K split, each
tiling once; ``slow`` marks the 256-thread tilings.
"""

import functools
import re
import subprocess

import numpy as np
import pytest
from numba import cuda, float32, uint32

from numba_vllm.bench.kernel_report import ReportError, find_ptxas, select
from numba_vllm.kernels import gemm_wgmma as gw
from numba_vllm.kernels import matmul
from numba_vllm.kernels._launch import KernelError, launch
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.rmsnorm import rms_norm
from numba_vllm.kernels.wgmma import (
    ATOM_BYTES,
    DESC_K_STEP,
    fence_proxy_async,
    named_barrier,
    named_barrier_arrive,
    shared_address,
    smem_descriptor,
    smem_descriptor_mn,
    wgmma_bf16,
    wgmma_bf16_rs,
    wgmma_commit,
    wgmma_fence,
    wgmma_fence_operands,
    wgmma_wait,
)
from numba_vllm.loading.bf16 import BF16, bf16_bits, to_bf16, upload_bf16
from tests.helpers import ptx as ptx_check
from tests.helpers.products import check_product, launch_case, random_case, wgmma_conversion

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

TILING_IDS = ["large", "small", "small_deep", "tiny", "tiny_shallow", "medium", "tall"]  # gw.TILE_CONFIGS
PROBE_N = 16
PROBE_K = 64
PROBE_ACC = 8  # accumulators per thread (PROBE_N / 2): a literal, as a local array's size must be
_probe_mma = wgmma_bf16(PROBE_N)
_probe_fence = wgmma_fence(PROBE_N)
_probe_wait = wgmma_wait(PROBE_N, 0)


def run_gemm_wgmma(m, n, k, accumulate, seed=0, x_offset=0, launcher=gw.gemm_wgmma):
    """Launch on fresh random data, check against the bf16-rounded reference. x_offset > 0 misaligns x."""
    got, x, w, out0 = launch_case(m, n, k, accumulate, seed, x_offset, launcher)
    check_product(got, x.astype(BF16).astype(np.float32), w, out0, accumulate)


# ---- one wgmma, staged by hand ---------------------------------------------------------------------


@kernel
def _wgmma_probe_kernel(a_bits, b_bits, d):
    # a_bits (64, 64) uint16: A[m, k] bf16 bits; b_bits (16, 64) uint16: B[k, n] at [n, k]; d (64, 16) f32
    smem = cuda.shared.array(0, uint32)
    tid = cuda.threadIdx.x
    base = shared_address(smem, 0)
    pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)
    first = pad >> 2
    for i in range(tid, (64 + PROBE_N) * 8, 128):  # 16-byte chunk c of row r, rows of A then of B
        r = i // 8
        c = i % 8
        for j in range(4):
            k = 8 * c + 2 * j
            if r < 64:
                word = uint32(a_bits[r, k]) | (uint32(a_bits[r, k + 1]) << uint32(16))
            else:
                word = uint32(b_bits[r - 64, k]) | (uint32(b_bits[r - 64, k + 1]) << uint32(16))
            smem[first + r * 32 + (c ^ (r % 8)) * 4 + j] = word
    fence_proxy_async()
    cuda.syncthreads()
    acc = cuda.local.array(PROBE_ACC, float32)
    for i in range(PROBE_ACC):
        acc[i] = float32(0.0)
    desc_a = smem_descriptor(base + pad)
    desc_b = smem_descriptor(base + pad + 64 * 128)
    _probe_fence(acc)
    for kk in range(PROBE_K // 16):
        _probe_mma(acc, smem, desc_a + kk * DESC_K_STEP, desc_b + kk * DESC_K_STEP)
    wgmma_commit()
    _probe_wait(acc)
    row = 16 * (tid // 32) + ((tid % 32) >> 2)  # acc[4j + 2h + e] = D[row + 8h, 8j + 2q + e]
    col = 2 * (tid & 3)
    d[row, col] = acc[0]
    d[row, col + 1] = acc[1]
    d[row + 8, col] = acc[2]
    d[row + 8, col + 1] = acc[3]
    d[row, col + 8] = acc[4]
    d[row, col + 9] = acc[5]
    d[row + 8, col + 8] = acc[6]
    d[row + 8, col + 9] = acc[7]


def _run_probe(a, b):
    """D (64, 16) of the probe: A (64, 64) bf16 @ B (64, 16) bf16."""
    d = cuda.to_device(np.full((64, PROBE_N), np.nan, np.float32))
    a_bits = cuda.to_device(np.ascontiguousarray(a.view(np.uint16)))
    b_bits = cuda.to_device(np.ascontiguousarray(b.T).view(np.uint16))
    shared_bytes = (64 + PROBE_N) * 128 + ATOM_BYTES
    _wgmma_probe_kernel[1, 128, 0, shared_bytes](a_bits, b_bits, d)
    return d.copy_to_host()


def test_wgmma_is_exact_on_small_integers():
    """Small integers: exact in any order, so D must be A @ B exactly (layouts, descriptors, k-steps)."""
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (64, PROBE_K)).astype(BF16)
    b = rng.integers(-4, 5, (PROBE_K, PROBE_N)).astype(BF16)
    np.testing.assert_array_equal(_run_probe(a, b), a.astype(np.float64) @ b.astype(np.float64))


def test_wgmma_reads_every_element_where_the_layout_says():
    """A[m, k] = m (2m for odd k), B = identity: D[m, n] = A[m, n], so a misplaced row or column shows."""
    a = (np.arange(64, dtype=np.float32)[:, None] * (1 + np.arange(PROBE_K) % 2)[None, :]).astype(BF16)  # odd k: 2m
    b = np.eye(PROBE_K, PROBE_N, dtype=np.float32).astype(BF16)
    np.testing.assert_array_equal(_run_probe(a, b), a.astype(np.float32)[:, :PROBE_N])


RS_N = 128  # the register-A probe: two 64-wide panels of n, so the leading byte offset is used
RS_ACC = 64  # RS_N / 2
RS_PANEL_BYTES = 16 * 128  # one panel: 16 rows of k, 128 bytes each
_rs_mma = wgmma_bf16_rs(RS_N, True)
_rs_fence = wgmma_fence_operands(RS_N, 4)
_rs_wait = wgmma_wait(RS_N, 0)


@kernel
def _wgmma_rs_probe_kernel(a_bits, b_bits, d):
    # a_bits (64, 16) uint16: A bf16 bits; b_bits (16, 128) uint16: B[k, n] (n contiguous); d (64, 128) f32
    smem = cuda.shared.array(0, uint32)
    tid = cuda.threadIdx.x
    base = shared_address(smem, 0)
    pad = (ATOM_BYTES - (base & (ATOM_BYTES - 1))) & (ATOM_BYTES - 1)
    first = pad >> 2
    for i in range(tid, 2 * 16 * 8, 128):  # panel p, row k, 16-byte chunk c: B[k, 64p + 8c ..]
        p = i // 128
        k = (i // 8) % 16
        c = i % 8
        for j in range(4):
            n = 64 * p + 8 * c + 2 * j
            word = uint32(b_bits[k, n]) | (uint32(b_bits[k, n + 1]) << uint32(16))
            smem[first + p * (RS_PANEL_BYTES // 4) + k * 32 + (c ^ (k % 8)) * 4 + j] = word
    fence_proxy_async()
    cuda.syncthreads()
    row = 16 * (tid // 32) + ((tid % 32) >> 2)
    col = 2 * (tid & 3)
    a = cuda.local.array(4, uint32)  # rows row, row + 8 and columns col, col + 8 (the fragment layout)
    for w in range(4):
        r = row + 8 * (w % 2)
        k = col + 8 * (w // 2)
        a[w] = uint32(a_bits[r, k]) | (uint32(a_bits[r, k + 1]) << uint32(16))
    acc = cuda.local.array(RS_ACC, float32)
    for i in range(RS_ACC):
        acc[i] = float32(0.0)
    _rs_fence(acc, a)
    _rs_mma(acc, a[0], a[1], a[2], a[3], smem, smem_descriptor_mn(base + pad, RS_PANEL_BYTES))
    wgmma_commit()
    _rs_wait(acc)
    for j in range(RS_N // 8):
        d[row, 8 * j + col] = acc[4 * j]
        d[row, 8 * j + col + 1] = acc[4 * j + 1]
        d[row + 8, 8 * j + col] = acc[4 * j + 2]
        d[row + 8, 8 * j + col + 1] = acc[4 * j + 3]


def _run_rs_probe(a, b):
    """D (64, 128) of the register-A probe: A (64, 16) bf16 @ B (16, 128) bf16, B read MN-major."""
    d = cuda.to_device(np.full((64, RS_N), np.nan, np.float32))
    a_bits = cuda.to_device(np.ascontiguousarray(a.view(np.uint16)))
    b_bits = cuda.to_device(np.ascontiguousarray(b.view(np.uint16)))
    _wgmma_rs_probe_kernel[1, 128, 0, 2 * RS_PANEL_BYTES + ATOM_BYTES](a_bits, b_bits, d)
    return d.copy_to_host()


def test_wgmma_with_a_in_registers_and_b_mn_major_is_exact_on_small_integers():
    rng = np.random.default_rng(2)
    a = rng.integers(-4, 5, (64, 16)).astype(BF16)
    b = rng.integers(-4, 5, (16, RS_N)).astype(BF16)
    np.testing.assert_array_equal(_run_rs_probe(a, b), a.astype(np.float64) @ b.astype(np.float64))


def test_wgmma_with_a_in_registers_on_random_values():
    """Every element of A (each of a thread's four registers) and of B (both panels of n, every
    swizzled chunk) enters D where the layouts say: a misplaced one moves D far past the fp32 slack."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 16)).astype(BF16)
    b = rng.standard_normal((16, RS_N)).astype(BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.all(np.abs(_run_rs_probe(a, b) - a64 @ b64) <= 1e-5 * (np.abs(a64) @ np.abs(b64)))


@kernel
def _turns_kernel(out, rounds):
    """Turns, as the wgmma attention's ping-pong takes them: warp 1 writes round r's value, then
    ``bar.arrive`` on barrier 3 and ``bar.sync`` on barrier 4; warp 0 ``bar.sync``s on barrier 3 (64
    threads: both warps' arrivals complete a phase), reads the value, and ``bar.arrive``s on barrier 4
    (so warp 1 cannot run a round ahead and arrive twice in one phase). Every round is a new phase of both."""
    values = cuda.shared.array(8, float32)
    lane = cuda.threadIdx.x % 32
    for r in range(rounds):
        if cuda.threadIdx.x >= 32:
            if lane == 0:
                values[r] = float32(r + 1)
            cuda.syncwarp()
            named_barrier_arrive(3, 64)
            named_barrier(4, 64)
        else:
            named_barrier(3, 64)
            out[r, lane] = values[r]
            named_barrier_arrive(4, 64)


def test_named_barrier_waits_for_the_arrivals_of_another_warp():
    """``named_barrier_arrive`` (``bar.arrive``) counts toward the phase ``named_barrier`` (``bar.sync``)
    waits for, as on the GPU: warp 0 sees what warp 1 wrote before arriving, round after round (the
    wgmma attention's ping-pong turns are built on this)."""
    out = cuda.to_device(np.zeros((4, 32), np.float32))
    launch(_turns_kernel, 1, 64, out, 4)
    np.testing.assert_array_equal(out.copy_to_host(), np.repeat(np.arange(1, 5, dtype=np.float32)[:, None], 32, axis=1))


# ---- the GEMM ------------------------------------------------------------------------------------

SIM_CASES = [  # (M, N, K, accumulate)
    (40, 72, 200, False),  # 4 K slices (more than the stages), the last partial; N not a multiple of 16
    (40, 72, 200, True),
    (1, 16, 8, True),  # one token, one 16-byte chunk of K
    (3, 130, 64, False),  # 2 column tiles, the second with 2 columns
]


@pytest.mark.parametrize("m,n,k,accumulate", SIM_CASES)
def test_gemm_wgmma_small_tiling(m, n, k, accumulate):
    run_gemm_wgmma(m, n, k, accumulate, seed=m + k, launcher=functools.partial(gw.gemm_wgmma, config=gw.SMALL))


def test_gemm_wgmma_tiny_tiling():
    """64 x 64 tiles, 8 stages: two column tiles, the K loop wrapping the stages once (K = 584: 10 slices)."""
    run_gemm_wgmma(9, 70, 584, True, launcher=functools.partial(gw.gemm_wgmma, config=gw.TINY))


def test_gemm_wgmma_tall_tiles_take_two_stages_a_wait():
    """TALL's consumers wait for two stages and issue their 8 wgmma as one group: K = 328 is 6 slices
    in 3 groups, the last slice past K (the TMA's zeros); split 2 ways through global memory the
    parts are whole groups (1 + 2); split over a cluster they take one stage a wait (2 + 3 slices)."""
    assert gw.TALL.k_group == 2 and gw.slices_a_wait(gw.TALL, in_cluster=True) == 1
    for split, in_cluster in ((1, False), (2, False), (2, True)):
        launcher = functools.partial(gw.gemm_wgmma, config=gw.TALL, split=split, in_cluster=in_cluster)
        run_gemm_wgmma(70, 72, 328, split == 2, seed=split + in_cluster, launcher=launcher)


@pytest.mark.slow
def test_gemm_wgmma_two_warpgroups():
    """130 rows: two row tiles, the second warpgroup of the first holding rows 64..127."""
    run_gemm_wgmma(130, 40, 136, True, launcher=functools.partial(gw.gemm_wgmma, config=gw.LARGE))


@pytest.mark.parametrize("config", [gw.SMALL_DEEP, gw.TINY_SHALLOW], ids=["small_deep", "tiny_shallow"])
def test_gemm_wgmma_other_pipeline_depths(config):
    """The same tiles with 6 and 4 stages: K = 840 (14 slices) wraps either pipeline twice or more."""
    run_gemm_wgmma(20, 70, 840, True, seed=config.stages, launcher=functools.partial(gw.gemm_wgmma, config=config))


def test_gemm_wgmma_blocks_walk_several_tiles(monkeypatch):
    """A grid of fewer blocks than output tiles (two here: 3 x 2 tiles): each block takes every
    other tile, its pipeline's stages and phases carried from one tile to the next (5 K slices a
    tile on 8 stages: the stage a tile starts on moves), stores every tile from its
    registers, adding what out held (accumulate)."""
    launches = []
    monkeypatch.setattr(gw, "launch", lambda kernel_, grid, *a, **kw: (launches.append(grid), launch(kernel_, grid, *a, **kw)))
    monkeypatch.setattr(gw, "num_sms", lambda: 2)
    run_gemm_wgmma(150, 100, 320, True, launcher=functools.partial(gw.gemm_wgmma, config=gw.TINY, split=1))
    assert launches[-1] == (2, 1, 1)  # one TINY block an SM


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_wgmma_split_k_sums_its_parts(accumulate):
    """K = 264: five 64-wide slices, split 2 ways (2 + 3) and 3 ways (1 + 2 + 2)."""
    for split in (2, 3):
        launcher = functools.partial(gw.gemm_wgmma, config=gw.SMALL, split=split)
        run_gemm_wgmma(5, 24, 264, accumulate, seed=split, launcher=launcher)


def test_the_last_part_of_a_split_sums_them_and_clears_its_counter():
    """The block that finds a tile's count at splits - 1 sums the parts and sets the count back to
    zero: two products in a row through one workspace (the second would miss the first's zeros),
    both right, every counter zero after each, on two row tiles and three column tiles."""
    counters = cuda.to_device(np.zeros(gw.TILE_COUNTERS, np.int32))
    workspace = matmul.GemmWorkspace(partials=cuda.to_device(np.full(3 * 6 * 64 * 64, np.nan, np.float32)),
                                     x_bf16=cuda.device_array(70 * 200, np.uint16), tile_counters=counters)  # fmt: skip
    for seed in (1, 2):
        launcher = functools.partial(gw.gemm_wgmma, config=gw.TINY, split=3, workspace=workspace)
        run_gemm_wgmma(70, 150, 200, seed == 2, seed=seed, launcher=launcher)
        assert not counters.copy_to_host().any()


def test_gemm_wgmma_split_over_a_cluster_walks_several_tiles(monkeypatch):
    """A 2-way K split summed in a cluster's shared memory (the two blocks run at once, each with its
    own memory): K = 264 (2 + 3 slices), three column tiles walked by one cluster (one SM), so each
    tile's exchange waits until the other block has read the previous one; each
    block stores half of every tile's columns, adding what out held."""
    launches = []
    monkeypatch.setattr(gw, "launch", lambda kernel_, grid, *a, **kw: (launches.append((grid, kw.get("cluster"))),
                                                                        launch(kernel_, grid, *a, **kw)))  # fmt: skip
    monkeypatch.setattr(gw, "num_sms", lambda: 1)  # (as the simulator has; on a GPU too)
    run_gemm_wgmma(5, 150, 264, True, seed=7, launcher=functools.partial(gw.gemm_wgmma, config=gw.TINY, split=2, in_cluster=True))
    assert launches[-1] == ((1, 1, 2), (1, 1, 2))  # (after x's conversion)


@pytest.mark.slow
def test_gemm_wgmma_split_over_a_cluster_of_four():
    """A 4-way split in a cluster (K = 328: 1 + 1 + 2 + 2 slices; each block stores 16 of the 64 columns)
    on the 64 x 128 tiling too (two ways there), and on MEDIUM's 128 x 128 (rows in both consumers)."""
    for config, split, (m, n, k, accumulate) in ((gw.TINY, 4, (5, 24, 328, False)), (gw.SMALL, 2, (9, 130, 200, True)),
                                                 (gw.MEDIUM, 2, (70, 140, 200, True))):  # fmt: skip
        launcher = functools.partial(gw.gemm_wgmma, config=config, split=split, in_cluster=True)
        run_gemm_wgmma(m, n, k, accumulate, seed=split, launcher=launcher)


def test_a_cluster_split_is_two_or_four_ways_without_swiglu():
    x, w = cuda.to_device(np.zeros((4, 256), np.float32)), upload_bf16(np.zeros((16, 256), np.float32))  # 4 slices of K
    with pytest.raises(KernelError, match="cluster"):
        gw.gemm_wgmma(x, w, cuda.device_array((4, 16), np.float32), config=gw.TINY, split=3, in_cluster=True)


MULTICAST_CASES = [  # (config, (mc_m, mc_n), (M, N, K, accumulate)); TINY_SHALLOW: 4 stages, the ring wraps
    (gw.TINY_SHALLOW, (2, 1), (70, 100, 136, True)),  # two M tiles share a w tile (the second partial); 2 N tiles
    (gw.TINY, (1, 2), (5, 150, 72, False)),  # x shared by two N tiles; the third N tile's partner past the matrix
    (gw.TINY_SHALLOW, (2, 2), (130, 70, 136, True)),  # both shared; 3 M tiles: the second cluster's lower half past M
]


@pytest.mark.parametrize("config, multicast, shape", MULTICAST_CASES, ids=["2x1", "1x2", "2x2"])
def test_gemm_wgmma_multicast_shares_tile_copies_in_a_cluster(monkeypatch, config, multicast, shape):
    """Clusters whose blocks share the copies of the tiles they have in common: each copies a slice of
    the shared x or w tile into every block that needs it (multicast) and releases a stage in every
    block of the cluster; one cluster (one SM) walks every tile of the cluster's grid, its ring of
    stages running on across them; blocks past the matrix copy their zero-filled slices and store
    nothing."""
    launches = []
    monkeypatch.setattr(gw, "launch", lambda kernel_, grid, *a, **kw: (launches.append((grid, kw.get("cluster"))),
                                                                        launch(kernel_, grid, *a, **kw)))  # fmt: skip
    monkeypatch.setattr(gw, "max_active_clusters", lambda *a: 1)  # (as the simulator has; on a GPU too)
    m, n, k, accumulate = shape
    mc = multicast[0] * multicast[1]
    run_gemm_wgmma(m, n, k, accumulate, seed=mc, launcher=functools.partial(gw.gemm_wgmma, config=config, multicast=multicast))
    assert launches[-1] == ((1, 1, mc), (1, 1, mc))


@pytest.mark.slow
def test_gemm_wgmma_multicast_of_four_and_of_two_consumers():
    """Four blocks sharing a w tile (16-row slices), four sharing an x tile, and MEDIUM's 128 x 128 tiles
    (two consumer warpgroups, both releasing each block's stage) shared two ways."""
    for config, multicast, (m, n, k, accumulate) in ((gw.TINY, (4, 1), (200, 70, 72, True)),
                                                     (gw.TINY, (1, 4), (9, 300, 136, False)),
                                                     (gw.MEDIUM, (2, 1), (200, 130, 200, True))):  # fmt: skip
        launcher = functools.partial(gw.gemm_wgmma, config=config, multicast=multicast)
        run_gemm_wgmma(m, n, k, accumulate, seed=m, launcher=launcher)


def test_gemm_wgmma_silu_mul_multicast():
    """SwiGLU with the w tile shared by two M tiles: each block copies half the gate rows and half the
    same up rows of the tile into both."""
    m, f, k = 70, 40, 72
    x, w, _ = random_case(np.random.default_rng(12), m, 2 * f, k, False)
    out_bits = cuda.to_device(np.full((m, f), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=gw.TINY, multicast=(2, 1))
    check_swiglu(out_bits.copy_to_host(), x, w)


def test_multicast_needs_whole_swizzle_atoms_and_an_unsplit_k():
    x, w = cuda.to_device(np.zeros((4, 256), np.float32)), upload_bf16(np.zeros((64, 256), np.float32))
    out = cuda.device_array((4, 64), np.float32)
    for kwargs in ({"multicast": (2, 1), "split": 2}, {"multicast": (3, 1)}, {"multicast": (2, 1), "in_cluster": True}):
        with pytest.raises(KernelError, match="multicast"):
            gw.gemm_wgmma(x, w, out, config=gw.TINY, **kwargs)
    assert gw.multicast_fits(gw.TINY, (4, 1)) and gw.multicast_fits(gw.TINY, (4, 1), silu_mul=True)  # 16 and 8 rows
    assert not gw.multicast_fits(gw.TileConfig(1, 32, 2), (4, 1), silu_mul=True)  # 4 rows of each half


def test_gemm_wgmma_silu_mul_split_k():
    """SwiGLU after a K split: the last part of each tile sums gate and up columns, then applies it."""
    m, f, k = 9, 40, 328
    x, w, _ = random_case(np.random.default_rng(11), m, 2 * f, k, False)
    out_bits = cuda.to_device(np.full((m, f), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=gw.TINY, split=2)
    check_swiglu(out_bits.copy_to_host(), x, w)


def test_gemm_wgmma_converts_x_in_row_chunks():
    """A workspace smaller than x: the product goes in chunks of rows (here 3 rows of K = 16), with
    the split-K parts in the given workspace too (poisoned: a part no block wrote fails)."""
    workspace = matmul.GemmWorkspace(
        partials=cuda.to_device(np.full(2 * 3 * 9, np.nan, np.float32)), x_bf16=cuda.device_array(3 * 16, np.uint16)
    )
    launcher = functools.partial(gw.gemm_wgmma, config=gw.SMALL, workspace=workspace)
    run_gemm_wgmma(7, 9, 16, True, launcher=launcher)


def test_gemm_wgmma_misaligned_x():
    """x is read element by element when rounded to bf16: any alignment works."""
    run_gemm_wgmma(7, 9, 16, False, x_offset=1, launcher=functools.partial(gw.gemm_wgmma, config=gw.SMALL))


def test_k_not_a_multiple_of_8_goes_to_gemm_tc():
    """K = 20: no 16-byte copies of w rows; gemm_tc computes the product."""
    run_gemm_wgmma(9, 5, 20, True)


def test_linear_sends_prefill_to_gemm_wgmma_when_asked():
    launcher = functools.partial(matmul.linear, gemm="wgmma")
    run_gemm_wgmma(matmul.GEMV_MAX_TOKENS + 1, 33, 16, True, launcher=launcher)


# ---- x's bf16 copy written before the product (x_copy) ---------------------------------------------

EPS = 1e-5


def _count_conversions(monkeypatch) -> list:
    """A list that gets an entry at every launch of gemm_wgmma's conversion pass."""
    seen = []
    real = gw.launch

    def counting(kernel_, *args, **kwargs):
        if kernel_ is gw._x_to_bf16_kernel:
            seen.append(args)
        return real(kernel_, *args, **kwargs)

    monkeypatch.setattr(gw, "launch", counting)
    return seen


def _workspace(values: int) -> matmul.GemmWorkspace:
    """A GEMM workspace with an x copy of `values` bf16 (poisoned: 0xFFFF is a bf16 NaN) and no split parts."""
    return matmul.GemmWorkspace(partials=None, x_bf16=cuda.to_device(np.full(values, 0xFFFF, np.uint16)))


def _nan(shape):
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def test_gemm_wgmma_reads_x_from_the_workspace_when_told(monkeypatch):
    """x_copy: the bf16 rows in bf16_x_destination's view are x; the f32 x (NaN) is not read."""
    conversions = _count_conversions(monkeypatch)
    x, w, out0 = random_case(np.random.default_rng(3), 13, 24, 72, True)
    workspace, d_w, d_out = _workspace(13 * 72 + 5), upload_bf16(w), cuda.to_device(out0)
    gw.bf16_x_destination(workspace, 13, 72, d_w).copy_to_device(bf16_bits(to_bf16(x)))
    gw.gemm_wgmma(_nan(x.shape), d_w, d_out, True, config=gw.SMALL, workspace=workspace, x_copy=workspace.x_bf16)
    check_product(d_out.copy_to_host(), x.astype(BF16).astype(np.float32), w, out0, True)
    assert conversions == []


def test_the_workspace_takes_x_only_in_one_piece_by_aligned_rows():
    """No destination (the f32 x is needed) past the workspace, at K % 8, or for an unaligned w; asking
    gemm_wgmma to read x from the workspace then is an error, not a wrong product."""
    workspace = _workspace(10 * 16)
    assert gw.bf16_x_destination(workspace, 10, 16).shape == (10, 16)
    assert gw.bf16_x_destination(workspace, 11, 16) is None
    assert gw.bf16_x_destination(workspace, 4, 20) is None
    unaligned = cuda.to_device(np.zeros(5 * 16 + 1, np.uint16))[1:].reshape(5, 16)  # (N, K) bits, 2 bytes off
    assert gw.bf16_x_destination(workspace, 4, 16, unaligned) is None
    with pytest.raises(KernelError, match="gemm_wgmma: x .4 x 20. cannot be read from the bf16 copy"):
        gw.gemm_wgmma(_nan((4, 20)), upload_bf16(np.ones((3, 20))), _nan((4, 3)), workspace=workspace, x_copy=workspace.x_bf16)


def test_linear_norm_writes_the_bf16_x_of_gemm_wgmma(monkeypatch):
    """Before a gemm_wgmma product the norm stores its output as bf16 in the workspace: the bits the
    conversion pass makes of the f32 norm, no conversion launch, the f32 scratch left alone."""
    conversions = _count_conversions(monkeypatch)
    m, n, k = matmul.GEMV_MAX_TOKENS + 1, 40, 48
    rng = np.random.default_rng(4)
    x, w, out0 = random_case(rng, m, n, k, True)
    weight = upload_bf16(1.0 + 0.1 * rng.standard_normal(k))  # (K,) bf16
    d_x, d_out, normed, workspace = cuda.to_device(x), cuda.to_device(out0), _nan((m, k)), _workspace(64 * k)
    matmul.linear(d_x, upload_bf16(w), d_out, True, norm=(weight, EPS), normed=normed, gemm="wgmma", workspace=workspace)
    assert conversions == []
    assert np.isnan(normed.copy_to_host()).all()
    h = _nan((m, k))  # (M, K) f32: the norm the f32 path would have converted
    rms_norm(d_x, weight, h, EPS)
    np.testing.assert_array_equal(workspace.x_bf16[: m * k].copy_to_host().reshape(m, k), wgmma_conversion(h))
    check_product(d_out.copy_to_host(), to_bf16(h.copy_to_host()).astype(np.float32), w, out0, True)


def test_linear_silu_hands_its_bf16_copy_to_the_next_product_only(monkeypatch):
    """SwiGLU before a gemm_wgmma product: its output's bf16 copy (the conversion's bits) waits in the
    workspace, the down product with that x takes it (no conversion), and any other call forgets it."""
    conversions = _count_conversions(monkeypatch)
    m, d, f = matmul.GEMV_MAX_TOKENS + 1, 16, 24
    rng = np.random.default_rng(5)
    x, w_gate_up, _ = random_case(rng, m, 2 * f, d, False)
    _, w_down, out0 = random_case(rng, m, d, f, True)
    d_x, d_gate_up, d_down, workspace = cuda.to_device(x), upload_bf16(w_gate_up), upload_bf16(w_down), _workspace(m * f)
    gate_up, act, out = _nan((m, 2 * f)), _nan((m, f)), cuda.to_device(out0)
    wgmma = {"gemm": "wgmma", "workspace": workspace}
    matmul.linear(d_x, d_gate_up, act, silu_mul=True, gate_up=gate_up, **wgmma)
    assert len(conversions) == 1 and workspace.handed == (act, workspace.x_bf16)  # x's conversion (no norm before it)
    check_product(gate_up.copy_to_host(), x.astype(BF16).astype(np.float32), w_gate_up, None, False)
    np.testing.assert_array_equal(workspace.x_bf16[: m * f].copy_to_host().reshape(m, f), wgmma_conversion(act))
    matmul.linear(act, d_down, out, True, **wgmma)
    assert len(conversions) == 1 and workspace.handed is None
    check_product(out.copy_to_host(), to_bf16(act.copy_to_host()).astype(np.float32), w_down, out0, True)

    matmul.linear(d_x, d_gate_up, act, silu_mul=True, gate_up=gate_up, **wgmma)  # 2nd conversion
    matmul.linear(cuda.to_device(np.ones((m, f), np.float32)), d_down, _nan((m, d)), **wgmma)  # another x: 3rd
    out = cuda.to_device(out0)
    matmul.linear(act, d_down, out, True, **wgmma)  # the copy was forgotten: 4th
    assert len(conversions) == 4
    check_product(out.copy_to_host(), to_bf16(act.copy_to_host()).astype(np.float32), w_down, out0, True)


# ---- SwiGLU in the gate/up product's epilogue -----------------------------------------------------


def swiglu_reference(x, w_gate_up):
    """(value, bound) (M, F) float64: silu(x @ gate.T) * (x @ up.T) on the bf16-rounded inputs, and how
    far a kernel's bf16 result may be from it: one bf16 rounding (2^-8 relative) plus the products'
    fp32 error (test_gemv's RTOL of |x| @ |w|.T) carried through silu (|silu'| <= 1.1) and the multiply."""
    x64 = x.astype(BF16).astype(np.float64)
    w64 = w_gate_up.astype(np.float32).astype(np.float64)
    f = w64.shape[0] // 2
    g, u = x64 @ w64[:f].T, x64 @ w64[f:].T
    eg, eu = 1e-5 * (np.abs(x64) @ np.abs(w64[:f]).T), 1e-5 * (np.abs(x64) @ np.abs(w64[f:]).T)
    silu = g / (1.0 + np.exp(-g))
    value = silu * u
    return value, 2.0**-8 * np.abs(value) + 1.1 * np.abs(u) * eg + np.abs(silu) * eu + 1e-30


def check_swiglu(got_bits, x, w_gate_up):
    """A kernel's (M, F) bf16 bits against swiglu_reference; 0xFFFF (the poison) fails as NaN."""
    got = got_bits.view(BF16).astype(np.float64)
    want, bound = swiglu_reference(x, w_gate_up)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs unwritten (NaN)"
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: got {got[worst]}, want {want[worst]}"


@pytest.mark.parametrize(
    "m, f, k, config",
    [(5, 24, 72, gw.SMALL),  # one block: gate rows 0..23 then up rows 24..47 in its two 64-row boxes
     (9, 40, 200, gw.TINY)],  # two column tiles of 32 (the second with 8), K past the stages
    ids=["small", "tiny"],
)  # fmt: skip
def test_gemm_wgmma_silu_mul(m, f, k, config):
    """out_bits = bf16(silu(x @ gate.T) * (x @ up.T)): each block pairs gate and up rows of the same
    columns, at M and F not multiples of the tile; every element written (the output starts as NaN)."""
    x, w, _ = random_case(np.random.default_rng(m + f), m, 2 * f, k, False)
    out_bits = cuda.to_device(np.full((m, f), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=config)
    check_swiglu(out_bits.copy_to_host(), x, w)


def test_gemm_wgmma_silu_mul_refuses_what_it_cannot_copy():
    """F or K not a multiple of 8 (TMA row strides): an error, not a wrong product (linear then runs
    SwiGLU on its own: silu_mul_destination says None)."""
    workspace = matmul.GemmWorkspace(partials=None, x_bf16=cuda.device_array(64, np.uint16),
                                     act_bf16=cuda.device_array(64, np.uint16))  # fmt: skip
    for f, k in ((12, 16), (8, 20)):
        w = upload_bf16(np.ones((2 * f, k)))
        assert gw.silu_mul_destination(workspace, 2, w) is None
        with pytest.raises(KernelError, match="gemm_wgmma_silu_mul: w"):
            gw.gemm_wgmma_silu_mul(_nan((2, k)), w, cuda.device_array((2, f), np.uint16))
    assert gw.silu_mul_destination(workspace, 2, upload_bf16(np.ones((16, 16)))).shape == (2, 8)
    assert gw.silu_mul_destination(workspace, 9, upload_bf16(np.ones((16, 16)))) is None  # 9 x 8 > 64 values


def test_linear_runs_swiglu_in_the_product_when_only_the_next_product_reads_it(monkeypatch):
    """next_product_only: the norm's bf16 x, the gate/up product with SwiGLU in its epilogue (the f32
    product and act are never written), the down product reading act's bf16 copy: the MLP of a
    Llama layer with no conversion pass; a product that cannot read the copy is an error, since no
    f32 act exists."""
    conversions = _count_conversions(monkeypatch)
    m, d, f = matmul.GEMV_MAX_TOKENS + 1, 16, 24
    rng = np.random.default_rng(6)
    x, w_gate_up, _ = random_case(rng, m, 2 * f, d, False)
    _, w_down, out0 = random_case(rng, m, d, f, True)
    weight = upload_bf16(1.0 + 0.1 * rng.standard_normal(d))  # (D,) bf16 norm weight
    workspace = matmul.GemmWorkspace(partials=None, x_bf16=cuda.to_device(np.full(m * f, 0xFFFF, np.uint16)),
                                     act_bf16=cuda.to_device(np.full(m * f, 0xFFFF, np.uint16)))  # fmt: skip
    d_x, gate_up, act, out = cuda.to_device(x), _nan((m, 2 * f)), _nan((m, f)), cuda.to_device(out0)
    wgmma = {"gemm": "wgmma", "workspace": workspace}
    matmul.linear(d_x, upload_bf16(w_gate_up), act, norm=(weight, EPS), silu_mul=True, normed=_nan((m, d)),
                  gate_up=gate_up, next_product_only=True, **wgmma)  # fmt: skip
    assert conversions == [] and workspace.handed == (act, workspace.act_bf16)
    assert np.isnan(gate_up.copy_to_host()).all() and np.isnan(act.copy_to_host()).all()
    h = _nan((m, d))
    rms_norm(d_x, weight, h, EPS)
    act_bits = workspace.act_bf16[: m * f].copy_to_host().reshape(m, f)
    check_swiglu(act_bits, h.copy_to_host(), w_gate_up)
    matmul.linear(act, upload_bf16(w_down), out, True, **wgmma)
    assert conversions == [] and workspace.handed is None
    check_product(out.copy_to_host(), act_bits.view(BF16).astype(np.float32), w_down, out0, True)

    matmul.linear(d_x, upload_bf16(w_gate_up), act, norm=(weight, EPS), silu_mul=True, normed=_nan((m, d)),
                  gate_up=gate_up, next_product_only=True, **wgmma)  # fmt: skip
    with pytest.raises(KernelError, match="exists only as a bf16 copy"):
        matmul.linear(act, upload_bf16(w_down), out, True, gemm="tensor_cores", workspace=workspace)


@pytest.mark.parametrize(
    "m, n, sms, want",
    [(4096, 8192, 132, gw.LARGE), (512, 8192, 132, gw.LARGE), (64, 128256, 132, gw.SMALL), (128, 128256, 132, gw.LARGE),
     (256, 8192, 132, gw.SMALL), (128, 16384, 132, gw.SMALL), (512, 2048, 132, gw.SMALL), (1024, 2048, 132, gw.SMALL),
     (128, 8192, 132, gw.SMALL), (256, 2048, 132, gw.TINY), (64, 8192, 132, gw.TINY), (1, 1, 132, gw.TINY),
     (128, 256, 1, gw.LARGE), (64, 256, 1, gw.SMALL)],
)  # fmt: skip
def test_the_largest_tiling_that_reaches_most_sms_is_picked(m, n, sms, want):
    """The tile sizes that were fastest on an H200 (gemm_wgmma's table): 128 LARGE tiles beat 256
    SMALL ones, and no 128-row tile for 64 rows or fewer."""
    assert gw.pick_tile_config(m, n, num_sms=sms) == want


@pytest.mark.parametrize(
    "m, n, k, want",
    [(32, 2048, 2048, (gw.TINY, 2, True)), (128, 2048, 2048, (gw.TINY, 2, True)), (64, 3072, 2048, (gw.TINY, 2, True)),
     (128, 3072, 2048, (gw.TINY, 1, False)), (256, 2048, 2048, (gw.TINY, 1, False)), (32, 2048, 512, (gw.TINY, 1, False)),
     (32, 2048, 8192, (gw.TINY, 4, False)), (128, 2048, 8192, (gw.TINY, 2, True)), (256, 2048, 8192, (gw.TALL, 2, True)),
     (384, 2048, 8192, (gw.MEDIUM, 2, True)), (512, 2048, 8192, (gw.MEDIUM, 2, True)), (384, 2048, 2048, (gw.TALL, 1, False)),
     (512, 2048, 2048, (gw.TALL, 1, False)), (256, 2048, 512, (gw.TINY, 1, False)), (384, 3072, 2048, (gw.SMALL, 1, False)),
     (512, 2048, 512, (gw.SMALL_DEEP, 1, False)), (512, 3072, 2048, (gw.SMALL, 1, False)),
     (128, 8192, 2048, (gw.SMALL_DEEP, 1, False)), (256, 8192, 2048, (gw.SMALL, 1, False)),
     (32, 128256, 2048, (gw.SMALL, 1, False)), (512, 8192, 2048, (gw.LARGE, 1, False)), (1024, 2048, 2048, (gw.SMALL, 1, False)),
     (320, 2048, 2048, (gw.TALL, 1, False)), (320, 2048, 512, (gw.TINY_SHALLOW, 1, False))],  # (K = 512: no TALL, unmeasured)
)  # fmt: skip
def test_the_plan_is_the_fastest_measured(m, n, k, want):
    """Tile, split, pipeline depth and where the parts meet as the H200 sweep found fastest
    (docs/benchmarks.md): a grid of at most one block per SM gets the deeper pipeline, a larger one
    the shallower; TINY tiles that leave half the SMs idle, on a K split at most two ways otherwise
    (2048 or 8192 here, not 512), split it between the two blocks of a cluster; past 128 rows a K of
    8192 is split in a cluster over MEDIUM or TALL tiles, whichever pairs fill more than half the SMs;
    past 256 rows of a shorter K (not 512), TALL tiles where they fill more than half the SMs (not the
    3072-row weight's, which would need more blocks than SMs)."""
    assert gw.pick_plan(m, n, k, num_sms=132) == (*want, gw.NO_MULTICAST)


@pytest.mark.parametrize(
    "config, blocks, k, want",
    [(gw.TINY, 32, 8192, 4), (gw.TINY, 64, 8192, 2), (gw.TINY, 128, 8192, 1), (gw.TINY, 32, 2048, 1),
     (gw.SMALL, 128, 8192, 2), (gw.LARGE, 1024, 2048, 1), (gw.LARGE, 64, 2048, 1)],
)  # fmt: skip
def test_k_is_split_only_when_few_tiles_meet_a_long_k(config, blocks, k, want):
    assert gw.pick_k_split(config, blocks, k, num_sms=132) == want


def test_auto_is_gemm_wgmma_on_hopper_only(monkeypatch):
    calls = []
    monkeypatch.setattr(matmul, "gemm_tc", lambda *args, **kwargs: calls.append("gemm_tc"))
    monkeypatch.setattr(matmul, "gemm_wgmma", lambda *args, **kwargs: calls.append("gemm_wgmma"))
    monkeypatch.setattr(matmul, "_hopper", lambda: False)  # (the simulator, or a GPU before sm_90)
    matmul.gemm_auto(None, None, None)
    monkeypatch.setattr(matmul, "_hopper", lambda: True)
    matmul.gemm_auto(None, None, None)
    assert calls == ["gemm_tc", "gemm_wgmma"]


def test_tilings_fit_in_shared_memory():
    for config in gw.TILE_CONFIGS:
        assert config.shared_bytes <= 227 * 1024


# ---- PTX, no GPU ----------------------------------------------------------------------------------

VARIANTS = select(("gemm_wgmma", "x_to_bf16"))  # the kernel registry's builds (numba_vllm/bench/kernel_report.py)
TILINGS = [v for v in VARIANTS if v.name == "gemm_wgmma"]


@pytest.fixture(scope="module")
def wgmma_ptx():
    return ptx_check.compile_ptx(VARIANTS)


@pytest.mark.slow  # compiles through NVVM
def test_conversion_compiles(wgmma_ptx):
    result = wgmma_ptx["x_to_bf16"]
    assert "error" not in result, result.get("error")
    assert ptx_check.ptx_problems(result["ptx"], hot=True) == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", TILINGS, ids=[v.key for v in TILINGS])
def test_kernel_compiles_to_wgmma_and_tma(wgmma_ptx, variant):
    result = wgmma_ptx[variant.key]
    assert "error" not in result, result.get("error")
    text = result["ptx"]
    assert ptx_check.ptx_problems(text, hot=True) == []
    block_n = int(variant.variant.split()[1].split("x")[1])  # "LARGE 128x256" or "LARGE 128x256 silu_mul"
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16" in text
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert "mbarrier.try_wait.parity.shared::cta.b64" in text
    assert (".multicast::cluster" in text) == ("multicast" in variant.variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", TILINGS, ids=[v.key for v in TILINGS])
def test_kernel_assembles_with_the_wgmma_pipeline_kept(wgmma_ptx, tmp_path, variant):
    """ptxas for sm_90a (the target wgmma needs; the PTX was built without a GPU for sm_90): no spills,
    and no C7515 ("wgmma serialized": each wgmma would wait for the one before)."""
    try:
        ptxas = find_ptxas()
    except ReportError as e:
        pytest.skip(str(e))
    text = re.sub(r"^\.target sm_90\b", ".target sm_90a", wgmma_ptx[variant.key]["ptx"], count=1, flags=re.M)
    path = tmp_path / "kernel.ptx"
    path.write_text(text)
    proc = subprocess.run([ptxas.path, "--gpu-name=sm_90a", "-v", str(path), "-o", str(tmp_path / "kernel.cubin")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "0 bytes spill stores" in proc.stderr, proc.stderr
    assert "C7515" not in proc.stderr and "serialized" not in proc.stderr, proc.stderr[-2000:]


# ---- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_wgmma_gpu_random_values():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, PROBE_K)).astype(BF16)
    b = rng.standard_normal((PROBE_K, PROBE_N)).astype(BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.all(np.abs(_run_probe(a, b) - a64 @ b64) <= 1e-5 * (np.abs(a64) @ np.abs(b64)))


@pytest.mark.gpu
@pytest.mark.parametrize("config", gw.TILE_CONFIGS, ids=TILING_IDS)
@pytest.mark.parametrize("m,n,k,accumulate", [(256, 2048, 8192, True), (77, 3072, 2048, False), (333, 1003, 1000, True)])
def test_gemm_wgmma_gpu_each_tiling(m, n, k, accumulate, config):
    run_gemm_wgmma(m, n, k, accumulate, seed=m, launcher=functools.partial(gw.gemm_wgmma, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 2048, 2048), (128, 8192, 2048), (512, 2048, 8192), (300, 128256, 2048)])
def test_gemm_wgmma_gpu_decode_shapes(m, n, k):
    run_gemm_wgmma(m, n, k, True, seed=n)


@pytest.mark.gpu
@pytest.mark.parametrize("config", gw.TILE_CONFIGS, ids=TILING_IDS)
@pytest.mark.parametrize("split", [2, 3, 8])
def test_gemm_wgmma_gpu_split_k(config, split):
    """K split on the GPU, where the parts' blocks run at once and any of them can arrive last: the
    sum is right (and the counters are left at zero for the next product, which checks it again)."""
    counters = cuda.to_device(np.zeros(gw.TILE_COUNTERS, np.int32))
    workspace = matmul.GemmWorkspace(partials=cuda.device_array(split * 3 * 16 * 128 * 256, np.float32),
                                     x_bf16=cuda.device_array(300 * 4096, np.uint16), tile_counters=counters)  # fmt: skip
    for seed in (1, 2):
        launcher = functools.partial(gw.gemm_wgmma, config=config, split=split, workspace=workspace)
        run_gemm_wgmma(300, 2000, 4096, seed == 2, seed=seed, launcher=launcher)
        assert not counters.copy_to_host().any()


@pytest.mark.gpu
def test_gemm_wgmma_gpu_split_k_is_deterministic():
    """Whichever block of a tile arrives last, it adds the parts in order of z: ten runs of an 8-way
    split on the GPU (blocks finishing in any order) give the same bits."""
    x, w, _ = random_case(np.random.default_rng(4), 256, 2048, 8192, False)
    d_x, d_w, d_out = cuda.to_device(x), upload_bf16(w), cuda.device_array((256, 2048), np.float32)
    runs = []
    for _ in range(10):
        gw.gemm_wgmma(d_x, d_w, d_out, config=gw.TINY, split=8)
        runs.append(d_out.copy_to_host())
    assert all(np.array_equal(run, runs[0]) for run in runs[1:])


CLUSTER_TILINGS = [c for c in gw.TILE_CONFIGS if c != gw.LARGE]  # (LARGE's parts do not fit beside its stages)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CLUSTER_TILINGS, ids=TILING_IDS[1:])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("m,n,k,accumulate", [(64, 2048, 2048, True), (300, 2000, 4096, False), (512, 2048, 200, True)])
def test_gemm_wgmma_gpu_split_over_a_cluster(m, n, k, accumulate, config, split):
    """K split over a cluster on the GPU: decode-sized products, more tiles than clusters (each
    cluster walks several: the exchange buffer reused), and K = 200 (4 slices: 1 each at 4 ways)."""
    launcher = functools.partial(gw.gemm_wgmma, config=config, split=split, in_cluster=True)
    run_gemm_wgmma(m, n, k, accumulate, seed=m + split, launcher=launcher)


MULTICAST_TILINGS = [(c, mc) for c in gw.TILE_CONFIGS for mc in ((2, 1), (1, 2))] + [(gw.TINY, (2, 2)), (gw.TINY, (4, 1))]


@pytest.mark.gpu
@pytest.mark.parametrize("config, multicast", MULTICAST_TILINGS,
                         ids=[f"{TILING_IDS[gw.TILE_CONFIGS.index(c)]}-{a}x{b}" for c, (a, b) in MULTICAST_TILINGS])  # fmt: skip
@pytest.mark.parametrize("m,n,k,accumulate", [(300, 2000, 1000, True), (77, 8192, 200, False)])
def test_gemm_wgmma_gpu_multicast(m, n, k, accumulate, config, multicast):
    """Tile copies shared in a cluster on the GPU: decode-sized products, more cluster tiles than
    clusters (each walks several), partial M and N tiles (blocks past the matrix in a cluster)."""
    launcher = functools.partial(gw.gemm_wgmma, config=config, multicast=multicast)
    run_gemm_wgmma(m, n, k, accumulate, seed=m + multicast[0], launcher=launcher)


@pytest.mark.gpu
def test_gemm_wgmma_silu_mul_gpu_multicast():
    x, w, _ = random_case(np.random.default_rng(5), 300, 2 * 8192, 2048, False)
    out_bits = cuda.to_device(np.full((300, 8192), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=gw.SMALL, multicast=(2, 1))
    check_swiglu(out_bits.copy_to_host(), x, w)


@pytest.mark.gpu
def test_gemm_wgmma_gpu_cluster_split_is_deterministic():
    """Each block adds the parts in order of rank: ten runs of a 4-way cluster split give the same bits."""
    x, w, _ = random_case(np.random.default_rng(6), 256, 2048, 2048, False)
    d_x, d_w, d_out = cuda.to_device(x), upload_bf16(w), cuda.device_array((256, 2048), np.float32)
    runs = []
    for _ in range(10):
        gw.gemm_wgmma(d_x, d_w, d_out, config=gw.TINY_SHALLOW, split=4, in_cluster=True)
        runs.append(d_out.copy_to_host())
    assert all(np.array_equal(run, runs[0]) for run in runs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("config", gw.TILE_CONFIGS, ids=TILING_IDS)
def test_gemm_wgmma_silu_mul_gpu_split_k(config):
    x, w, _ = random_case(np.random.default_rng(3), 77, 2 * 1000, 2048, False)
    out_bits = cuda.to_device(np.full((77, 1000), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=config, split=4)
    check_swiglu(out_bits.copy_to_host(), x, w)


@pytest.mark.gpu
def test_gemm_wgmma_gpu_misaligned_x():
    run_gemm_wgmma(200, 2048, 2048, True, x_offset=3)


@pytest.mark.gpu
@pytest.mark.parametrize("config", gw.TILE_CONFIGS, ids=TILING_IDS)
@pytest.mark.parametrize("m,f,k", [(300, 8192, 2048), (77, 1000, 2048)])
def test_gemm_wgmma_silu_mul_gpu_each_tiling(m, f, k, config):
    """SwiGLU in the epilogue at Llama 3.2 1B's gate/up shape, and at an F no tile divides."""
    x, w, _ = random_case(np.random.default_rng(m), m, 2 * f, k, False)
    out_bits = cuda.to_device(np.full((m, f), 0xFFFF, np.uint16))
    gw.gemm_wgmma_silu_mul(cuda.to_device(x), upload_bf16(w), out_bits, config=config)
    check_swiglu(out_bits.copy_to_host(), x, w)
