"""bfloat16 on the host: the one place that knows how bf16 is stored and converted.

A bf16 number is the top 16 bits of a float32 (1 sign, 8 exponent, 7 mantissa bits). NumPy has no
bf16 type; `ml_dtypes.bfloat16` gives one, and arrays of it convert to and from float32 with
`astype` (float32 -> bf16 rounds to nearest even). On disk (safetensors "BF16") and on the wire to the
GPU the same bytes are seen as uint16, because buffers of ml_dtypes' type cannot be handed to
`cuda.to_device` directly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round any float array to bf16 (nearest even), same shape."""
    return np.asarray(x).astype(BF16)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The raw uint16 view of a bf16 array (no copy): what is written to disk or uploaded."""
    if x.dtype != BF16:
        raise TypeError(f"expected a bfloat16 array, got {x.dtype}")
    return x.view(np.uint16)


def bf16_from_bits(bits: np.ndarray) -> np.ndarray:
    """The bf16 view of raw uint16 bits (no copy)."""
    return bits.view(BF16)


def upload_bf16(x: np.ndarray):
    """Copy a bf16 (or any float, rounded) host array to the GPU as a bf16 device array.

    `cuda.to_device` cannot take ml_dtypes' type directly, so the raw uint16 bits travel and the
    device array is viewed back as bf16; kernels read elements with `float32(w[i])` (exact).
    """
    from numba import cuda

    bits = np.ascontiguousarray(bf16_bits(x if x.dtype == BF16 else to_bf16(x)))
    return cuda.to_device(bits).view(BF16)


def empty_bf16_device(shape):
    """An uninitialised bf16 device array (e.g. a KV cache pool)."""
    from numba import cuda

    return cuda.device_array(shape, np.uint16).view(BF16)
