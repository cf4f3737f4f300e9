"""Launching kernels: input checks every launcher shares, and errors that name the kernel.

Every launcher in this package checks its arguments with `check_array` before the launch (a wrong
shape, dtype or a non-contiguous view is a bug in the caller, reported in one line), then calls
`launch`, which configures the kernel at this call (the simulator aliases configured kernels, see
`jit.py`) and turns any failure of the launch into a `KernelError` naming the kernel.

Launches go to the default stream, or, inside `launching_on(stream)`, to that stream: that is how a
whole decode step is recorded into a CUDA graph (`engine/cuda_graph.py`) without any launcher
knowing about graphs.

On a GPU, a kernel's second and later launches with the same argument layout skip numba's
per-launch argument handling (`fast_launch.py`: ~25-50 us a launch down to a few).

A block whose static and dynamic shared memory together pass 48 KB needs an opt-in per kernel,
which numba has no switch for: a launch of a layout asking for more dynamic shared memory than
its launches so far compiles the kernel first and raises its
``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` to the size asked for (a kernel whose size is
fixed by its tiling does this once; one launched with growing sizes, once per new largest).

Thread-block clusters (``cluster=(x, y, z)``, ``kernels/cluster.py``) need the driver's extended
launch, which numba's launch does not make: such a kernel is compiled for its arguments first and
always launched through cuda.core. The simulator runs clusters of ``(1, 1, gridDim.z)`` blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import numpy as np

from numba_vllm.errors import KernelError
from numba_vllm.kernels import _fast_launch as fast_launch
from numba_vllm.sim.blocks import simulated_clusters
from numba_vllm.sim.warp import simulator_enabled

__all__ = ["KernelError", "check_array", "launch", "launching_on", "max_active_clusters", "num_sms"]

_stream = contextvars.ContextVar("launch_stream", default=0)  # 0: the default stream


@contextlib.contextmanager
def launching_on(stream):
    """Send every `launch` in this block (this thread) to `stream`: a numba stream or a CUDA-graph builder."""
    token = _stream.set(stream)
    try:
        yield
    finally:
        _stream.reset(token)


def launch(kernel, grid, block, *args, shared_bytes: int = 0, cluster=None) -> None:
    """Run `kernel[grid, block, stream, shared_bytes](*args)`; a failure names the kernel.

    ``cluster``: blocks per thread-block cluster, (x, y, z) dividing the grid's (in blocks)."""
    stream = _stream.get()
    try:
        if cluster is not None and not _fast_path():
            grid_z, cluster = _dim3(grid)[2], _dim3(cluster)
            if cluster != (1, 1, grid_z):
                raise ValueError(f"the simulator runs clusters of (1, 1, gridDim.z) blocks, not {cluster}")
            with simulated_clusters(grid_z):
                kernel[grid, block, stream, shared_bytes](*args)
        elif _fast_path():
            key = fast_launch.layout_key(kernel, args)
            prepared = fast_launch.lookup(key)
            if prepared is None and cluster is not None:  # compile without launching: numba cannot launch clusters
                _compiled(kernel, args, shared_bytes)
                fast_launch.prepare(key, kernel, args)
                prepared = fast_launch.lookup(key)
                if prepared is None:
                    raise ValueError("a cluster launch needs arguments that cuda.core can pass (device arrays, scalars)")
            if prepared is not None:
                if shared_bytes and shared_bytes > _dynamic_shared.get(key, 0):  # more than this layout's launches so far
                    _compiled(kernel, args, shared_bytes)
                cluster = None if cluster is None else _dim3(cluster)
                fast_launch.launch_prepared(prepared, _dim3(grid), _dim3(block), shared_bytes, stream, args, cluster)
                return
            if shared_bytes:
                _compiled(kernel, args, shared_bytes)
            kernel[grid, block, stream, shared_bytes](*args)  # compiles, if needed, and launches
            fast_launch.prepare(key, kernel, args)
        else:
            kernel[grid, block, stream, shared_bytes](*args)
    except Exception as e:  # a CUDA driver, compile or simulator error: say which kernel
        name = getattr(getattr(kernel, "py_func", None), "__name__", None) or getattr(kernel, "__name__", repr(kernel))
        raise KernelError(f"{name} (grid {grid}, block {block}): {type(e).__name__}: {e}") from e


def max_active_clusters(kernel, args, block: int, shared_bytes: int, cluster) -> int:
    """How many clusters of `kernel` (compiled for `args`) run at once on the GPU: a cluster's blocks
    must share one GPC, so this can be fewer than the SMs' room divided by the cluster's size (the
    simulator: the SMs it reports)."""
    if not _fast_path():
        return num_sms()
    key = (fast_launch.layout_key(kernel, args), block, shared_bytes, _dim3(cluster))
    count = _active_clusters.get(key)
    if count is None:
        from cuda.core import Device, LaunchConfig

        overload = _compiled(kernel, args, shared_bytes)
        config = LaunchConfig(grid=(1, 1, 1), cluster=_dim3(cluster), block=_dim3(block), shmem_size=shared_bytes)
        core_kernel = overload._codelibrary.get_cufunc().kernel
        count = _active_clusters[key] = core_kernel.occupancy.max_active_clusters(config, stream=Device().default_stream)
    return count


_active_clusters: dict = {}  # (layout, block, shared bytes, cluster) -> clusters at once


_dynamic_shared: dict = {}  # layout key -> the dynamic shared memory (bytes) its kernel's attribute allows


def _compiled(kernel, args, shared_bytes: int):
    """`kernel` compiled for `args` (numba's overload), allowed to launch with `shared_bytes` of
    dynamic shared memory: the driver attribute is raised to it if the layout's launches so far asked
    for less, never lowered (the kernel's static shared memory counts against the same 48 KB, so any
    dynamic size may need it)."""
    overload = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    key = fast_launch.layout_key(kernel, args)
    if shared_bytes > _dynamic_shared.get(key, 0):
        from numba.cuda.cudadrv.driver import binding, driver

        function = overload._codelibrary.get_cufunc()
        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)
        _dynamic_shared[key] = shared_bytes
    return overload


@functools.cache
def _fast_path() -> bool:
    """Whether launches may skip numba's argument handling (on a GPU; never in the simulator)."""
    return not simulator_enabled()


def _dim3(dims):
    """A grid or block (an int or a tuple of 1-3 ints) as the 3-tuple cuda.core takes."""
    dims = (int(dims),) if np.isscalar(dims) else tuple(int(d) for d in dims)
    return dims + (1,) * (3 - len(dims))


@functools.cache
def hopper() -> bool:
    """Whether the current GPU runs sm_90a code (compute capability 9.0: H100, H200); never in the simulator."""
    if simulator_enabled():
        return False
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability) == (9, 0)


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU, which launchers size their grids by (the
    simulator reports one; any count works there)."""
    from numba import cuda

    return getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", 1)


def check_array(name: str, a, dtype=None, shape: tuple | None = None, ndim: int | None = None) -> None:
    """Check a device (or host) array's dtype, shape (None entries are free) and C-contiguity."""
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise KernelError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if ndim is not None and len(a.shape) != ndim:
        raise KernelError(f"{name}: {len(a.shape)} dimensions {tuple(a.shape)}, expected {ndim}")
    if shape is not None:
        if len(a.shape) != len(shape) or any(e is not None and e != s for s, e in zip(a.shape, shape, strict=True)):
            want = tuple("*" if e is None else e for e in shape)
            raise KernelError(f"{name}: shape {tuple(a.shape)}, expected {want}")
    if not _c_contiguous(a):
        raise KernelError(f"{name}: must be C-contiguous")


def _c_contiguous(a) -> bool:
    flags = getattr(a, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))
