"""The fast launch path (kernels/fast_launch.py): arguments flattened as numba's kernel ABI wants them.

On the CPU: the layout key and the array packer, on stand-ins. On a GPU: a kernel launched through
`launch` twice per layout (numba's path, then the prepared one) on contiguous and strided arrays
with integer and float scalars, against NumPy.
"""

import types as pytypes

import numpy as np
import pytest
from numba import cuda, float32

from numba_vllm.kernels import _fast_launch as fast_launch
from numba_vllm.kernels._launch import launch
from numba_vllm.kernels.jit import kernel

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well


def fake_device_array(shape, dtype=np.float32, pointer=4096, c_contiguous=True):
    host = np.zeros(shape, dtype)
    return pytypes.SimpleNamespace(
        shape=host.shape, ndim=host.ndim, strides=host.strides, size=host.size, dtype=host.dtype,
        flags={"C_CONTIGUOUS": c_contiguous, "F_CONTIGUOUS": host.ndim < 2},
        gpu_data=pytypes.SimpleNamespace(device_pointer_value=pointer),
    )  # fmt: skip


def test_array_packs_as_numbas_kernel_abi():
    flat = []
    fast_launch._pack_array(fake_device_array((3, 5)), flat)
    assert flat == [0, 0, 15, 4, 4096, 3, 5, 20, 4]  # meminfo, parent, size, itemsize, data, shape, strides (bytes)
    flat, empty = [], fake_device_array((0, 5), pointer=None)
    fast_launch._pack_array(empty, flat)
    assert flat == [0, 0, 0, 4, 0, 0, 5, *empty.strides]  # an empty array has no pointer


def test_layout_key_tells_apart_what_changes_the_overload():
    k = object()
    same = fast_launch.layout_key(k, (fake_device_array((3, 5)), 1, np.float32(2)))
    assert same == fast_launch.layout_key(k, (fake_device_array((7, 2), pointer=8), 9, np.float32(0)))  # shapes, values
    assert same != fast_launch.layout_key(k, (fake_device_array((3, 5), c_contiguous=False), 1, np.float32(2)))
    assert same != fast_launch.layout_key(k, (fake_device_array((3, 5), np.int32), 1, np.float32(2)))
    assert same != fast_launch.layout_key(k, (fake_device_array((3,)), 1, np.float32(2)))
    assert same != fast_launch.layout_key(k, (fake_device_array((3, 5)), 1.0, np.float32(2)))


@kernel
def scale_add_kernel(x, out, scale, offset, flag):
    # x (M, N) f32, any strides; out (M, N) f32; scale f32; offset int64; flag bool
    i, j = cuda.grid(2)
    if i < x.shape[0] and j < x.shape[1]:
        value = x[i, j] * scale + float32(offset)
        out[i, j] = -value if flag else value


@pytest.mark.gpu
def test_prepared_launch_matches_numpy_on_the_gpu():
    rng = np.random.default_rng(0)
    for rows, cols, step in [(5, 7, 1), (33, 70, 1), (4, 20, 2), (9, 40, 2)]:  # each layout twice: numba, then prepared
        host = rng.standard_normal((rows, cols)).astype(np.float32)
        x = cuda.to_device(host)[:, ::step]  # step 2: a strided view ('A' layout)
        out = cuda.device_array(x.shape, np.float32)
        launch(scale_add_kernel, (-(-rows // 8), -(-x.shape[1] // 8)), (8, 8), x, out, np.float32(0.5), 3, step == 2)
        want = host[:, ::step] * np.float32(0.5) + 3
        np.testing.assert_array_equal(out.copy_to_host(), -want if step == 2 else want)
    strided = fast_launch.layout_key(scale_add_kernel, (x, out, np.float32(0.5), 3, True))
    assert fast_launch.lookup(strided) is not None  # the second strided launch took the prepared path
