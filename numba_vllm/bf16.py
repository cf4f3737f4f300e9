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
