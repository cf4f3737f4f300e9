"""16-byte loads and 8-byte pairs in global memory, and bf16 bits to float32, for bandwidth-bound kernels.

Why: Numba turns ``a[i]`` into one load of one element. A warp reading bf16 weights two bytes per
lane moves 64 bytes per instruction, and such a kernel stays far below the memory bandwidth
(~1.1 TB/s on an H200 against ~3 TB/s with 16-byte loads). The hardware can load 16 bytes per lane
(``ld.global.nc.v4``: 512 bytes per warp instruction), but Numba never emits it from plain indexing,
so ``load_u32x4`` and ``load_f32x4`` below emit it as inline PTX. ``.nc`` reads through the
read-only (non-coherent) data cache: only for arrays that no thread of the same kernel writes.

Rules for callers:

- The 16 bytes start at ``array[index]`` and must be 16-byte aligned: the array's base address
  (device allocations are 256-byte aligned; a view may not be) plus the index's byte offset. In a
  row-major 2-D array that means the row length in bytes and the column offset are multiples of 16.
  A misaligned address faults on the GPU ("misaligned address"), and the simulator does not check.
- ``load_u32x4(a, index)``: ``a`` is a uint32 or uint16 array (1-D with an integer index, 2-D with a
  ``(row, col)`` tuple). It returns the 16 bytes as 4 uint32 words; on a uint16 array that is 8
  elements, word ``j`` holding element ``2j`` in its low half and ``2j + 1`` in its high half (the
  GPU is little-endian). bf16 weights are read through their uint16 view, 8 at a time.
- ``load_f32x4(a, index)``: ``a`` is a float32 array; returns ``a[index .. index + 3]`` (the last
  axis) as 4 float32.
- ``load_u32x4_stream(a, index)``: ``load_u32x4`` for data read once, that L1 need not keep
  (``ld.global.nc.L1::no_allocate``): decode attention's K and V rows, where it measured faster on
  some grids and slower on others (``decode_attention_tc``).

8-byte pairs: ``store_f32x2(a, index, v0, v1)`` writes ``a[index]`` and the element after it (last
axis) of a float32 array as one ``st.global.v2.f32``, and ``load_f32x2(a, index)`` reads them as one
``ld.global.v2.f32`` (a coherent load: for arrays the kernel also writes); the address must be 8-byte
aligned. A tensor-core epilogue reads and writes each thread's two adjacent accumulator columns this
way (half the instructions, and no negative-index wraparound arithmetic per element).

L2 prefetch: ``prefetch_l2(a, index)`` asks for the cache line holding ``a[index]`` to be brought into
L2 (``prefetch.global.L2``) and returns at once: no register waits for it. A kernel that will load an
address one step later issues it now, so the later load finds the line in L2 (a few hundred cycles
sooner than from memory) and more bytes are on their way per warp than its registers could hold.
Under the simulator it does nothing.

Shared memory: ``load_shared_f32x4(a, index)`` reads 4 float32 of a shared array as one 16-byte
``ld.shared.v4.f32`` (a plain load of a 4-vector in the shared address space, which the compiler
schedules like any load). The shared array must be declared with ``SHARED_ALIGN`` as its alignment
(``cuda.shared.array(shape, float32, SHARED_ALIGN)``: 16 on the GPU; None in the simulator, which
rejects any alignment argument) and the index's byte offset must be a multiple of 16.

bf16 -> float32: a bf16 value is the top half of a float32, so the conversion is a shift and a
bit-cast (``u32_as_f32``), which is exact. ``bf16x2_to_f32`` unpacks one word into the two values
it holds, ``bf16_bits_to_f32`` converts one uint16 element.

Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the same names are plain Python functions doing
the same thing element by element, so kernels call them unchanged.
"""

import numpy as np
from numba import uint32

from numba_vllm.kernels.jit import device_function
from numba_vllm.sim.warp import simulator_enabled

VECTOR_BYTES = 16  # bytes per vector load: 4 uint32 words, 8 bf16, 4 float32
BF16_PER_VECTOR = 8
F32_PER_VECTOR = 4
SHARED_ALIGN = None if simulator_enabled() else VECTOR_BYTES  # alignment of vector-read shared arrays


def _index_tuple(index):
    return index if isinstance(index, tuple) else (index,)


if simulator_enabled():

    def load_u32x4(array, index):
        """The 16 bytes at ``array[index]`` onward as 4 uint32 words (simulator version)."""
        *lead, col = _index_tuple(index)
        if array.dtype == np.uint32:
            return tuple(np.uint32(array[(*lead, col + j)]) for j in range(4))
        if array.dtype == np.uint16:
            return tuple(
                np.uint32(int(array[(*lead, col + 2 * j)]) | int(array[(*lead, col + 2 * j + 1)]) << 16)
                for j in range(4)
            )
        raise TypeError(f"load_u32x4: expected a uint32 or uint16 array, got {array.dtype}")

    load_u32x4_stream = load_u32x4

    def _f32_run(name, array, index, count):
        """``array[index .. index + count - 1]`` (along the last axis) as float32 (simulator loads)."""
        if array.dtype != np.float32:
            raise TypeError(f"{name}: expected a float32 array, got {array.dtype}")
        *lead, col = _index_tuple(index)
        return tuple(np.float32(array[(*lead, col + j)]) for j in range(count))

    def load_f32x4(array, index):
        """``array[index .. index + 3]`` (along the last axis) as 4 float32 (simulator version)."""
        return _f32_run("load_f32x4", array, index, 4)

    load_shared_f32x4 = load_f32x4

    def load_f32x2(array, index):
        """``array[index], array[index + 1]`` (along the last axis) as 2 float32 (simulator version)."""
        return _f32_run("load_f32x2", array, index, 2)

    def store_f32x2(array, index, v0, v1):
        """``array[index], array[index + 1] = v0, v1`` (along the last axis; simulator version)."""
        if array.dtype != np.float32:
            raise TypeError(f"store_f32x2: expected a float32 array, got {array.dtype}")
        *lead, col = _index_tuple(index)
        array[(*lead, col)] = v0
        array[(*lead, col + 1)] = v1

    def prefetch_l2(array, index):
        """Nothing (simulator version of the L2 prefetch hint)."""

    def u32_as_f32(bits):
        """The float32 whose bits are the low 32 bits of ``bits`` (simulator version)."""
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _GLOBAL_ADDRSPACE = 1  # NVPTX address spaces of global and shared memory
    _SHARED_ADDRSPACE = 3

    def _check_array_and_index(name, array, index, dtypes):
        if not isinstance(array, types.Array) or array.dtype not in dtypes:
            raise TypingError(f"{name}: expected an array of {', '.join(map(str, dtypes))}, got {array}")
        if isinstance(index, types.Integer):
            count = 1
        elif isinstance(index, types.BaseTuple) and all(isinstance(t, types.Integer) for t in index):
            count = len(index)
        else:
            raise TypingError(f"{name}: index must be an integer or a tuple of integers, got {index}")
        if count != array.ndim:
            raise TypingError(f"{name}: {array.ndim}-D array indexed with {count} indices")

    def _element_pointer(context, builder, array_type, array, index_type, index):
        """Address of ``array[index]`` (no wraparound, no bounds check)."""
        if isinstance(index_type, types.Integer):
            index_types, indices = [index_type], [index]
        else:
            index_types, indices = list(index_type), cgutils.unpack_tuple(builder, index, len(index_type))
        indices = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, index_types, strict=True)]
        ary = context.make_array(array_type)(context, builder, value=array)
        return cgutils.get_item_pointer(context, builder, array_type, ary, indices)

    def _vector_load(context, builder, sig, args, ptx_type, constraint, lane_type, hint=""):
        """Emit ``ld.global.nc<hint>.v4.<ptx_type>`` of the 16 bytes at the indexed element."""
        array_type, index_type = sig.args
        array, index = args
        ptr = _element_pointer(context, builder, array_type, array, index_type, index)
        result_type = ir.LiteralStructType([lane_type] * 4)
        asm = ir.InlineAsm(
            ir.FunctionType(result_type, [ptr.type]),
            f"ld.global.nc{hint}.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
            f"={constraint},={constraint},={constraint},={constraint},l",
        )
        loaded = builder.call(asm, [ptr])
        values = [builder.extract_value(loaded, j) for j in range(4)]
        return context.make_tuple(builder, sig.return_type, values)

    def _u32x4_load(name, hint):
        """The intrinsic ``name(array, index)``: the 16 bytes at ``array[index]`` onward as 4 uint32 words
        (one ``ld.global.nc<hint>.v4.u32``)."""

        def typer(typingctx, array, index):
            _check_array_and_index(name, array, index, (types.uint32, types.uint16))
            sig = types.UniTuple(types.uint32, 4)(array, index)

            def codegen(context, builder, sig, args):
                return _vector_load(context, builder, sig, args, "u32", "r", ir.IntType(32), hint)

            return sig, codegen

        typer.__name__ = typer.__qualname__ = name
        return intrinsic(typer)

    load_u32x4 = _u32x4_load("load_u32x4", "")
    load_u32x4_stream = _u32x4_load("load_u32x4_stream", ".L1::no_allocate")  # not kept in L1: data read once

    @intrinsic
    def load_f32x4(typingctx, array, index):
        """``array[index .. index + 3]`` as 4 float32 (one ``ld.global.nc.v4.f32``)."""
        _check_array_and_index("load_f32x4", array, index, (types.float32,))
        sig = types.UniTuple(types.float32, 4)(array, index)

        def codegen(context, builder, sig, args):
            return _vector_load(context, builder, sig, args, "f32", "f", ir.FloatType())

        return sig, codegen

    @intrinsic
    def load_shared_f32x4(typingctx, array, index):
        """``array[index .. index + 3]`` of a shared float32 array, as one ``ld.shared.v4.f32``."""
        _check_array_and_index("load_shared_f32x4", array, index, (types.float32,))
        sig = types.UniTuple(types.float32, 4)(array, index)

        def codegen(context, builder, sig, args):
            array_type, index_type = sig.args
            array, index = args
            ptr = _element_pointer(context, builder, array_type, array, index_type, index)
            vector_type = ir.VectorType(ir.FloatType(), 4)
            shared_ptr = builder.addrspacecast(ptr, ir.PointerType(ir.FloatType(), _SHARED_ADDRSPACE))
            vector = builder.load(builder.bitcast(shared_ptr, ir.PointerType(vector_type, _SHARED_ADDRSPACE)), align=16)
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), j)) for j in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return sig, codegen

    def _global_f32x2_pointer(context, builder, array_type, array, index_type, index):
        """``array[index]``'s address as a pointer to a 2 x float32 vector in the global address space."""
        ptr = _element_pointer(context, builder, array_type, array, index_type, index)
        global_ptr = builder.addrspacecast(ptr, ir.PointerType(ir.FloatType(), _GLOBAL_ADDRSPACE))
        return builder.bitcast(global_ptr, ir.PointerType(ir.VectorType(ir.FloatType(), 2), _GLOBAL_ADDRSPACE))

    @intrinsic
    def load_f32x2(typingctx, array, index):
        """``array[index], array[index + 1]`` of a global float32 array, as one ``ld.global.v2.f32``."""
        _check_array_and_index("load_f32x2", array, index, (types.float32,))
        sig = types.UniTuple(types.float32, 2)(array, index)

        def codegen(context, builder, sig, args):
            vector = builder.load(_global_f32x2_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=8)
            values = [builder.extract_element(vector, ir.Constant(ir.IntType(32), j)) for j in range(2)]
            return context.make_tuple(builder, sig.return_type, values)

        return sig, codegen

    @intrinsic
    def store_f32x2(typingctx, array, index, v0, v1):
        """``array[index], array[index + 1] = v0, v1`` of a global float32 array, as one ``st.global.v2.f32``."""
        _check_array_and_index("store_f32x2", array, index, (types.float32,))
        sig = types.void(array, index, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            vector = ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined)
            for j, value in enumerate(args[2:]):
                vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), j))
            builder.store(vector, _global_f32x2_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=8)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, array, index):
        """Bring the line holding ``array[index]`` into L2 (one ``prefetch.global.L2``, no result)."""
        _check_array_and_index("prefetch_l2", array, index, (types.uint32, types.uint16, types.float32))
        sig = types.void(array, index)

        def codegen(context, builder, sig, args):
            array_type, index_type = sig.args
            array, index = args
            ptr = _element_pointer(context, builder, array_type, array, index_type, index)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.global.L2 [$0];", "l",
                               side_effect=True)  # fmt: skip
            builder.call(asm, [ptr])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def u32_as_f32(typingctx, bits):
        """The float32 whose bits are the low 32 bits of the integer ``bits`` (no instruction)."""
        if not isinstance(bits, types.Integer):
            raise TypingError(f"u32_as_f32: expected an integer, got {bits}")
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            (value,) = args
            i32 = ir.IntType(32)
            if value.type.width > 32:
                value = builder.trunc(value, i32)
            elif value.type.width < 32:
                value = builder.zext(value, i32)
            return builder.bitcast(value, ir.FloatType())

        return sig, codegen


def vector_aligned(a, alignment: int = VECTOR_BYTES) -> bool:
    """Host side: True when a device (or simulator) array's data starts on an ``alignment``-byte
    boundary (16 for the vector loads, 8 for the f32 pairs)."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return interface["data"][0] % alignment == 0


@device_function
def bf16x2_to_f32(word):
    """The two bf16 values packed in a uint32 word as float32: (low half, high half)."""
    low = u32_as_f32(word << uint32(16))
    high = u32_as_f32(word & uint32(0xFFFF0000))
    return low, high


@device_function
def bf16_bits_to_f32(bits):
    """One bf16 value, given as its uint16 bits, as float32."""
    return u32_as_f32(uint32(bits) << uint32(16))
