"""Warp intrinsics and the pooled block manager of the simulator (numba_vllm.sim.warp, sim_blocks).

Each test launches a tiny kernel and checks the result against what a GPU computes, or checks
that undefined behaviour is made loud (NaN, WarpSyncError, SimulatorDeadlockError).
Simulator only: skipped when the tests run on a GPU.
"""

import os
import time

import numpy as np
import pytest
from numba import cuda, float32

from numba_vllm.kernels.jit import kernel
from numba_vllm.sim import blocks as sim_blocks
from numba_vllm.sim import warp as simulator
from numba_vllm.sim.blocks import SimulatorDeadlockError, WarpSyncError

pytestmark = pytest.mark.skipif(
    not simulator.simulator_enabled(), reason="tests the CUDA simulator"
)

FULL = 0xFFFFFFFF
LANES = np.arange(32)


def launch(k, block_dim, *args, grid_dim=1):
    """Run ``k`` on copies of the array arguments; return the arguments (arrays: the outputs)."""
    args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    k[grid_dim, block_dim](*args)
    return args


# Kernels. Each thread works on element cuda.threadIdx.x of its arrays.


@kernel
def shfl_modes_kernel(x, idx_out, up_out, down_out, xor_out):
    i = cuda.threadIdx.x
    v = x[i]
    idx_out[i] = cuda.shfl_sync(FULL, v, 37)  # 37 & 31 == lane 5
    up_out[i] = cuda.shfl_up_sync(FULL, v, 3)
    down_out[i] = cuda.shfl_down_sync(FULL, v, 3)
    xor_out[i] = cuda.shfl_xor_sync(FULL, v, 6)


@kernel
def tree_sum_kernel(x, out):
    """Down-sweep: lane 0 ends with the warp's sum (the other lanes hold partial sums)."""
    i = cuda.threadIdx.x
    v = x[i]
    offset = 16
    while offset > 0:
        v += cuda.shfl_down_sync(FULL, v, offset)
        offset //= 2
    out[i] = v


@kernel
def butterfly_sum_kernel(x, out, mask, first_offset):
    """xor butterfly among the lanes of ``mask`` (0 = full warp: use 0xFFFFFFFF)."""
    i = cuda.threadIdx.x
    m = mask[i]
    v = x[i]
    offset = first_offset
    while offset > 0:
        v += cuda.shfl_xor_sync(m, v, offset)
        offset //= 2
    out[i] = v


@kernel
def exit_then_sum_kernel(x, out, num_active, first_offset):
    """Lanes >= num_active return at once; the others run a full-mask xor butterfly."""
    i = cuda.threadIdx.x
    if i >= num_active:
        return
    v = x[i]
    offset = first_offset
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL, v, offset)
        offset //= 2
    out[i] = v


@kernel
def many_rounds_kernel(out, num_rounds):
    """Broadcast a new value every round; a fast lane must not clobber a slow lane's round."""
    lane = cuda.threadIdx.x
    total = 0
    for r in range(num_rounds):
        total += cuda.shfl_sync(FULL, 1000 * r + lane, r % 32)
    out[lane] = total


@kernel
def votes_kernel(pred, ballot_out, any_out, all_out, lt_out, active_out):
    i = cuda.threadIdx.x
    p = pred[i]
    ballot_out[i] = cuda.ballot_sync(FULL, p)
    any_out[i] = cuda.any_sync(FULL, p)
    all_out[i] = cuda.all_sync(FULL, p)
    lt_out[i] = cuda.lanemask_lt()
    active_out[i] = cuda.activemask()


@kernel
def syncwarp_kernel(out):
    lane = cuda.threadIdx.x
    buf = cuda.shared.array(32, float32)
    buf[lane] = lane
    cuda.syncwarp(FULL)  # wait for every lane's write
    out[lane] = buf[(lane + 1) % 32]


@kernel
def rotate_kernel(out, num_steps):
    """Pass values around the block through shared memory, across warps."""
    i = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf = cuda.shared.array(128, float32)
    v = float32(i)
    for _ in range(num_steps):
        buf[i] = v
        cuda.syncthreads()  # wait for every write
        v = buf[(i + 37) % n]
        cuda.syncthreads()  # wait for every read before the next write
    out[cuda.blockIdx.x * n + i] = v


@kernel
def syncthreads_reduce_kernel(pred, out):
    i = cuda.threadIdx.x
    if i >= 100:
        return  # dropped from the barriers
    p = pred[i]
    out[i, 0] = cuda.syncthreads_count(p)
    out[i, 1] = cuda.syncthreads_and(p)
    out[i, 2] = cuda.syncthreads_or(p)


@kernel
def split_warp_kernel(out):
    """Half the warp shuffles with the full mask, the other half waits in syncthreads."""
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_xor_sync(FULL, out[i], 1)
    else:
        cuda.syncthreads()


@kernel
def missing_lane_kernel(out):
    """Lanes 0-30 shuffle with the full mask; lane 31 stays in syncthreads."""
    i = cuda.threadIdx.x
    if i == 31:
        cuda.syncthreads()
    else:
        out[i] = cuda.shfl_sync(FULL, out[i], 0)


def _stall():
    time.sleep(1.0)


@kernel
def slow_lane_kernel(out):
    """Lane 31 is busy (sleeps) while the others wait for it in a shuffle."""
    i = cuda.threadIdx.x
    if i == 31:
        _stall()
    out[i] = cuda.shfl_sync(FULL, out[i], 0)


@kernel
def raising_kernel(out):
    i = cuda.threadIdx.x
    if i == 5:
        out[i] = 1 // (i - 5)
    cuda.syncthreads()
    out[i] = 1


@kernel
def foreign_mask_kernel(out):
    i = cuda.threadIdx.x
    out[i] = cuda.shfl_sync(0x0000FFFF, out[i], 0)  # lanes 16-31 are not in the mask


@kernel
def mixed_ops_kernel(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_sync(FULL, out[i], 0)
    else:
        out[i] = cuda.ballot_sync(FULL, i > 20)


@kernel
def laneid_kernel(out):
    tid = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    out[tid] = cuda.shfl_xor_sync(FULL, tid, 1) * 100 + cuda.laneid


# Tests


def test_install_is_idempotent():
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    simulator.install()
    simulator.install()
    assert sim_kernel.BlockManager is sim_blocks.PooledBlockManager
    assert FakeCUDAModule.shfl_xor_sync is simulator.shfl_xor_sync


def test_shuffle_modes_follow_ptx_rules():
    x = (100 + LANES).astype(np.float32)
    idx, up, down, xor = launch(shfl_modes_kernel, 32, x, *[np.zeros(32, np.float32)] * 4)[1:]
    np.testing.assert_array_equal(idx, np.full(32, 105))  # broadcast of lane 37 & 31
    np.testing.assert_array_equal(up, np.where(LANES < 3, x, np.roll(x, 3)))  # low lanes keep own
    np.testing.assert_array_equal(down, np.where(LANES > 28, x, np.roll(x, -3)))  # high lanes too
    np.testing.assert_array_equal(xor, x[LANES ^ 6])


def test_full_warp_reductions():
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    tree = launch(tree_sum_kernel, 64, x, np.zeros(64, np.float32))[1]
    np.testing.assert_allclose(tree[[0, 32]], [x[:32].sum(), x[32:].sum()], rtol=1e-5)
    full_masks = np.full(64, FULL, np.uint32)
    fly = launch(butterfly_sum_kernel, 64, x, np.zeros(64, np.float32), full_masks, 16)[1]
    np.testing.assert_allclose(fly, np.repeat([x[:32].sum(), x[32:].sum()], 32), rtol=1e-5)


def test_integer_shuffles_keep_values_exact():
    x = np.arange(32, dtype=np.int64) * (1 << 40)  # needs 64 bits
    out = launch(butterfly_sum_kernel, 32, x, np.zeros(32, np.int64), np.full(32, FULL), 16)[1]
    np.testing.assert_array_equal(out, np.full(32, x.sum()))


def test_half_warp_masks_reduce_each_half():
    x = (1.0 + LANES).astype(np.float32)
    masks = np.where(LANES < 16, 0x0000FFFF, 0xFFFF0000).astype(np.uint32)
    out = launch(butterfly_sum_kernel, 32, x, np.zeros(32, np.float32), masks, 8)[1]
    np.testing.assert_array_equal(out, np.where(LANES < 16, x[:16].sum(), x[16:].sum()))


def test_partial_last_warp():
    """blockDim 40: warp 1 has lanes 0-7 only; the full mask means 'the lanes present'."""
    x = np.arange(40, dtype=np.float32)
    out = launch(butterfly_sum_kernel, 40, x, np.zeros(40, np.float32), np.full(40, FULL), 4)[1]
    np.testing.assert_array_equal(out[32:], np.full(8, x[32:].sum()))
    np.testing.assert_array_equal(out[:8], np.full(8, x[:8].sum()))  # warp 0, offsets 4, 2, 1
    # Offset 16 reads lanes 16-23 of warp 1, which do not exist.
    out = launch(butterfly_sum_kernel, 40, x, np.zeros(40, np.float32), np.full(40, FULL), 16)[1]
    assert np.isnan(out[32:]).all() and not np.isnan(out[:32]).any()


def test_lanes_that_exited_are_dropped_from_the_round():
    x = (1.0 + LANES).astype(np.float32)
    out = launch(exit_then_sum_kernel, 32, x, np.zeros(32, np.float32), 16, 8)[1]
    np.testing.assert_array_equal(out[:16], np.full(16, x[:16].sum()))


def test_reading_an_exited_lane_is_nan_or_error():
    x = (1.0 + LANES).astype(np.float32)
    out = launch(exit_then_sum_kernel, 32, x, np.zeros(32, np.float32), 16, 16)[1]
    assert np.isnan(out[:16]).all()  # offset 16 reads lanes 16-31, which returned
    with pytest.raises(WarpSyncError, match="did not take part"):
        launch(exit_then_sum_kernel, 32, LANES.astype(np.int32), np.zeros(32, np.int32), 16, 16)


def test_fast_lanes_do_not_overwrite_a_pending_round():
    out = launch(many_rounds_kernel, 32, np.zeros(32, np.int64), 40)[0]
    expected = sum(1000 * r + r % 32 for r in range(40))
    np.testing.assert_array_equal(out, np.full(32, expected))


def test_votes_and_lane_masks():
    pred = (LANES % 3 == 0).astype(np.int32)
    ballot, any_, all_, lt, active = launch(
        votes_kernel, 32, pred, *[np.zeros(32, np.int64) for _ in range(5)]
    )[1:]
    np.testing.assert_array_equal(ballot, np.full(32, sum(1 << i for i in LANES[::3])))
    assert any_.all() and not all_.any()
    np.testing.assert_array_equal(lt, (1 << LANES) - 1)
    np.testing.assert_array_equal(active, np.full(32, FULL))


def test_syncwarp_orders_shared_memory():
    out = launch(syncwarp_kernel, 32, np.zeros(32, np.float32))[0]
    np.testing.assert_array_equal(out, (LANES + 1) % 32)


def test_lanes_follow_the_linear_thread_id():
    """blockDim (16, 4): thread (x, y) is linear id x + 16 y, lane id % 32."""
    out = np.zeros(64, np.int64)
    laneid_kernel[1, (16, 4)](out)
    tid = np.arange(64)
    np.testing.assert_array_equal(out, (tid ^ 1) * 100 + tid % 32)


def test_syncthreads_across_warps_and_blocks():
    out = launch(rotate_kernel, 128, np.zeros(256, np.float32), 3, grid_dim=2)[0]
    np.testing.assert_array_equal(out, np.tile((np.arange(128) + 3 * 37) % 128, 2))


def test_syncthreads_reductions_drop_exited_threads():
    pred = (np.arange(128) % 2).astype(np.int32)
    out = launch(syncthreads_reduce_kernel, 128, pred, np.zeros((128, 3), np.int32))[1]
    np.testing.assert_array_equal(out[:100], np.tile([50, 0, 1], (100, 1)))


@pytest.mark.parametrize("k", [split_warp_kernel, missing_lane_kernel])
def test_deadlock_is_detected_at_once(k):
    """Found when every live thread waits (the deadlock message), not by the hang timeout ("waited more than")."""
    with pytest.raises(SimulatorDeadlockError, match="deadlock: every live thread waits"):
        launch(k, 32, np.zeros(32, np.float32))


def test_a_wait_longer_than_the_hang_timeout_raises(monkeypatch):
    monkeypatch.setattr(sim_blocks, "hang_timeout_s", 0.2)
    with pytest.raises(SimulatorDeadlockError, match="waited more than"):
        launch(slow_lane_kernel, 32, np.zeros(32, np.float32))


def test_errors_name_the_thread_and_the_pool_recovers():
    with pytest.raises(ZeroDivisionError, match=r"tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]"):
        launch(raising_kernel, 64, np.zeros(64, np.int32))
    with pytest.raises(WarpSyncError, match="does not include it"):
        launch(foreign_mask_kernel, 32, np.zeros(32, np.float32))
    with pytest.raises(WarpSyncError, match="wait in"):
        launch(mixed_ops_kernel, 32, np.zeros(32, np.float32))
    out = launch(raising_kernel, 4, np.zeros(4, np.int32))[0]  # thread 5 does not exist here
    np.testing.assert_array_equal(out, np.ones(4))


# many_rounds_kernel's output for 64 threads and 3 rounds: round r adds 1000 r + the id of its warp's lane r
THREE_ROUNDS_OF_64 = 3003 + 96 * (np.arange(64) // 32)


@pytest.mark.skipif(not sim_blocks.one_core, reason="no pinning: NUMBA_VLLM_SIM_ONE_CORE=0, or no sched_setaffinity here")
def test_a_launchs_threads_run_on_the_launching_threads_core(monkeypatch):
    """Only the thread holding the GIL runs, so the pool pins a launch's threads to the core the
    launching thread runs on (hand-overs on one core skip cross-core wake-ups); the next launch from
    another core moves them there."""
    taken = []  # the workers each launch plays its threads on
    take = sim_blocks._POOL.take
    monkeypatch.setattr(sim_blocks._POOL, "take", lambda count, core=None: taken.append(take(count, core)) or taken[-1])
    allowed = sorted(os.sched_getaffinity(0))
    try:
        for core in (allowed[0], allowed[-1]):
            os.sched_setaffinity(0, {core})  # the launching (this) thread on one core
            assert sim_blocks._launching_core() == core
            out = launch(many_rounds_kernel, 64, np.zeros(64, np.int32), 3)[0]
            np.testing.assert_array_equal(out, THREE_ROUNDS_OF_64)
            assert len(taken[-1]) == 64
            assert all(os.sched_getaffinity(w.native_id) == {core} for w in taken[-1]), core
    finally:
        os.sched_setaffinity(0, allowed)
    monkeypatch.setattr(sim_blocks, "one_core", False)
    assert sim_blocks._launching_core() is None


def test_a_refused_pin_turns_pinning_off_and_the_launch_runs(monkeypatch):
    """Where the system refuses sched_setaffinity (a sandbox), the launch runs unpinned and later
    launches stop asking."""

    def refuse(pid, cores):
        raise PermissionError("not allowed here")

    monkeypatch.setattr(sim_blocks, "one_core", True)
    monkeypatch.setattr(sim_blocks, "_launching_core", lambda: 0 if sim_blocks.one_core else None)
    monkeypatch.setattr(os, "sched_setaffinity", refuse, raising=False)
    for worker in list(sim_blocks._POOL._idle):
        monkeypatch.setattr(worker, "core", None)  # so that each asks again
    out = launch(many_rounds_kernel, 64, np.zeros(64, np.int32), 3)[0]
    np.testing.assert_array_equal(out, THREE_ROUNDS_OF_64)
    assert sim_blocks.one_core is False
