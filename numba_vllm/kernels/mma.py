"""Tensor cores from Numba: ``mma.sync`` m16n8k16 (bf16 x bf16 -> fp32) and the moves that feed it.

Numba has no tensor-core API, but a tensor-core instruction is one line of PTX, so this module emits
it as inline PTX from small ``@intrinsic`` functions, like ``vector_load.py`` does for 16-byte loads:

- ``mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``:
  ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``. The 32 lanes of a warp *together*
  compute D (16 x 8, f32) = A (16 x 16, bf16) @ B (16 x 8, bf16) + C (16 x 8, f32); each lane holds
  a few elements of each matrix (its *fragment*) in registers, laid out as below. Every lane of the
  warp must execute it (``.sync.aligned``: same instruction, no divergence, no exited lanes).
- ``pack_bf16x2(lo, hi) -> uint32``: two float32 rounded to bf16 (to nearest even) in one 32-bit
  register, ``lo`` in the low half (``cvt.rn.bf16x2.f32``): how fp32 activations become fragments.
  ``f32_to_bf16_bits(value) -> uint16`` rounds one value the same way (a kernel storing a bf16 copy).
- ``ldmatrix_x4(array, index) -> 4 x uint32``: ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``, a
  warp-wide load of four 8 x 8 bf16 matrices from shared memory straight into fragment layout.
- ``ldmatrix_x4_trans(array, index) -> 4 x uint32``: the same with ``.trans``: each matrix arrives
  transposed, so a B operand stored k-major (rows of k, n contiguous: V in ``P @ V``) loads as
  fragments too.
- ``store_shared_u32x4(array, index, w0, w1, w2, w3)``: one 16-byte ``st.shared.v4`` (8 bf16).
- ``cp_async_16(dst, dst_index, src, src_index)`` and ``cp_async_wait_all()``: ``cp.async.cg``, a
  16-byte copy from global to shared memory that does not pass through registers (bf16 weights need
  no conversion, so they can go straight to shared memory); the copies of a thread are only
  guaranteed to have landed after its ``cp_async_wait_all()``, and other threads see them after a
  ``syncthreads`` that follows it.

Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"). With
``g = lane >> 2`` (the lane's *group*, 0..7) and ``t = lane & 3`` (its place in the group, 0..3), a
register holding two bf16 keeps the lower column (for B: the lower row, i.e. lower k) in its low half::

    A (16 x 16, row-major: A[m, k])      a0: A[g, 2t:2t+2]      a1: A[g+8, 2t:2t+2]
                                         a2: A[g, 2t+8:2t+10]   a3: A[g+8, 2t+8:2t+10]
    B (16 x 8, "col": B[k, n])           b0: B[2t:2t+2, g]      b1: B[2t+8:2t+10, g]
    C, D (16 x 8 f32)                    c0, c1: C[g, 2t], C[g, 2t+1]    c2, c3: C[g+8, 2t], C[g+8, 2t+1]

So a lane holds, of A and B, pairs of elements that are adjacent along k. For a linear layer
``x @ w.T`` that is the natural layout of both operands: A is a 16 x 16 block of ``x`` (tokens x k),
and B[k, n] = w[n, k], so b0 is two adjacent k of one *row* of ``w`` (PyTorch layout, k contiguous).

ldmatrix: lanes 8i .. 8i+7 each give the address of one 16-byte row (8 bf16) of matrix i; then lane
``l`` receives, in register i, elements ``2t, 2t+1`` of row ``g`` of matrix i. That is exactly a
fragment register when matrix i is the right 8 x 8 quarter: for A, the lanes point at rows
``lane & 15`` and k offset ``8 * (lane >> 4)`` of the 16 x 16 block and get (a0, a1, a2, a3); for B
(stored as rows of ``w``), two 8-wide n tiles come from one ``x4``. One instruction replaces four
32-bit shared loads per lane. With ``.trans`` lane ``l`` receives instead, in register i, elements
``g`` of rows ``2t`` and ``2t + 1`` of matrix i (low, high half): for a B operand stored as rows of
k (B[k, n] at row k, n contiguous), the lanes point at rows k0 .. k0 + 7 and get (b0 or b1).

Arithmetic: bf16 x bf16 products are exact in fp32 (8-bit significands); they are accumulated in
fp32. The order and internal precision of the tensor core's additions are not specified by PTX, so
results agree with any fp32 reference to a few ulps, not bit for bit.

Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the same names are Python functions. ``mma`` and
``ldmatrix`` are warp collectives, so they are built on the simulator's warp rendezvous (the one
``shfl_sync`` uses, ``sim_blocks.Block.warp_round``): every lane deposits its fragment (or its row
address), the round completes when all 32 lanes have arrived, and each lane then computes its own
result from all the lanes' deposits. The emulated mma forms A, B and C from the fragments, starts
from C and adds the exact fp32 products in k order, rounding to fp32 after each addition. A lane
that exited, or a partial warp, raises ``WarpSyncError`` (on a GPU the result would be undefined).
``cp_async_16`` copies at once and ``cp_async_wait_all`` does nothing (a copy that lands early is
one of the behaviours the GPU allows).
"""

import numpy as np
from numba import uint16, uint32

from numba_vllm.kernels.jit import device_function
from numba_vllm.sim.warp import simulator_enabled

MMA_M = 16  # rows of A, C, D
MMA_N = 8  # columns of B, C, D
MMA_K = 16  # columns of A, rows of B
WARP_LANES = 32


def _index_tuple(index):
    return index if isinstance(index, tuple) else (index,)


# Fragment coordinates of every lane, as index arrays (lane, register[, half]) -> (row, col): the
# table in the docstring, used by the simulator's mma to assemble A, B, C and pick each lane's D.
_LANE = np.arange(WARP_LANES)
_G = (_LANE >> 2)[:, None, None]  # (32, 1, 1)
_T = (_LANE & 3)[:, None, None]
_HALF = np.arange(2)[None, None, :]  # low / high half of a register: consecutive k
A_ROWS = np.broadcast_to(_G + 8 * np.array([0, 1, 0, 1])[None, :, None], (WARP_LANES, 4, 2))  # (32, 4, 2)
A_COLS = np.broadcast_to(2 * _T + 8 * np.array([0, 0, 1, 1])[None, :, None] + _HALF, (WARP_LANES, 4, 2))
B_ROWS = np.broadcast_to(2 * _T + 8 * np.array([0, 1])[None, :, None] + _HALF, (WARP_LANES, 2, 2))  # k
B_COLS = np.broadcast_to(_G, (WARP_LANES, 2, 2))  # n
C_ROWS = _G[:, :, 0] + 8 * np.array([0, 0, 1, 1])[None, :]  # (32, 4)
C_COLS = 2 * _T[:, :, 0] + np.array([0, 1, 0, 1])[None, :]


if simulator_enabled():
    import threading

    import ml_dtypes

    from numba_vllm.kernels.vector_load import load_u32x4
    from numba_vllm.sim.blocks import ABSENT, FULL_MASK, WARP_SIZE, WarpSyncError

    def _warp_round(kind, value):
        """Deposit ``value`` in a full-warp round; return (lane, the completed round)."""
        thread = threading.current_thread()
        lane = thread.thread_id % WARP_SIZE
        rnd = thread.block.warp_round(thread, kind, FULL_MASK, value)
        if rnd.arrived != FULL_MASK:
            missing = [i for i in range(WARP_SIZE) if rnd.values[i] is ABSENT]
            raise WarpSyncError(
                f"warp {rnd.warp}: {kind} needs all 32 lanes (.sync.aligned), lanes {missing} did not take "
                "part (exited or missing from a partial warp); on a GPU the result is undefined"
            )
        return lane, rnd

    def pack_bf16x2(lo, hi):
        """Two float32 rounded to bf16 (nearest even) in one uint32, ``lo`` in the low half (simulator)."""
        bits = np.array([lo, hi], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        return np.uint32(int(bits[0]) | int(bits[1]) << 16)

    def _bf16_halves(words):
        """uint32 array (..., n) -> float32 array (..., n, 2): the (low, high) bf16 of each word."""
        words = np.asarray(words, np.uint32)
        return np.stack([words << np.uint32(16), words & np.uint32(0xFFFF0000)], axis=-1).view(np.float32)

    def _warp_mma(values):
        """D fragments (32, 4) of the warp from every lane's (a0..a3, b0, b1, c0..c3)."""
        halves = _bf16_halves([v[:6] for v in values])  # (32, 6, 2)
        a = np.zeros((MMA_M, MMA_K), np.float32)
        a[A_ROWS, A_COLS] = halves[:, :4]
        b = np.zeros((MMA_K, MMA_N), np.float32)
        b[B_ROWS, B_COLS] = halves[:, 4:]
        d = np.zeros((MMA_M, MMA_N), np.float32)
        d[C_ROWS, C_COLS] = np.array([v[6:] for v in values], np.float32)
        for k in range(MMA_K):  # exact products, fp32 additions in k order
            d += a[:, k : k + 1] * b[k : k + 1, :]
        return d[C_ROWS, C_COLS]

    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """This lane's D fragment of the warp's D = A @ B + C (simulator version of mma.sync)."""
        lane, rnd = _warp_round("mma.sync", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        result = getattr(rnd, "mma_result", None)
        if result is None:  # the first lane to get here computes for the warp
            result = rnd.mma_result = _warp_mma(rnd.values)
        return tuple(np.float32(v) for v in result[lane])

    def ldmatrix_x4(array, index):
        """Four uint32 fragment registers from the rows the warp's lanes point at (simulator version)."""
        if array.dtype != np.uint32:
            raise TypeError(f"ldmatrix_x4: expected a uint32 shared array, got {array.dtype}")
        lane, rnd = _warp_round("ldmatrix", (array, _index_tuple(index)))
        words = []
        for i in range(4):  # register i: row g of matrix i, whose address lane 8i + g gave
            src_array, (*lead, col) = rnd.values[8 * i + (lane >> 2)]
            words.append(np.uint32(src_array[(*lead, col + (lane & 3))]))
        return tuple(words)

    def ldmatrix_x4_trans(array, index):
        """Four uint32 fragment registers of the transposed matrices the lanes point at (simulator version)."""
        if array.dtype != np.uint32:
            raise TypeError(f"ldmatrix_x4_trans: expected a uint32 shared array, got {array.dtype}")
        lane, rnd = _warp_round("ldmatrix.trans", (array, _index_tuple(index)))
        g, t = lane >> 2, lane & 3
        words = []
        for i in range(4):  # register i: element g of rows 2t, 2t + 1 of matrix i (lanes 8i + 2t, 8i + 2t + 1)
            halves = []
            for row in (2 * t, 2 * t + 1):
                src_array, (*lead, col) = rnd.values[8 * i + row]
                word = int(src_array[(*lead, col + (g >> 1))])
                halves.append(word >> (16 * (g & 1)) & 0xFFFF)
            words.append(np.uint32(halves[0] | halves[1] << 16))
        return tuple(words)

    def store_shared_u32x4(array, index, w0, w1, w2, w3):
        """``array[index .. index + 3] = w0 .. w3`` (simulator version)."""
        *lead, col = _index_tuple(index)
        for j, word in enumerate((w0, w1, w2, w3)):
            array[(*lead, col + j)] = word

    def cp_async_16(dst, dst_index, src, src_index):
        """16 bytes from ``src[src_index]`` on to ``dst[dst_index]`` on (simulator: copied at once)."""
        if dst.dtype != np.uint32:
            raise TypeError(f"cp_async_16: expected a uint32 shared destination, got {dst.dtype}")
        words = load_u32x4(src, src_index)
        store_shared_u32x4(dst, dst_index, *words)

    def cp_async_wait_all():
        """Wait for this thread's cp.async copies (simulator: they are already done)."""

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    from numba_vllm.kernels.vector_load import _check_array_and_index, _element_pointer

    _GLOBAL_ADDRSPACE = 1  # NVPTX address spaces
    _SHARED_ADDRSPACE = 3
    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _check_types(name, args, wanted):
        for i, (arg, kind) in enumerate(zip(args, wanted, strict=True)):
            ok = isinstance(arg, types.Integer) if kind == "int" else arg == types.float32
            if not ok:
                raise TypingError(f"{name}: argument {i} must be {'an integer' if kind == 'int' else 'float32'}, got {arg}")

    def _as_i32(context, builder, value, value_type):
        return context.cast(builder, value, value_type, types.uint32)

    def _shared_address(context, builder, array_type, array, index_type, index):
        """The 32-bit shared-memory address of ``array[index]`` (what ldmatrix and cp.async take)."""
        ptr = _element_pointer(context, builder, array_type, array, index_type, index)
        shared_ptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, _SHARED_ADDRSPACE))
        return builder.ptrtoint(shared_ptr, _I32)

    def _global_address(context, builder, array_type, array, index_type, index):
        """The 64-bit global-memory address of ``array[index]``."""
        ptr = _element_pointer(context, builder, array_type, array, index_type, index)
        global_ptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, _GLOBAL_ADDRSPACE))
        return builder.ptrtoint(global_ptr, ir.IntType(64))

    @intrinsic
    def mma_bf16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D fragment (4 x f32) of D = A @ B + C over the warp (one ``mma.sync...m16n8k16...bf16``)."""
        args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        _check_types("mma_bf16_16816", args, ["int"] * 6 + ["float"] * 4)
        sig = types.UniTuple(types.float32, 4)(*args)

        def codegen(context, builder, sig, llargs):
            regs = [_as_i32(context, builder, v, t) for v, t in zip(llargs[:6], sig.args[:6], strict=True)]
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4),
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            )
            d = builder.call(asm, regs + list(llargs[6:]))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, j) for j in range(4)])

        return sig, codegen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        """uint32 holding bf16(lo) in its low half and bf16(hi) in its high half (round to nearest even)."""
        _check_types("pack_bf16x2", (lo, hi), ["float", "float"])
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [args[1], args[0]])  # PTX puts its first source in the high half

        return sig, codegen

    def _ldmatrix_x4(name, array, index, modifier):
        """Typing and codegen of ``ldmatrix.sync.aligned.m8n8.x4{modifier}.shared.b16``."""
        _check_array_and_index(name, array, index, (types.uint32,))
        sig = types.UniTuple(types.uint32, 4)(array, index)

        def codegen(context, builder, sig, args):
            address = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            # side_effect: it reads shared memory written by other threads, so it must stay between
            # the barriers it was written between (a pure asm could be hoisted or merged).
            asm = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32]),
                f"ldmatrix.sync.aligned.m8n8.x4{modifier}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
                "=r,=r,=r,=r,r,~{memory}",
                side_effect=True,
            )
            loaded = builder.call(asm, [address])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, j) for j in range(4)])

        return sig, codegen

    @intrinsic
    def ldmatrix_x4(typingctx, array, index):
        """Four fragment registers (uint32) from the 8 x 8 bf16 matrices whose rows the lanes address."""
        return _ldmatrix_x4("ldmatrix_x4", array, index, "")

    @intrinsic
    def ldmatrix_x4_trans(typingctx, array, index):
        """Four fragment registers (uint32) of the transposes of the 8 x 8 bf16 matrices the lanes address."""
        return _ldmatrix_x4("ldmatrix_x4_trans", array, index, ".trans")

    @intrinsic
    def store_shared_u32x4(typingctx, array, index, w0, w1, w2, w3):
        """``array[index .. index + 3] = w0 .. w3`` in a uint32 shared array, as one 16-byte store."""
        _check_array_and_index("store_shared_u32x4", array, index, (types.uint32,))
        _check_types("store_shared_u32x4", (w0, w1, w2, w3), ["int"] * 4)
        sig = types.void(array, index, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            array_type, index_type = sig.args[:2]
            ptr = _element_pointer(context, builder, array_type, args[0], index_type, args[1])
            vector_type = ir.VectorType(_I32, 4)
            shared_ptr = builder.addrspacecast(ptr, ir.PointerType(_I32, _SHARED_ADDRSPACE))
            vector = ir.Constant(vector_type, ir.Undefined)
            for j, (value, value_type) in enumerate(zip(args[2:], sig.args[2:], strict=True)):
                vector = builder.insert_element(vector, _as_i32(context, builder, value, value_type), ir.Constant(_I32, j))
            builder.store(vector, builder.bitcast(shared_ptr, ir.PointerType(vector_type, _SHARED_ADDRSPACE)), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_16(typingctx, dst, dst_index, src, src_index):
        """Start copying the 16 bytes at ``src[src_index]`` (global) to ``dst[dst_index]`` (shared, uint32)."""
        _check_array_and_index("cp_async_16", dst, dst_index, (types.uint32,))
        _check_array_and_index("cp_async_16", src, src_index, (types.uint32, types.uint16))
        sig = types.void(dst, dst_index, src, src_index)

        def codegen(context, builder, sig, args):
            dst_address = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            src_address = _global_address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64)]),
                "cp.async.cg.shared.global [$0], [$1], 16;",
                "r,l,~{memory}",
                side_effect=True,
            )
            builder.call(asm, [dst_address, src_address])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait_all(typingctx):
        """Wait until this thread's ``cp_async_16`` copies have landed in shared memory."""
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen


@device_function
def f32_to_bf16_bits(value):
    """One float32 rounded to bf16 (nearest even, as ``pack_bf16x2``), as its uint16 bits: what a kernel
    stores where a bf16 copy is read (``gemm_wgmma``'s x workspace)."""
    return uint16(pack_bf16x2(value, value) & uint32(0xFFFF))
