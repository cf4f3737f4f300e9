"""Thread-block clusters from Numba: distributed shared memory and the barriers that order it.

Hopper (sm_90) groups up to 8 blocks of a launch into a *cluster*: they run at once on one GPC,
and each can read and write the others' shared memory (distributed shared memory, DSMEM) and
arrive on their mbarriers. A launch asks for it (``_launch.launch(..., cluster=(x, y, z))``: the
grid's dimensions are multiples of the cluster's); the block's rank in its cluster is its
position in the cluster's box, x fastest (with ``(1, 1, z)`` clusters and ``gridDim.z == z``, the
rank is ``blockIdx.z``). ``gemm_wgmma`` uses it to sum the parts of a K split without a round trip
through global memory. This module emits, as inline PTX from ``@intrinsic`` functions (like
``wgmma.py``):

- ``cluster_sync()``: ``barrier.cluster.arrive.release`` then ``barrier.cluster.wait.acquire``:
  every thread of every block of the cluster (``.aligned``: whole warps), e.g. after the
  mbarriers are initialised, before another block may arrive on them.
- ``cluster_address(address, rank)``: ``mapa.shared::cluster``: the address, in the cluster's
  shared window, of the same shared-memory location (``address``, from ``wgmma.shared_address``)
  in the block of rank ``rank`` (its own rank gives its own memory).
- ``store_cluster_f32x4(address, v0, v1, v2, v3)``: ``st.shared::cluster.v4.f32``, 16 bytes to a
  cluster address (16-byte aligned).
- ``mbarrier_arrive_cluster(address)``: ``mbarrier.arrive.release.cluster`` on the mbarrier at a
  cluster address: one arrival, after every earlier write of this thread (remote stores
  included) is visible to the cluster.
- ``mbarrier_arrive_remote(address)``: ``mbarrier.arrive.shared::cluster`` with the default
  release at CTA scope: one arrival on the mbarrier at a cluster address that orders nothing for
  the other block, e.g. "my reads of that stage are done" (the wgmma wait already says so). On an
  H200 the cluster-scope release above costs a memory fence that stalls the arriving warp ~0.7 us:
  paid every K step, it made a multicast GEMM 2.5-3.5x slower than without multicast.
- ``mbarrier_wait_cluster(address, parity)``: ``mbarrier.try_wait.parity.acquire.cluster`` on an
  mbarrier of this block, until the phase of that parity has completed; afterwards the writes
  that the arrivals released (from any block of the cluster) are visible.
- ``tma_load_2d_multicast(rows)``: the intrinsic ``load(smem, dst, tensor_map, src, col, row,
  barrier, cta_mask)``: ``wgmma.tma_load_2d``'s copy of a box (``rows`` x 64, the tensor map's) with
  ``.multicast::cluster``: one read of global memory lands at the same shared address ``dst`` in
  every block of the cluster whose bit is set in ``cta_mask`` (bit r: the block of rank r), each
  copy counted on the mbarrier at the same address ``barrier`` of its block. Blocks that need the
  same tile (``gemm_wgmma``: the M tiles of one N tile share w's) each copy a slice of it to all of
  them: the L2 is read once per cluster, not once per block.

Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) a cluster launch runs each cluster's blocks at
once, each with its own shared memory (``sim/blocks.py``); a cluster address is the byte offset in
the target block's dynamic shared memory with the rank in bits 24 and up, a remote store writes
that block's memory, a remote arrival counts on that block's mbarrier (``wgmma.py``'s), and
``cluster_sync`` is a rendezvous of every thread of the cluster, and a multicast copy writes each
target block's memory and counts its bytes on that block's mbarrier. A launch without a cluster is
a cluster of one block.
"""

from numba_vllm.sim.warp import simulator_enabled

RANK_SHIFT = 24  # simulator: a cluster address is (rank << RANK_SHIFT) | byte offset

if simulator_enabled():
    import functools
    import threading

    import numpy as np

    from numba_vllm.kernels.wgmma import SWIZZLE_ROW_BYTES, complete_tx, copy_box, mbarrier_arrive, mbarrier_wait
    from numba_vllm.sim.blocks import WarpSyncError

    def _target(address):
        """(block, byte offset) that a simulated cluster address names."""
        address = int(address)
        block = threading.current_thread().block
        rank = address >> RANK_SHIFT
        blocks = block.cluster_blocks()
        if rank >= len(blocks):
            raise WarpSyncError(f"cluster address {address:#x}: rank {rank} in a cluster of {len(blocks)} blocks")
        return blocks[rank], address & ((1 << RANK_SHIFT) - 1)

    def cluster_sync():
        """barrier.cluster arrive + wait: a rendezvous of every thread of the cluster (simulator)."""
        threading.current_thread().block.cluster_barrier()

    def cluster_address(address, rank):
        """mapa.shared::cluster (simulator): the rank in the high bits of the byte offset."""
        if int(address) >> RANK_SHIFT:
            raise WarpSyncError(f"cluster_address: {int(address):#x} is not an address of this block's shared memory")
        return np.uint32((int(rank) << RANK_SHIFT) | int(address))

    def store_cluster_f32x4(address, v0, v1, v2, v3):
        """st.shared::cluster.v4.f32 (simulator): 4 float32 into the target block's shared memory."""
        block, offset = _target(address)
        if offset % 16:
            raise WarpSyncError(f"store_cluster_f32x4: address {offset} is not 16-byte aligned")
        words = block.dynamic_shared().view(np.float32)
        words[offset // 4 : offset // 4 + 4] = (v0, v1, v2, v3)

    def mbarrier_arrive_cluster(address):
        """mbarrier.arrive.release.cluster (simulator): one arrival on the target block's mbarrier."""
        block, offset = _target(address)
        mbarrier_arrive(offset, block)

    mbarrier_arrive_remote = mbarrier_arrive_cluster  # (simulator: one memory, the release scope orders nothing more)

    mbarrier_wait_cluster = mbarrier_wait  # (simulator: one memory, the acquire orders nothing more)

    @functools.cache
    def tma_load_2d_multicast(rows):
        """``load(smem, dst, tensor_map, src, col, row, barrier, cta_mask)`` (simulator): the box into
        the shared memory of every block of ``cta_mask``, its bytes counted on each one's mbarrier."""

        def load(smem, dst, tensor_map, src, col, row, barrier, cta_mask):
            blocks = threading.current_thread().block.cluster_blocks()
            mask = int(cta_mask)
            if mask == 0 or mask >> len(blocks):
                raise WarpSyncError(f"tma_load_2d_multicast: mask {mask:#x} in a cluster of {len(blocks)} blocks")
            for rank, block in enumerate(blocks):
                if mask >> rank & 1:
                    copy_box(block.dynamic_shared(), dst, src, col, row, rows)
                    complete_tx(barrier, rows * SWIZZLE_ROW_BYTES, block)

        return load

else:
    import functools

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numba_vllm.kernels.wgmma import (
        TMA_CONSTRAINTS,
        TMA_OPERAND_TYPES,
        _check_ints,
        _u32,
        _u32_operands_codegen,
        _void_asm,
        tma_operands,
        tma_signature,
    )

    _I16 = ir.IntType(16)
    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    @intrinsic
    def cluster_sync(typingctx):
        """``barrier.cluster`` arrive (release) and wait (acquire): every thread of the cluster."""
        text = "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;"
        return types.void(), _u32_operands_codegen(text)

    @intrinsic
    def cluster_address(typingctx, address, rank):
        """``mapa.shared::cluster.u32``: the cluster address of shared ``address`` in block ``rank``."""
        _check_ints("cluster_address", (address, rank))
        sig = types.uint32(address, rank)

        def codegen(context, builder, sig, args):
            values = [_u32(context, builder, v, t) for v, t in zip(args, sig.args, strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32, _I32]), "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, values)

        return sig, codegen

    @intrinsic
    def store_cluster_f32x4(typingctx, address, v0, v1, v2, v3):
        """``st.shared::cluster.v4.f32``: 4 float32 to the cluster address ``address`` (16-byte aligned)."""
        _check_ints("store_cluster_f32x4", (address,))
        sig = types.void(address, types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            operands = [_u32(context, builder, args[0], sig.args[0])] + list(args[1:])
            _void_asm(builder, "st.shared::cluster.v4.f32 [$0], {$1, $2, $3, $4};", [_I32] + [_F32] * 4, operands,
                      "r,f,f,f,f")  # fmt: skip
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def mbarrier_arrive_cluster(typingctx, address):
        """``mbarrier.arrive.release.cluster``: one arrival on the mbarrier at a cluster address."""
        _check_ints("mbarrier_arrive_cluster", (address,))
        text = "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];"
        return types.void(address), _u32_operands_codegen(text)

    @intrinsic
    def mbarrier_arrive_remote(typingctx, address):
        """``mbarrier.arrive.shared::cluster`` (release at CTA scope): one arrival on the mbarrier at a
        cluster address, without the cluster-scope fence."""
        _check_ints("mbarrier_arrive_remote", (address,))
        text = "mbarrier.arrive.shared::cluster.b64 _, [$0];"
        return types.void(address), _u32_operands_codegen(text)

    @intrinsic
    def mbarrier_wait_cluster(typingctx, barrier, parity):
        """Wait, with acquire at cluster scope, until the phase of parity ``parity`` of this block's
        mbarrier at ``barrier`` has completed."""
        _check_ints("mbarrier_wait_cluster", (barrier, parity))
        text = (
            "{\n.reg .pred p;\nWAIT_CLUSTER:\n"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1;\n@!p bra WAIT_CLUSTER;\n}"
        )
        return types.void(barrier, parity), _u32_operands_codegen(text)

    @functools.cache
    def tma_load_2d_multicast(rows):
        """The intrinsic ``load(smem, dst, tensor_map, src, col, row, barrier, cta_mask)``: one 2-D TMA
        copy of a box (rows x 64, the tensor map's) to shared address ``dst`` of every block of the
        cluster in ``cta_mask``, completed on the mbarrier at ``barrier`` of each."""

        @intrinsic
        def load(typingctx, smem, dst, tensor_map, src, col, row, barrier, cta_mask):
            sig = tma_signature("tma_load_2d_multicast", smem, dst, tensor_map, src, col, row, barrier, cta_mask)

            def codegen(context, builder, sig, args):
                mask = builder.trunc(_u32(context, builder, args[7], sig.args[7]), _I16)  # (a 16-bit operand)
                _void_asm(
                    builder,
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
                    "[$0], [$1, {$2, $3}], [$4], $5;",
                    (*TMA_OPERAND_TYPES, _I16),
                    [*tma_operands(context, builder, sig, args), mask],
                    TMA_CONSTRAINTS + ",h",
                )
                return context.get_dummy_value()

            return sig, codegen

        return load
