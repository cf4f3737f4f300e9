"""Thread-block clusters (kernels/cluster.py): remote shared-memory stores, remote mbarrier arrivals,
and the cluster barrier, in a kernel small enough to read.

Every block of a cluster sends each block of its cluster (itself included) 16 bytes into slot
(its rank) of that block's shared memory and arrives on that block's mbarrier; each block waits on
its own, then writes its slots out. The reference is what each block sent, worked out by hand. In
the simulator the blocks of a cluster run at once, each with its own shared memory; the same test
runs on an H100/H200 with ``NUMBA_VLLM_TEST_GPU=1``.
"""

import numpy as np
import pytest
from numba import cuda, float32, uint32

from numba_vllm.kernels._launch import KernelError, launch
from numba_vllm.kernels.cluster import (
    cluster_address,
    cluster_sync,
    mbarrier_arrive_cluster,
    mbarrier_wait_cluster,
    store_cluster_f32x4,
)
from numba_vllm.kernels.jit import kernel
from numba_vllm.kernels.wgmma import fence_mbarrier_init, mbarrier_init, shared_address

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

SLOTS_OFFSET = 16  # bytes: the mbarrier (8), then from a 16-byte boundary one 16-byte slot per block of the cluster


@kernel
def _exchange_kernel(out):
    # out (clusters * size, 4 * size) f32: row (cluster, rank), slot z = what block z of the cluster sent it
    smem = cuda.shared.array(0, uint32)
    words = cuda.shared.array(0, float32)  # the same memory
    rank = cuda.blockIdx.z
    size = cuda.gridDim.z
    barrier = shared_address(smem, 0)
    if cuda.threadIdx.x == 0:
        mbarrier_init(barrier, size)  # one arrival from each block of the cluster
        fence_mbarrier_init()
    cluster_sync()  # every block's mbarrier is ready before anyone arrives on it
    if cuda.threadIdx.x == 0:
        for r in range(size):
            slot = cluster_address(barrier + SLOTS_OFFSET + 16 * rank, r)
            store_cluster_f32x4(slot, float32(rank), float32(cuda.blockIdx.x), float32(r), float32(1.0))
            mbarrier_arrive_cluster(cluster_address(barrier, r))
        mbarrier_wait_cluster(barrier, 0)
        row = cuda.blockIdx.x * size + rank
        for z in range(size):
            for e in range(4):
                out[row, 4 * z + e] = words[SLOTS_OFFSET // 4 + 4 * z + e]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_blocks_of_a_cluster_write_each_others_shared_memory(size):
    clusters = 3
    out = cuda.to_device(np.full((clusters * size, 4 * size), np.nan, np.float32))
    launch(_exchange_kernel, (clusters, 1, size), 32, out, shared_bytes=SLOTS_OFFSET + 16 * size, cluster=(1, 1, size))
    want = np.zeros((clusters, size, size, 4), np.float32)  # (cluster, receiving rank, sending rank z, value)
    want[..., 0] = np.arange(size)[None, None, :]  # the sender's rank
    want[..., 1] = np.arange(clusters)[:, None, None]  # its cluster
    want[..., 2] = np.arange(size)[None, :, None]  # the rank it addressed: the receiver
    want[..., 3] = 1.0
    np.testing.assert_array_equal(out.copy_to_host(), want.reshape(clusters * size, 4 * size))


def test_a_cluster_that_does_not_divide_the_grid_is_refused():
    out = cuda.to_device(np.zeros((4, 8), np.float32))
    with pytest.raises(KernelError, match="_exchange_kernel"):
        launch(_exchange_kernel, (2, 1, 2), 32, out, shared_bytes=48, cluster=(1, 2, 1))


@kernel
def _early_exit_kernel(out, spin):
    # out (clusters * size, 2) f32: column 0 written after the cluster barrier, column 1 by the warp that left
    rank = cuda.blockIdx.z
    row = cuda.blockIdx.x * cuda.gridDim.z + rank
    if cuda.threadIdx.x >= 32:  # warp 1 works a while, then returns without reaching the barrier
        acc = float32(0.0)
        for _ in range(spin):
            acc += float32(1.0)
        out[row, 1] = acc
        return
    cluster_sync()
    if cuda.threadIdx.x == 0:
        out[row, 0] = float32(1.0)


def test_the_cluster_barrier_completes_when_the_threads_it_waits_for_return(monkeypatch):
    """barrier.cluster waits for the cluster's threads that have not exited: a warp that returns while
    the others wait completes it (in the simulator its exit wakes them; a short hang timeout makes a
    missed wake-up fail here in seconds)."""
    from numba_vllm.sim import blocks as sim_blocks

    monkeypatch.setattr(sim_blocks, "hang_timeout_s", 3.0)
    clusters, size, spin = 2, 2, 3000
    out = cuda.to_device(np.full((clusters * size, 2), np.nan, np.float32))
    launch(_early_exit_kernel, (clusters, 1, size), 64, out, np.int32(spin), cluster=(1, 1, size))
    want = np.tile(np.array([1.0, spin], np.float32), (clusters * size, 1))
    np.testing.assert_array_equal(out.copy_to_host(), want)
