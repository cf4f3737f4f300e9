"""32-bit division and remainder of non-negative indices, for kernels.

Numba types integer arithmetic at 64 bits (``int32 + int32`` is an ``int64``), and Python's ``//``
and ``%`` round towards minus infinity: ``tid // 128`` compiles to ten 64-bit instructions that
correct a truncating division for negative operands, where a shift would do. Indices (thread
ranks, rows, tokens, positions) are never negative, so the kernels divide them unsigned and at 32
bits: ``div(row, group)`` is one multiply-high and a shift for a constant ``group`` (a shift for a
power of two), and ``int32(...)`` around a sum of 32-bit values lets the compiler keep it at 32 bits.

Both take and give non-negative values below 2**31; under the simulator they are the same
arithmetic on NumPy integers.
"""

from numba import int32, uint32

from numba_vllm.kernels.jit import device_function


@device_function
def div(a, b):
    """a // b for 0 <= a, 0 < b (an int32; b a constant makes it a multiply-high or a shift)."""
    return int32(uint32(a) // uint32(b))


@device_function
def mod(a, b):
    """a % b for 0 <= a, 0 < b (an int32)."""
    return int32(uint32(a) % uint32(b))
