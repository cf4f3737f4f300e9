"""A faster kernel launch: each kernel's argument handling worked out once, then reused.

Why: a plain numba launch, ``kernel[grid, block, stream](*args)``, costs 25-50 us of Python: numba
types every argument again (``typeof``), looks the compiled overload up, and wraps every array in a
cuda.core memory view before it flattens it. A decode step replayed from a CUDA graph pays none of
that, but an eager step (a prefill, or any step with ``--enforce-eager``) makes ~200 launches, and
that is 5-10 ms of host time per step.

How: the first launch of a kernel with a given argument *layout* (array dtype, dimensions and
contiguity; scalar Python type) goes through numba as usual, which compiles the overload if needed.
Then ``prepare`` records, for that layout, the compiled kernel (a cuda.core ``Kernel``) and one
small function per argument that appends its values in numba's kernel ABI:

- an array is ``meminfo (0), parent (0), size, itemsize, data pointer, *shape, *strides`` (strides
  in bytes), as numba's own ``_Kernel._prepare_args`` lays it out;
- an integer or float scalar is a ctypes value of the overload's type (``c_int64``, ``c_float``, ...);
  a boolean is passed as it is.

Every later launch with that layout flattens its arguments with those functions and calls
``cuda.core.launch`` directly. An argument type the table does not know (none in this package)
leaves that layout on numba's path. The simulator has no compiled kernels: there ``launch.py``
always takes numba's path.
"""

from __future__ import annotations

import ctypes

_UNSUPPORTED = object()  # a layout that stays on numba's path
_prepared: dict[tuple, object] = {}  # (kernel, argument layouts...) -> (core kernel, packers) or _UNSUPPORTED
_configs: dict[tuple, object] = {}  # (grid, block, shared bytes) -> cuda.core LaunchConfig
_default_stream: list = []  # the default stream as a cuda.core stream, made at the first launch


def layout_key(kernel, args) -> tuple:
    """What decides the compiled overload and the flattening: per argument, an array's dtype,
    dimensions and contiguity, or a scalar's Python type."""
    key = [kernel]
    for a in args:
        if getattr(a, "ndim", 0):  # an array (numpy scalars have ndim 0)
            flags = a.flags
            key.append((a.dtype, a.ndim, flags["C_CONTIGUOUS"], flags["F_CONTIGUOUS"]))
        else:
            key.append(type(a))
    return tuple(key)


def lookup(key):
    """The prepared (core kernel, packers) of a layout, or None when it must take numba's path."""
    prepared = _prepared.get(key)
    return None if prepared is None or prepared is _UNSUPPORTED else prepared


def prepare(key, kernel, args) -> None:
    """Record how to launch `kernel` with arguments of this layout (after numba launched it once)."""
    from numba.cuda import types

    try:
        overload = kernel.overloads[tuple(kernel.typeof_pyval(a) for a in args)]
        packers = [_packer(ty, types) for ty in overload.argument_types]
        core_kernel = overload._codelibrary.get_cufunc().kernel
    except (AttributeError, KeyError, TypeError):  # not a plain compiled kernel: numba's path
        _prepared[key] = _UNSUPPORTED
        return
    host_arrays = any(pack is _pack_array and not hasattr(a, "gpu_data") for pack, a in zip(packers, args, strict=True))
    _prepared[key] = _UNSUPPORTED if None in packers or host_arrays else (core_kernel, packers)


def launch_prepared(prepared, grid, block, shared_bytes: int, stream, args, cluster=None) -> None:
    """Flatten `args` with the prepared packers and launch through cuda.core (``cluster``: blocks
    per thread-block cluster, a 3-tuple dividing ``grid``, which counts blocks)."""
    from cuda.core import launch

    core_kernel, packers = prepared
    flat: list = []
    for pack, a in zip(packers, args, strict=True):
        pack(a, flat)
    launch(_core_stream(stream), _config(grid, block, shared_bytes, cluster), core_kernel, *flat)


def _packer(ty, types):
    """The function that appends one argument of numba type `ty` to the flat list; None if unknown."""
    if isinstance(ty, types.Array):
        return _pack_array
    if isinstance(ty, types.Integer):
        c_type = getattr(ctypes, f"c_{ty}")
        return lambda value, flat: flat.append(c_type(value))
    if ty == types.float32:
        return lambda value, flat: flat.append(ctypes.c_float(value))
    if ty == types.float64:
        return lambda value, flat: flat.append(ctypes.c_double(value))
    if ty == types.boolean:
        return lambda value, flat: flat.append(value)
    return None


def _pack_array(a, flat: list) -> None:
    pointer = a.gpu_data.device_pointer_value if a.size else 0
    flat.extend((0, 0, a.size, a.dtype.itemsize, pointer or 0))
    flat.extend(a.shape)
    flat.extend(a.strides)


def _config(grid, block, shared_bytes: int, cluster=None):
    key = (grid, block, shared_bytes, cluster)
    config = _configs.get(key)
    if config is None:
        from cuda.core import LaunchConfig

        if cluster is None:
            config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
        else:  # cuda.core counts a clustered grid in clusters
            clusters = tuple(g // c for g, c in zip(grid, cluster, strict=True))
            config = LaunchConfig(grid=clusters, cluster=cluster, block=block, shmem_size=shared_bytes)
        _configs[key] = config
    return config


def _core_stream(stream):
    """`stream` (0, a numba stream or a cuda.core graph builder) as the cuda.core stream numba would
    launch on; the default stream's is made once."""
    from numba.cuda.cudadrv.driver import _to_core_stream

    if stream:
        return _to_core_stream(stream)
    if not _default_stream:
        _default_stream.append(_to_core_stream(0))
    return _default_stream[0]
