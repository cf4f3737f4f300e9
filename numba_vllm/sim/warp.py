"""Warp intrinsics for the Numba CUDA simulator, and ``install()``, which puts them in place.

The simulator (``NUMBA_ENABLE_CUDASIM=1``) runs a kernel one block at a time, every CUDA
thread of the block as a Python thread, and swaps a fake ``cuda`` module into the kernel's
globals. numba-cuda 0.30.4's fake module has no warp-level operations, and its block manager
starts fresh threads for every block and busy-polls them to detect ``syncthreads``. ``install()``
fixes both; ``import numba_vllm.kernels`` calls it when the simulator is on. The warp intrinsics
are here; the block manager that replaces the stock one (rendezvous rounds, the ``syncthreads``
barrier, deadlock detection, the worker pool) is ``sim_blocks.py``; ``break_in``, which stops one
simulated thread in pdb, is ``stepping.py``.

Warp operations (``shfl_*_sync``, ``ballot/any/all_sync``, ``syncwarp``) are rendezvous rounds of
the block (``Block.warp_round``): one round per (warp, mask), complete when every lane of the mask
that exists and has not exited has arrived. Each lane then picks its source lane by the PTX
``shfl.sync`` rules (idx: ``src & 31``; up: ``lane - d``, own value if below 0; down: ``lane + d``,
own value if above 31; xor: ``lane ^ m``, own value if above 31).

On a GPU, reading a lane that did not take part (exited, outside the mask, or missing from a
partial warp) gives an undefined value. Here it gives NaN for floats and raises
``WarpSyncError`` for integers, so "return early, then reduce" bugs show up in tests.
"""

import threading

import numpy as np

from numba_vllm.sim.blocks import ABSENT, FULL_MASK, WARP_SIZE, PooledBlockManager, WarpSyncError


def simulator_enabled():
    """True when numba.cuda runs on the simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


# Warp intrinsics, attached as methods of the simulator's FakeCUDAModule (self is unused).


def _shuffle(mask, value, source_lane):
    thread = threading.current_thread()
    lane = thread.thread_id % WARP_SIZE
    rnd = thread.block.warp_round(thread, "shfl_sync", mask, value)
    src = source_lane(lane)
    if not 0 <= src < WARP_SIZE:
        return value  # out of range: PTX returns the lane's own value
    result = rnd.values[src]
    if result is not ABSENT:
        return result
    if isinstance(value, (float, np.floating)):
        return type(value)("nan")
    raise WarpSyncError(
        f"warp {rnd.warp} lane {lane} read lane {src}, which did not take part in the shuffle "
        f"(mask {rnd.mask:#010x}); on a GPU the value is undefined"
    )


def shfl_sync(self, mask, value, src_lane):
    """``value`` of lane ``src_lane & 31``."""
    return _shuffle(mask, value, lambda lane: src_lane & 31)


def shfl_up_sync(self, mask, value, delta):
    """``value`` of lane ``lane - delta``; lanes below ``delta`` keep their own."""
    return _shuffle(mask, value, lambda lane: lane - delta)


def shfl_down_sync(self, mask, value, delta):
    """``value`` of lane ``lane + delta``; lanes above ``31 - delta`` keep their own."""
    return _shuffle(mask, value, lambda lane: lane + delta)


def shfl_xor_sync(self, mask, value, lane_mask):
    """``value`` of lane ``lane ^ lane_mask`` (a butterfly step)."""
    return _shuffle(mask, value, lambda lane: lane ^ lane_mask)


def _vote(mask, predicate):
    thread = threading.current_thread()
    return thread.block.warp_round(thread, "vote_sync", mask, bool(predicate))


def ballot_sync(self, mask, predicate):
    """Bitmask of the participating lanes whose predicate is true.

    The GPU types the result int32 (bit 31 reads as a sign); here it is the same bits as a
    non-negative int, so ``popc`` and ``&`` behave.
    """
    return _vote(mask, predicate).true_mask


def any_sync(self, mask, predicate):
    """True when the predicate is true in some participating lane."""
    return _vote(mask, predicate).true_mask != 0


def all_sync(self, mask, predicate):
    """True when the predicate is true in every participating lane."""
    rnd = _vote(mask, predicate)
    return rnd.true_mask == rnd.arrived


def syncwarp(self, mask=FULL_MASK):
    """Wait until the lanes in ``mask`` (that have not exited) arrive."""
    thread = threading.current_thread()
    thread.block.warp_round(thread, "syncwarp", mask, None)


def activemask(self):
    """Approximation: all lanes present in the calling warp (divergence is not tracked)."""
    thread = threading.current_thread()
    return thread.block.present[thread.thread_id // WARP_SIZE]


def lanemask_lt(self):
    """Bitmask of the lanes below the calling lane."""
    return (1 << threading.current_thread().thread_id % WARP_SIZE) - 1


_WARP_INTRINSICS = (
    shfl_sync,
    shfl_up_sync,
    shfl_down_sync,
    shfl_xor_sync,
    ballot_sync,
    any_sync,
    all_sync,
    syncwarp,
    activemask,
    lanemask_lt,
)

_installed = False


def install():
    """Attach the warp intrinsics and the pooled block manager to the simulator.

    Does nothing when the simulator is off, or when already installed.
    """
    global _installed
    if _installed or not simulator_enabled():
        return
    from numba.cuda.simulator import kernel, kernelapi

    for fn in _WARP_INTRINSICS:
        setattr(kernelapi.FakeCUDAModule, fn.__name__, fn)
    kernel.BlockManager = PooledBlockManager
    _installed = True
