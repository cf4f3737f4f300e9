"""Views of device arrays made once and kept while the array lives: a launcher's host time.

Why: numba builds a new array object for every ``view``, ``reshape`` or slice of a device array
(~5-15 us of Python each on the H200's host, more than the launch's own argument handling, which
the fast path brings to ~18 us). Attention and rope launchers reinterpret the same arrays at every
call (a layer's K/V cache as flat uint16 bits or as rows of slots, a workspace as the partials of a
split), and in a step that
is not replayed from a CUDA graph (prefill and mixed steps launch attention from Python, layer by
layer) those views were a third of the launch's cost: ``decode_attention_tc`` measured 67 us a
call unsplit and 146 us split (kernel and merge) on the H200's host.

``kept(array, key, make)`` returns ``make(array)``, computed on the first call for ``(array, key)``
and kept beside the array, not holding it: the entry goes when the array is garbage collected, so
a dropped engine's cache memory is freed (a device array's view holds its memory, not the array
object; a NumPy view would hold its base, and its entry would live as long as the process).
``key`` names the view (any hashable: a string, or a tuple with the shape it takes). An array id
reused by a new array after the old one died finds no stale entry: each entry checks that its
array is still the one it was made for.
"""

from __future__ import annotations

import weakref

import numpy as np

_kept: dict = {}  # (id(array), key) -> (weak reference to the array, the view)


def kept(array, key, make):
    """``make(array)``, made once per (array, ``key``) and kept while ``array`` lives."""
    entry = _kept.get((id(array), key))
    if entry is None or entry[0]() is not array:
        entry = (weakref.ref(array), make(array))
        _kept[(id(array), key)] = entry
        weakref.finalize(array, _kept.pop, (id(array), key), None)
    return entry[1]


def flat_bits(cache):
    """A bf16 cache (any shape) as its flat (size,) uint16 bits, kept (kernels that read the caches
    16 bytes at a time through their bits, at offsets they compute)."""
    return kept(cache, "flat_bits", lambda a: a.view(np.uint16).reshape(a.size))


def page_rows(cache):
    """A (num_pages, PAGE_SIZE, KVH, HD) bf16 cache as the (num_pages * PAGE_SIZE, KVH * HD) uint16
    matrix of its slots' rows, kept (what rope writes and the Hopper prefill's tensor maps describe)."""
    pages, page_size, kv_heads, head_dim = cache.shape
    return kept(cache, "page_rows", lambda a: a.view(np.uint16).reshape(pages * page_size, kv_heads * head_dim))


def leading_block(workspace, shape: tuple):
    """The first ``prod(shape)`` elements of a 1-D ``workspace`` as an array of ``shape``, kept per shape."""
    return kept(workspace, ("leading", shape), lambda a: a[: int(np.prod(shape))].reshape(*shape))
