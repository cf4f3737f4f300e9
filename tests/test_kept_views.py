"""``kernels/kept_views.py``: a view is made once per (array, key), is the right view, and goes with its array."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from numba import cuda

from numba_vllm.kernels import kept_views
from numba_vllm.kernels.kept_views import flat_bits, kept, leading_block
from numba_vllm.loading.bf16 import BF16, upload_bf16

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well


def test_made_once_per_array_and_key():
    made = []
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    first = kept(a, "k", lambda x: made.append(x) or x[:4])
    assert kept(a, "k", lambda x: made.append(x) or x[:4]) is first
    assert kept(a, "other", lambda x: made.append(x) or x[:2]) is not first
    kept(b, "k", lambda x: made.append(x) or x[:4])
    assert [id(x) for x in made] == [id(a), id(a), id(b)]


def test_entry_goes_with_its_array():
    """A device array's view does not hold the array object (only its memory), so the entry goes when
    the array is collected: a dropped engine's caches are freed."""
    cache = upload_bf16(np.zeros((2, 16, 3), np.float32))
    flat_bits(cache)
    key, alive = (id(cache), "flat_bits"), weakref.ref(cache)
    assert key in kept_views._kept
    del cache
    gc.collect()
    assert alive() is None and key not in kept_views._kept


def test_a_new_array_at_a_reused_id_gets_its_own_view():
    a, stranger = np.zeros(8, np.float32), np.ones(8, np.float32)
    kept_views._kept[(id(a), "k")] = (weakref.ref(stranger), stranger[:4])  # as if stranger had lived at a's id
    assert (kept(a, "k", lambda x: x[:4]) == 0).all()


def test_flat_bits_and_leading_block_on_device_arrays():
    """Device arrays: the cache's bits flattened, the workspace's first elements shaped; both share
    their array's memory."""
    cache = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3).astype(BF16)
    d_cache = upload_bf16(cache)
    bits = flat_bits(d_cache)
    assert bits.shape == (cache.size,) and bits.dtype == np.uint16
    np.testing.assert_array_equal(bits.copy_to_host(), cache.view(np.uint16).reshape(-1))
    assert flat_bits(d_cache) is bits
    workspace = cuda.to_device(np.arange(100, dtype=np.float32))
    block = leading_block(workspace, (3, 2, 5))
    np.testing.assert_array_equal(block.copy_to_host(), np.arange(30, dtype=np.float32).reshape(3, 2, 5))
    block[0, 0, 0] = -1.0
    assert workspace.copy_to_host()[0] == -1.0
    assert leading_block(workspace, (3, 2, 5)) is block and leading_block(workspace, (30,)) is not block
