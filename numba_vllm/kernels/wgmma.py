"""Hopper tensor cores from Numba: ``wgmma.mma_async`` (bf16 x bf16 -> fp32) and the copies that feed it.

``mma.py`` drives the tensor cores one warp at a time (``mma.sync``, 16 x 8 x 16 per instruction,
operands in registers). Hopper (sm_90a) adds a wider, asynchronous instruction: a *warpgroup* (4
consecutive warps, 128 threads, starting at a thread index divisible by 128) computes D (64 x N, f32)
+= A (64 x 16, bf16) @ B (16 x N, bf16) in one ``wgmma.mma_async``, N up to 256, with A and B read
straight from shared memory through 64-bit *matrix descriptors*. This module emits it, and what goes
with it, as inline PTX from ``@intrinsic`` functions, like ``mma.py``:

- ``wgmma_bf16(n)``: the intrinsic ``mma(acc, smem, desc_a, desc_b)`` for
  ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16``. ``acc`` is the thread's ``n / 2``
  accumulators, a ``cuda.local.array`` of float32 that the intrinsic reads and writes whole (its
  elements are loaded and stored at constant indices around the instruction, so the compiler keeps
  them in registers: index it elsewhere only with constants too). ``smem`` is the shared array the
  descriptors point into (unused on the GPU; the simulator reads the operands from it).
- ``wgmma_fence(n)``, ``wgmma_wait(n, pending)``: ``wgmma.fence`` (before the first wgmma, and after
  anything else wrote the accumulators) and ``wgmma.wait_group pending`` (until at most ``pending``
  committed groups of this warpgroup's wgmma are in flight); both take ``acc`` as operands that they
  "modify", so the compiler orders every other access to the accumulators around them.
  ``wgmma_commit()``: ``wgmma.commit_group``, closes the group of wgmma issued since the last one.
- ``smem_descriptor(address)``: the descriptor of a K-major operand tile at a shared address, laid
  out with the 128-byte swizzle (below). Advance it by ``DESC_K_STEP`` per 16 values of k.
- ``wgmma_bf16_rs(n, trans_b)``: the intrinsic ``mma(acc, a0, a1, a2, a3, smem, desc_b)``, the same
  product with A from registers (the RS form: four bf16 pairs a thread, the layout of the
  accumulators below, so an fp32 result rounded pair by pair is the next product's A, as in
  attention's ``P V``) and, with ``trans_b``, B MN-major: ``smem_descriptor_mn(address,
  leading_bytes)`` (below), advanced by ``DESC_MN_K_STEP`` per 16 values of k.
  ``wgmma_fence_operands(n, words)``: ``fence(acc, a_words)``, the fence that also orders the writes
  of A's registers (a uint32 local array) before the wgmma that read them;
  ``wgmma_wait_operands(n, words, pending)``: ``wait(acc, a_words)``, the wait after which they may be
  written again (a wgmma reads its A registers asynchronously too).
- ``shared_address(array, index)``: the 32-bit shared-window address of ``array[index]``.
- ``tensor_map_2d(bits, rows, box_rows)`` (host): the cached tensor map ``tma_load_2d`` reads.
- ``tma_load_2d(rows)``: the intrinsic ``load(smem, dst, tensor_map, src, col, row, barrier)``: one
  ``cp.async.bulk.tensor.2d`` (the Tensor Memory Accelerator, TMA) copying the box of ``rows`` rows
  x 64 columns from ``row, col`` of the 2-D uint16 matrix ``src`` described by ``tensor_map`` (a
  CUtensorMap in global memory, made on the host with the 128-byte swizzle: the box lands in the
  layout above) to the shared address ``dst``, zeros where the box leaves the matrix. One thread
  issues it; its completion is counted on the mbarrier at ``barrier`` (``rows * 128`` bytes).
  ``src`` is what the tensor map describes (unused on the GPU; the simulator copies from it).
- mbarriers (64-bit barrier objects in shared memory, at shared addresses): ``mbarrier_init(barrier,
  count)`` (by one thread, then ``fence_mbarrier_init()`` and a ``syncthreads``),
  ``mbarrier_arrive(barrier)``, ``mbarrier_arrive_expect_tx(barrier, bytes)`` (arrive and expect
  ``bytes`` of TMA copies), ``mbarrier_wait(barrier, parity)`` (until the phase of that parity has
  completed). A phase completes when ``count`` arrivals and all expected bytes have come; phases
  alternate parity 0, 1, 0, ...
- ``set_max_registers(count, increase)``: the intrinsic ``f()``, ``setmaxnreg``: the calling
  warpgroup's registers per thread raised or lowered to ``count``. A block's register file is shared
  in quarters of warps (9 warps count as 12), so a block of three warpgroups gets 168 a thread; a
  producer warpgroup that lowers itself to 24 lets two consumer warpgroups raise themselves to 240.
- ``named_barrier(index, threads)``: ``bar.sync index, threads``: wait until ``threads`` threads
  (whole warps, any of the block's) have arrived on hardware barrier ``index`` (1-15; ``syncthreads``
  is barrier 0); ``named_barrier_arrive(index, threads)``: ``bar.arrive``, arrive without waiting (a
  signal from one group of warps to another that waits with ``named_barrier``).
- ``tensormap_prefetch(tensor_map)``: ``prefetch.tensormap`` of the 128 bytes of a tensor map in
  global memory: the TMA unit starts fetching the descriptor now, so a kernel issues it first thing
  (while its barriers are set up), not when its first copy needs it. The maps are written once by
  the host before any kernel reads them and never rewritten (``tensor_map_2d``), so no proxy fence
  (``fence.proxy.tensormap``, for maps written by device code) is needed before the copies.
- ``fence_proxy_async()``: ``fence.proxy.async.shared::cta``. The tensor cores read shared memory
  through the *async proxy*; data written through the generic proxy (``st.shared``, ``cp.async``)
  must be fenced by each writing thread before the barrier after which a wgmma reads it (TMA copies
  are async-proxy writes: their mbarrier is enough).

Shared-memory layout of an operand (PTX ISA, "Shared Memory Matrix Layout", K-major, 128-byte
swizzle). A tile of R rows (M rows of A = x, or N rows of B = w, since B[k, n] = w[n, k]) by 64
values of k (bf16) is stored one 128-byte row per matrix row, rows consecutive; groups of 8 rows
form 1024-byte *atoms*, which must start on a 1024-byte boundary. Within an atom the 16-byte chunk
``c`` (values 8c .. 8c + 7 of k) of row ``r`` is stored at chunk position ``c ^ (r % 8)``. The
hardware applies that XOR to the address bits itself (bits 4-6 ^= bits 7-9 of the byte address),
which is why the alignment matters. Descriptor fields: start address >> 4 (bits 0-13), leading
byte offset >> 4 (bits 16-29; unused by this layout, set to 1), stride byte offset >> 4 (bits
32-45: 1024, from one 8-row atom to the next), base offset 0 (bits 49-51), swizzle mode 1 =
128-byte (bits 62-63). One wgmma consumes 16 values of k, 32 bytes of each row: the k-th step's
descriptor starts ``32 k`` bytes into the tile (the swizzle is applied to the sum).

MN-major B (``trans_b``; B[k, n] stored n-contiguous, as attention's V is: a row per key k holding
its head dims n): the same 128-byte rows and 1024-byte atoms with the roles swapped, a row per value
of k holding 64 values of n, chunk ``c`` of row ``k`` at chunk position ``c ^ (k % 8)``. The stride
byte offset goes from one 8-row group of k to the next (1024 for rows stored consecutively), the
leading byte offset from one 64-wide panel of n to the next (for N > 64). One wgmma reads 16 rows:
the k-th step's descriptor starts ``16 * 128 k`` bytes in. Rows staged for the K-major layout (K of
attention: a row per key, its dims contiguous) read this way are MN-major: K and V are staged alike.

Accumulator layout (PTX ISA, "Matrix Fragments for wgmma .m64nNk16"). Thread ``t`` of the
warpgroup, in warp ``w = t // 32`` with ``g = (t % 32) >> 2`` and ``q = t & 3``, holds for each
8-column block ``j``: ``acc[4j + 2h + e] = D[16w + 8h + g, 8j + 2q + e]`` (h, e in 0, 1): the
mma.sync layout of ``mma.py``, warp ``w`` owning rows 16w .. 16w + 15.

Asynchrony: a wgmma returns before it has read its operands or written ``acc``. Until a
``wgmma_wait`` covers its group, the shared memory it reads must not be overwritten and ``acc``
must not be touched (another wgmma on the same accumulators may follow at once: they run in
order). ``ptxas`` checks the accumulator rule and serialises every wgmma of the kernel (info
C7515, "wgmma.mma_async instructions are serialized", and a ``WARPGROUP.DEPBAR`` after each
``HGMMA`` in the SASS: 2-3x slower) when code between issue and wait may write them; seen here
when a path reached the final wait from the accumulators' zeroing with no wgmma (a loop that
could run zero times), fixed by a loop that runs at least once. The tests assemble every tiling
and fail on C7515.

Compiling: wgmma needs the architecture-specific target sm_90a. numba-cuda 0.30.4 compiles every
kernel for ``compute_90a`` on a device of compute capability 9.0 (``CUDACodeLibrary._ensure_cc``
adds the ``a`` from 9.0 on); ``cuda.compile_ptx(..., cc=(9, 0, "a"))`` does the same without a GPU.
Plain ``cc=(9, 0)`` gives the same PTX text with ``.target sm_90``, which ptxas rejects for wgmma
(the tests compile that way, as ``tests/ptx_check.py`` does, and assemble with ``.target sm_90a``).

Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the same names are Python functions. The wgmma is
a rendezvous of the 128 threads of the warpgroup (``Block.group_round``); the thread that finds it
complete decodes both descriptors exactly as described above (start address, stride byte offset,
the swizzle on the byte address), reads A and B from ``smem``, gathers C from all 128
accumulator arrays, adds the exact fp32 products in k order (rounding to fp32 after each addition)
and writes D back into every thread's ``acc``. With A from registers (``wgmma_bf16_rs``) it gathers A from the
128 threads' words by the same fragment table. A descriptor without the 128-byte swizzle
raises, and so do descriptors that differ between the threads of the warpgroup (they must be
uniform). Shared addresses are byte offsets into the array (the simulator has no shared window;
offset 0 is 1024-byte aligned), and fences and waits do nothing. A TMA load copies the box from
``src`` at once (zeros outside it) into the swizzled layout and completes its bytes on the barrier;
mbarriers are Python objects of the block, keyed by address, and a thread that waits on one polls
it (``SimulatorDeadlockError`` after ``NUMBA_VLLM_SIM_HANG_TIMEOUT`` with no arrival, times the
blocks of its cluster); a named barrier is a
rendezvous of the ``threads`` consecutive threads, from a multiple of ``threads``, that hold the
caller (on the GPU any ``threads`` threads may meet at one: the kernels here use it only so).
"""

import functools

import numpy as np
from numba import cuda, int64

from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.jit import device_function
from numba_vllm.sim.warp import simulator_enabled

WARPGROUP_THREADS = 128
WGMMA_M = 64  # rows of A and D per warpgroup
WGMMA_K = 16  # k per instruction
SWIZZLE_ROW_BYTES = 128  # one staged row: 64 bf16 values of k
ATOM_ROWS = 8  # rows per 1024-byte swizzle atom
ATOM_BYTES = SWIZZLE_ROW_BYTES * ATOM_ROWS  # alignment of a staged tile
TILE_K = SWIZZLE_ROW_BYTES // 2  # values of k per staged row
DESC_K_STEP = WGMMA_K * 2 >> 4  # descriptor start-address units (16 bytes) per wgmma k-step
DESC_MN_K_STEP = WGMMA_K * SWIZZLE_ROW_BYTES >> 4  # the same for an MN-major operand: 16 rows of 128 bytes
# The fixed fields of a descriptor: leading byte offset 16 (encoded 1), stride byte offset 1024, 128-byte swizzle.
_DESC_FIXED = (1 << 16) | ((ATOM_BYTES >> 4) << 32) | (1 << 62)
_ADDRESS_MASK = 0x3FFFF  # the descriptor holds bits 4..17 of the address


@device_function
def smem_descriptor(address):
    """The wgmma descriptor (int64) of a K-major, 128-byte-swizzled operand tile at shared ``address``."""
    return int64(_DESC_FIXED) | int64((address & _ADDRESS_MASK) >> 4)


@device_function
def smem_descriptor_mn(address, leading_bytes):
    """The wgmma descriptor (int64) of an MN-major, 128-byte-swizzled B operand at shared ``address``:
    rows of 64 values of n, one row per k, 8-row (1024-byte) atoms k-consecutive; ``leading_bytes``
    from one 64-column panel of n to the next (used when N > 64). Advance it by ``DESC_MN_K_STEP``
    per 16 values of k."""
    return (int64(_DESC_FIXED & ~(0x3FFF << 16)) | int64(((leading_bytes >> 4) & 0x3FFF) << 16)
            | int64((address & _ADDRESS_MASK) >> 4))


_tensor_maps: dict = {}  # (address, rows, columns, box rows) -> (16,) uint64 device array; never freed


def tensor_map_2d(bits, rows: int, box_rows: int):
    """The CUtensorMap (a (16,) uint64 device array) of the (rows, columns) uint16 matrix at
    ``bits``' address: boxes of ``box_rows`` x 64 with the 128-byte swizzle (``tma_load_2d``'s
    layout), zeros outside the matrix.

    Made once per matrix and box and kept: the TMA unit caches tensor maps by address, so a map's
    memory is never rewritten or freed (one per weight matrix and tiling, a few for x, two for a KV
    cache). In the simulator the map is a placeholder; the simulated copy reads the matrix itself.
    """
    columns = bits.shape[1]
    address = (getattr(bits, "__cuda_array_interface__", None) or bits.__array_interface__)["data"][0]
    key = (address, rows, columns, box_rows)
    tensor_map = _tensor_maps.get(key)
    if tensor_map is None:
        words = np.zeros(16, np.uint64)
        if not simulator_enabled():
            from cuda.bindings import driver as cu

            u64, u32 = cu.cuuint64_t, cu.cuuint32_t
            err, encoded = cu.cuTensorMapEncodeTiled(
                cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
                2,
                address,
                [u64(columns), u64(rows)],  # innermost first
                [u64(columns * 2)],  # row stride in bytes
                [u32(TILE_K), u32(box_rows)],
                [u32(1), u32(1)],
                cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            if err != cu.CUresult.CUDA_SUCCESS:
                raise KernelError(f"cuTensorMapEncodeTiled({rows} x {columns}, box {box_rows}): {err}")
            words[:] = encoded.opaque
        tensor_map = _tensor_maps[key] = cuda.to_device(words)
    return tensor_map


def _wgmma_instruction(n):
    return f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"


if simulator_enabled():
    import threading

    import ml_dtypes

    from numba_vllm.sim.blocks import ABSENT, WarpSyncError, wait_on_cluster

    _RESULT_LOCK = threading.Lock()  # the first thread out of a round computes it, the others wait

    def _warpgroup_round(kind, value):
        """Deposit ``value`` in the calling warpgroup's round; return (thread's place 0..127, round)."""
        thread = threading.current_thread()
        first = thread.thread_id // WARPGROUP_THREADS * WARPGROUP_THREADS
        rnd = thread.block.group_round(thread, kind, first, WARPGROUP_THREADS, value)
        missing = [first + i for i, v in enumerate(rnd.values) if v is ABSENT]
        if missing:
            raise WarpSyncError(
                f"{kind} needs all 128 threads of the warpgroup (.sync.aligned), threads {missing} did not "
                "take part (exited or missing); on a GPU the result is undefined"
            )
        return thread.thread_id - first, rnd

    def _uniform(values, name):
        first = values[0]
        if any(v != first for v in values):
            raise WarpSyncError(f"wgmma: {name} differs between the threads of the warpgroup (it must be uniform)")
        return int(first)

    def _operand(smem, desc, rows, mn_major=False):
        """float32 (rows, 16): the operand a descriptor points at, read as the hardware does (rows: M of
        A or N of B). K-major: row r, value k at (r // 8) * SBO + (r % 8) * 128 + 2 k. MN-major (B
        transposed): value k of row r at (k // 8) * SBO + (k % 8) * 128 + (r // 64) * LBO + 2 (r % 64)."""
        start = (desc & 0x3FFF) << 4
        leading = ((desc >> 16) & 0x3FFF) << 4
        stride = ((desc >> 32) & 0x3FFF) << 4
        if desc >> 62 != 1 or (desc >> 49) & 7:
            raise NotImplementedError("the simulated wgmma reads only operands with the 128-byte swizzle")
        r = np.arange(rows)[:, None]
        k = np.arange(WGMMA_K)[None, :]
        if mn_major:
            address = start + (k // ATOM_ROWS) * stride + (k % ATOM_ROWS) * SWIZZLE_ROW_BYTES + (r // TILE_K) * leading
            address = address + 2 * (r % TILE_K)
        else:
            address = start + (r // ATOM_ROWS) * stride + (r % ATOM_ROWS) * SWIZZLE_ROW_BYTES + 2 * k
        bits = smem.view(np.uint8).view(np.uint16)[_swizzled(address) // 2]
        return bits.view(ml_dtypes.bfloat16).astype(np.float32)

    def _register_operand(values):
        """float32 (64, 16): A from the warpgroup's registers (values: 128 arrays of 4 uint32, bf16
        pairs): thread t (warp w, g = (t % 32) >> 2, q = t & 3) holds rows 16w + g (words 0, 2) and
        16w + g + 8 (words 1, 3), values 2q, 2q + 1 (words 0, 1) and 8 + 2q, 9 + 2q (words 2, 3)."""
        a = np.zeros((WGMMA_M, WGMMA_K), np.float32)
        for t, words in enumerate(values):
            row = 16 * (t // 32) + ((t % 32) >> 2)
            col = 2 * (t & 3)
            for word, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                w = int(words[word])
                pair = np.array([w & 0xFFFF, w >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
                a[row + dr, col + dc : col + dc + 2] = pair
        return a

    # Accumulator coordinates: thread t (0..127), register i -> D row and column (the docstring's table).
    def _acc_coordinates(n):
        t = np.arange(WARPGROUP_THREADS)[:, None]
        i = np.arange(n // 2)[None, :]
        rows = 16 * (t // 32) + 8 * ((i >> 1) & 1) + ((t % 32) >> 2)
        cols = 8 * (i >> 2) + 2 * (t & 3) + (i & 1)
        return rows, cols  # (128, n / 2) each

    def _warpgroup_mma(values, n, registers_a=False, trans_b=False):
        """Write D = A @ B + C into every thread's accumulator array (values: the 128 deposits, each
        (acc, smem, desc_a, desc_b), or (acc, smem, a_words, desc_b) with A from registers)."""
        smem = values[0][1]
        address = smem.__array_interface__["data"][0]  # each thread has its own view of the block's memory
        if any(v[1].__array_interface__["data"][0] != address for v in values):
            raise WarpSyncError("wgmma: the threads of the warpgroup passed different shared arrays")
        if registers_a:
            a = _register_operand([v[2] for v in values])
        else:
            a = _operand(smem, _uniform([v[2] for v in values], "desc_a"), WGMMA_M)  # (64, 16)
        b = _operand(smem, _uniform([v[3] for v in values], "desc_b"), n, trans_b).T  # (16, n)
        rows, cols = _acc_coordinates(n)
        d = np.zeros((WGMMA_M, n), np.float32)
        d[rows, cols] = np.stack([np.asarray(v[0][: n // 2], np.float32) for v in values])
        for k in range(WGMMA_K):  # exact products, fp32 additions in k order
            d += a[:, k : k + 1] * b[k : k + 1, :]
        for t, v in enumerate(values):
            v[0][: n // 2] = d[rows[t], cols[t]]

    @functools.cache
    def wgmma_bf16(n):
        """``mma(acc, smem, desc_a, desc_b)``: acc[:n/2] += this thread's part of A @ B (simulator)."""

        def mma(acc, smem, desc_a, desc_b):
            _, rnd = _warpgroup_round(f"wgmma m64n{n}k16", (acc, smem, desc_a, desc_b))
            with _RESULT_LOCK:
                if not getattr(rnd, "wgmma_done", False):
                    _warpgroup_mma(rnd.values, n)
                    rnd.wgmma_done = True

        return mma

    @functools.cache
    def wgmma_bf16_rs(n, trans_b):
        """``mma(acc, a0, a1, a2, a3, smem, desc_b)``: acc[:n/2] += this thread's part of A @ B, A from
        the warpgroup's registers (simulator)."""

        def mma(acc, a0, a1, a2, a3, smem, desc_b):
            words = (int(a0), int(a1), int(a2), int(a3))
            _, rnd = _warpgroup_round(f"wgmma m64n{n}k16 (A in registers)", (acc, smem, words, desc_b))
            with _RESULT_LOCK:
                if not getattr(rnd, "wgmma_done", False):
                    _warpgroup_mma(rnd.values, n, registers_a=True, trans_b=trans_b)
                    rnd.wgmma_done = True

        return mma

    @functools.cache
    def wgmma_fence(n):
        """wgmma.fence (simulator: the wgmma is synchronous, nothing to order)."""
        return lambda acc: None

    @functools.cache
    def wgmma_fence_operands(n, words):
        """wgmma.fence ordering acc and A's registers (simulator: nothing to order)."""
        return lambda acc, a_words: None

    @functools.cache
    def wgmma_wait_operands(n, words, pending):
        """wgmma.wait_group ordering acc and A's registers (simulator: every wgmma has completed)."""
        return lambda acc, a_words: None

    @functools.cache
    def wgmma_wait(n, pending):
        """wgmma.wait_group (simulator: every wgmma has completed)."""
        return lambda acc: None

    def wgmma_commit():
        """wgmma.commit_group (simulator: nothing in flight)."""

    def fence_proxy_async():
        """fence.proxy.async.shared::cta (simulator: one memory, no proxies)."""

    def shared_address(array, index):
        """Byte offset of ``array[index]`` in the array (simulator: offset 0 stands for an aligned address)."""
        return np.uint32(np.ravel_multi_index(index if isinstance(index, tuple) else (index,), array.shape) * array.itemsize)

    def _swizzled(address):
        """Where the 128-byte swizzle puts byte ``address`` (bits 4-6 ^= bits 7-9)."""
        return address ^ (((address >> 7) & 7) << 4)

    _BARRIER_LOCK = threading.Lock()  # guards every simulated mbarrier and named barrier

    class _MBarrier:
        """An mbarrier: arrivals still expected in this phase, bytes still expected, phases completed;
        ``completed`` (on ``_BARRIER_LOCK``) wakes its waiters when a phase completes."""

        def __init__(self, count):
            self.count = count
            self.pending = count
            self.tx = 0
            self.phase = 0
            self.completed = threading.Condition(_BARRIER_LOCK)

        def update(self, arrivals, tx):
            """Count arrivals and bytes (``_BARRIER_LOCK`` held)."""
            self.pending -= arrivals
            self.tx += tx
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count
                self.completed.notify_all()

    def _mbarrier(address, block=None):
        """The mbarrier at shared ``address`` of ``block`` (default: the calling thread's)."""
        block = block or threading.current_thread().block
        with _BARRIER_LOCK:
            barriers = block.__dict__.setdefault("mbarriers", {})
            if int(address) not in barriers:
                raise WarpSyncError(f"mbarrier at shared address {int(address)} used before mbarrier_init")
            return barriers[int(address)]

    def mbarrier_init(address, count):
        """mbarrier.init (simulator)."""
        block = threading.current_thread().block
        with _BARRIER_LOCK:
            block.__dict__.setdefault("mbarriers", {})[int(address)] = _MBarrier(int(count))

    def fence_mbarrier_init():
        """fence.mbarrier_init (simulator: nothing to order)."""

    def mbarrier_arrive(address, block=None):
        """mbarrier.arrive (simulator); ``block``: another block's mbarrier (``cluster.py``'s remote arrival)."""
        barrier = _mbarrier(address, block)
        with _BARRIER_LOCK:
            barrier.update(1, 0)

    def mbarrier_arrive_expect_tx(address, tx_bytes):
        """mbarrier.arrive.expect_tx (simulator)."""
        barrier = _mbarrier(address)
        with _BARRIER_LOCK:
            barrier.update(1, int(tx_bytes))

    def mbarrier_wait(address, parity):
        """Sleep until the phase of parity ``parity`` of the mbarrier has completed (simulator)."""
        barrier = _mbarrier(address)
        wait_on_cluster(  # until the phase in progress is no longer the one of that parity
            threading.current_thread().block, barrier.completed, lambda: barrier.phase % 2 != parity,
            lambda: (barrier.pending, barrier.tx),
            lambda: (f"on the mbarrier at shared address {int(address)} (phase {barrier.phase}, {barrier.pending} "
                     f"arrivals and {barrier.tx} bytes outstanding)"))  # fmt: skip

    @functools.cache
    def tma_load_2d(rows):
        """``load(smem, dst, tensor_map, src, col, row, barrier)``: the box src[row:, col:] (rows x 64,
        zeros outside src) into the swizzled tile at ``dst``, its bytes completed on ``barrier`` (simulator)."""

        def load(smem, dst, tensor_map, src, col, row, barrier):
            copy_box(smem, dst, src, col, row, rows)
            complete_tx(barrier, rows * SWIZZLE_ROW_BYTES)

        return load

    def copy_box(smem, dst, src, col, row, rows):
        """The simulated TMA's copy: the box src[row:row + rows, col:col + 64] (zeros outside src) into
        the 128-byte swizzled tile at byte ``dst`` of the shared array ``smem`` (any dtype)."""
        box = np.zeros((rows, TILE_K), np.uint16)
        r_end, c_end = min(row + rows, src.shape[0]), min(col + TILE_K, src.shape[1])
        if r_end > row and c_end > col:
            box[: r_end - row, : c_end - col] = src[row:r_end, col:c_end]
        r = np.arange(rows)[:, None]
        k = np.arange(TILE_K)[None, :]
        smem.view(np.uint8).view(np.uint16)[_swizzled(int(dst) + r * SWIZZLE_ROW_BYTES + 2 * k) // 2] = box

    def complete_tx(address, tx_bytes, block=None):
        """A TMA copy's ``complete_tx``: ``tx_bytes`` of the mbarrier at ``address`` (of ``block``,
        default the calling thread's) have landed (simulator)."""
        barrier = _mbarrier(address, block)
        with _BARRIER_LOCK:
            barrier.update(0, -int(tx_bytes))

    class _NamedBarrier:
        """A hardware barrier 1-15: arrivals counted in this phase (whoever makes them), phases completed;
        ``completed`` (on ``_BARRIER_LOCK``) wakes its waiters when a phase completes."""

        def __init__(self, threads):
            self.threads = threads
            self.arrived = 0
            self.phase = 0
            self.completed = threading.Condition(_BARRIER_LOCK)

    def _named_arrival(index, threads):
        """Count the calling thread's arrival on barrier ``index`` of its block; the phase it joined and the barrier."""
        block = threading.current_thread().block
        with _BARRIER_LOCK:
            barrier = block.__dict__.setdefault("named_barriers", {}).setdefault(int(index), _NamedBarrier(int(threads)))
            if barrier.arrived and barrier.threads != int(threads):
                raise WarpSyncError(f"bar {index}: {int(threads)} threads expected while a phase of {barrier.threads} is open")
            barrier.threads = int(threads)
            phase = barrier.phase
            barrier.arrived += 1
            if barrier.arrived == barrier.threads:
                barrier.arrived = 0
                barrier.phase += 1
                barrier.completed.notify_all()
        return barrier, phase

    def named_barrier(index, threads):
        """bar.sync index, threads (simulator): wait until ``threads`` arrivals (this thread's, other
        threads' ``named_barrier`` or ``named_barrier_arrive``) complete the barrier's phase."""
        barrier, phase = _named_arrival(index, threads)
        wait_on_cluster(threading.current_thread().block, barrier.completed, lambda: barrier.phase != phase,
                        lambda: barrier.arrived,
                        lambda: f"on bar.sync {int(index)} ({barrier.arrived} of {barrier.threads} arrivals)")  # fmt: skip

    def named_barrier_arrive(index, threads):
        """bar.arrive index, threads (simulator): count this thread's arrival and go on."""
        _named_arrival(index, threads)

    def tensormap_prefetch(tensor_map):
        """prefetch.tensormap (simulator: the simulated TMA reads no tensor map)."""

    @functools.cache
    def set_max_registers(count, increase):
        """setmaxnreg (simulator: no register file)."""
        return lambda: None

else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from numba_vllm.kernels.mma import _shared_address
    from numba_vllm.kernels.vector_load import _check_array_and_index

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    def _void_asm(builder, text, operand_types=(), operands=(), constraints=""):
        """Emit a volatile inline-asm statement that clobbers memory."""
        clobber = "~{memory}"
        asm = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), list(operand_types)),
            text,
            f"{constraints},{clobber}" if constraints else clobber,
            side_effect=True,
        )
        builder.call(asm, list(operands))

    def _check_acc(name, acc):
        if not isinstance(acc, types.Array) or acc.dtype != types.float32 or acc.ndim != 1:
            raise TypingError(f"{name}: acc must be a 1-D float32 (local) array, got {acc}")

    def _acc_pointers(context, builder, acc_type, acc, count):
        """Pointers to acc[0 .. count - 1] (constant indices: the array stays in registers)."""
        data = context.make_array(acc_type)(context, builder, value=acc).data
        return [cgutils.gep_inbounds(builder, data, i) for i in range(count)]

    def _acc_asm(builder, pointers, text, extra_types=(), extra_operands=(), extra_constraints=(), word_pointers=()):
        """Run ``text`` with the accumulators (float32), then ``word_pointers``' values (uint32: A's
        registers), as in/out operands $0 .. $(count - 1) (their inputs, tied, are $count ..
        $(2 count - 1)), then the extra inputs from $(2 count); store the outputs back."""
        pointers = list(pointers) + list(word_pointers)
        count = len(pointers)
        kinds = [_F32] * (count - len(word_pointers)) + [_I32] * len(word_pointers)
        outputs = ["=f"] * (count - len(word_pointers)) + ["=r"] * len(word_pointers)
        constraints = outputs + [str(i) for i in range(count)] + list(extra_constraints) + ["~{memory}"]
        asm = ir.InlineAsm(
            ir.FunctionType(ir.LiteralStructType(kinds), kinds + list(extra_types)),
            text,
            ",".join(constraints),
            side_effect=True,
        )
        values = [builder.load(p) for p in pointers]
        result = builder.call(asm, values + list(extra_operands))
        for i, p in enumerate(pointers):
            builder.store(builder.extract_value(result, i), p)

    def _register_list(first, count):
        return "{" + ", ".join(f"${i}" for i in range(first, first + count)) + "}"

    @functools.cache
    def wgmma_bf16(n):
        """The intrinsic ``mma(acc, smem, desc_a, desc_b)``: one ``wgmma.mma_async ... m64n{n}k16``,
        acc (n/2 float32 per thread) += A (64 x 16, at desc_a) @ B (16 x n, at desc_b)."""
        count = n // 2
        text = (
            # operands: $0 .. $(count - 1) the accumulators (tied to the next count), then desc_a,
            # desc_b and scale_d; the predicate p = scale_d != 0 says D = A @ B + D (not A @ B).
            f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${2 * count + 2}, 0;\n"
            f"{_wgmma_instruction(n)} {_register_list(0, count)}, ${2 * count}, ${2 * count + 1}, p, 1, 1, 0, 0;\n}}"
        )

        @intrinsic
        def mma(typingctx, acc, smem, desc_a, desc_b):
            _check_acc("wgmma_bf16", acc)
            if not isinstance(smem, types.Array):
                raise TypingError(f"wgmma_bf16: smem must be the shared array of the operands, got {smem}")
            for name, desc in (("desc_a", desc_a), ("desc_b", desc_b)):
                if not isinstance(desc, types.Integer):
                    raise TypingError(f"wgmma_bf16: {name} must be an integer descriptor, got {desc}")
            sig = types.void(acc, smem, desc_a, desc_b)

            def codegen(context, builder, sig, args):
                descs = [context.cast(builder, v, t, types.int64) for v, t in zip(args[2:], sig.args[2:], strict=True)]
                pointers = _acc_pointers(context, builder, sig.args[0], args[0], count)
                scale_d = ir.Constant(_I32, 1)  # D = A @ B + D
                _acc_asm(builder, pointers, text, (_I64, _I64, _I32), (*descs, scale_d), ("l", "l", "r"))
                return context.get_dummy_value()

            return sig, codegen

        return mma

    @functools.cache
    def wgmma_bf16_rs(n, trans_b):
        """The intrinsic ``mma(acc, a0, a1, a2, a3, smem, desc_b)``: one ``wgmma.mma_async ... m64n{n}k16``
        with A from registers (this thread's four bf16 pairs of the 64 x 16 A, the mma.sync fragment
        layout per warp), acc (n/2 float32 per thread) += A @ B (16 x n, at desc_b; MN-major if
        ``trans_b``)."""
        count = n // 2
        text = (
            # operands: the accumulators $0 .. $(count - 1) (tied to the next count), a0 .. a3, desc_b,
            # scale_d; the immediates: scale-a 1, scale-b 1, transpose-b.
            f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${2 * count + 5}, 0;\n"
            f"{_wgmma_instruction(n)} {_register_list(0, count)}, {_register_list(2 * count, 4)}, ${2 * count + 4}, "
            f"p, 1, 1, {1 if trans_b else 0};\n}}"
        )

        @intrinsic
        def mma(typingctx, acc, a0, a1, a2, a3, smem, desc_b):
            _check_acc("wgmma_bf16_rs", acc)
            _check_ints("wgmma_bf16_rs", (a0, a1, a2, a3, desc_b))
            if not isinstance(smem, types.Array):
                raise TypingError(f"wgmma_bf16_rs: smem must be the shared array of B, got {smem}")
            sig = types.void(acc, a0, a1, a2, a3, smem, desc_b)

            def codegen(context, builder, sig, args):
                words = [_u32(context, builder, v, t) for v, t in zip(args[1:5], sig.args[1:5], strict=True)]
                desc = context.cast(builder, args[6], sig.args[6], types.int64)
                pointers = _acc_pointers(context, builder, sig.args[0], args[0], count)
                scale_d = ir.Constant(_I32, 1)  # D = A @ B + D
                _acc_asm(builder, pointers, text, (_I32,) * 4 + (_I64, _I32), (*words, desc, scale_d),
                         ("r",) * 4 + ("l", "r"))
                return context.get_dummy_value()

            return sig, codegen

        return mma

    def _operands_intrinsic(name, n, words, text):
        """The intrinsic ``f(acc, a_words)`` emitting ``text`` with acc[:n/2] and a_words[:words] (a uint32
        local array) as in/out operands: every access to them is ordered around it."""

        @intrinsic
        def with_operands(typingctx, acc, a_words):
            _check_acc(name, acc)
            if not isinstance(a_words, types.Array) or a_words.dtype != types.uint32 or a_words.ndim != 1:
                raise TypingError(f"{name}: a_words must be a 1-D uint32 local array, got {a_words}")
            sig = types.void(acc, a_words)

            def codegen(context, builder, sig, args):
                _acc_asm(builder, _acc_pointers(context, builder, sig.args[0], args[0], n // 2), text,
                         word_pointers=_acc_pointers(context, builder, sig.args[1], args[1], words))  # fmt: skip
                return context.get_dummy_value()

            return sig, codegen

        return with_operands

    @functools.cache
    def wgmma_fence_operands(n, words):
        """The intrinsic ``fence(acc, a_words)``: ``wgmma.fence`` ordered after every write of acc[:n/2]
        and of a_words[:words] (a uint32 local array: A's registers for the wgmma that follow)."""
        return _operands_intrinsic("wgmma_fence_operands", n, words, "wgmma.fence.sync.aligned;")

    @functools.cache
    def wgmma_wait_operands(n, words, pending):
        """The intrinsic ``wait(acc, a_words)``: ``wgmma.wait_group pending``, after which acc[:n/2] may be
        read and a_words[:words] (A's registers of the wgmma waited for) written."""
        return _operands_intrinsic("wgmma_wait_operands", n, words, f"wgmma.wait_group.sync.aligned {pending};")

    @functools.cache
    def wgmma_fence(n):
        """The intrinsic ``fence(acc)``: ``wgmma.fence``, ordered after every write of acc[:n/2]."""

        @intrinsic
        def fence(typingctx, acc):
            _check_acc("wgmma_fence", acc)
            sig = types.void(acc)

            def codegen(context, builder, sig, args):
                pointers = _acc_pointers(context, builder, sig.args[0], args[0], n // 2)
                _acc_asm(builder, pointers, "wgmma.fence.sync.aligned;")
                return context.get_dummy_value()

            return sig, codegen

        return fence

    @functools.cache
    def wgmma_wait(n, pending):
        """The intrinsic ``wait(acc)``: ``wgmma.wait_group pending``, after which acc[:n/2] may be read."""

        @intrinsic
        def wait(typingctx, acc):
            _check_acc("wgmma_wait", acc)
            sig = types.void(acc)

            def codegen(context, builder, sig, args):
                pointers = _acc_pointers(context, builder, sig.args[0], args[0], n // 2)
                _acc_asm(builder, pointers, f"wgmma.wait_group.sync.aligned {pending};")
                return context.get_dummy_value()

            return sig, codegen

        return wait

    @intrinsic
    def wgmma_commit(typingctx):
        """``wgmma.commit_group``: the wgmma issued since the last commit form one group."""
        return types.void(), _u32_operands_codegen("wgmma.commit_group.sync.aligned;")

    @intrinsic
    def fence_proxy_async(typingctx):
        """``fence.proxy.async.shared::cta``: this thread's shared-memory writes become visible to wgmma."""
        return types.void(), _u32_operands_codegen("fence.proxy.async.shared::cta;")

    @intrinsic
    def shared_address(typingctx, array, index):
        """The 32-bit shared-window address (uint32) of ``array[index]``, a shared array."""
        if not isinstance(array, types.Array):
            raise TypingError(f"shared_address: expected a shared array, got {array}")
        _check_array_and_index("shared_address", array, index, (array.dtype,))
        sig = types.uint32(array, index)

        def codegen(context, builder, sig, args):
            return _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])

        return sig, codegen

    def _check_ints(name, args):
        for i, arg in enumerate(args):
            if not isinstance(arg, types.Integer):
                raise TypingError(f"{name}: argument {i} must be an integer, got {arg}")

    def _u32(context, builder, value, value_type):
        return context.cast(builder, value, value_type, types.uint32)

    def _u32_operands_codegen(text):
        """Codegen emitting ``text`` with the integer arguments as 32-bit operands $0, $1, ... (none: an
        instruction without operands)."""

        def codegen(context, builder, sig, args):
            values = [_u32(context, builder, v, t) for v, t in zip(args, sig.args, strict=True)]
            _void_asm(builder, text, [_I32] * len(values), values, ",".join(["r"] * len(values)))
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def mbarrier_init(typingctx, barrier, count):
        """``mbarrier.init``: the mbarrier at shared address ``barrier`` expects ``count`` arrivals a phase."""
        _check_ints("mbarrier_init", (barrier, count))
        return types.void(barrier, count), _u32_operands_codegen("mbarrier.init.shared::cta.b64 [$0], $1;")

    @intrinsic
    def mbarrier_arrive(typingctx, barrier):
        """``mbarrier.arrive``: one arrival on the mbarrier at shared address ``barrier``."""
        _check_ints("mbarrier_arrive", (barrier,))
        return types.void(barrier), _u32_operands_codegen("mbarrier.arrive.shared::cta.b64 _, [$0];")

    @intrinsic
    def mbarrier_arrive_expect_tx(typingctx, barrier, tx_bytes):
        """``mbarrier.arrive.expect_tx``: one arrival, and ``tx_bytes`` more bytes for the phase to wait for."""
        _check_ints("mbarrier_arrive_expect_tx", (barrier, tx_bytes))
        text = "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"
        return types.void(barrier, tx_bytes), _u32_operands_codegen(text)

    @intrinsic
    def mbarrier_wait(typingctx, barrier, parity):
        """Wait until the phase of parity ``parity`` of the mbarrier at ``barrier`` has completed."""
        _check_ints("mbarrier_wait", (barrier, parity))
        # try_wait suspends the thread for a while when the phase is not complete; loop until it is.
        text = "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n@!p bra WAIT;\n}"
        return types.void(barrier, parity), _u32_operands_codegen(text)

    @intrinsic
    def named_barrier(typingctx, index, threads):
        """``bar.sync index, threads``: wait until ``threads`` threads have arrived on barrier ``index``."""
        _check_ints("named_barrier", (index, threads))
        return types.void(index, threads), _u32_operands_codegen("bar.sync $0, $1;")

    @intrinsic
    def named_barrier_arrive(typingctx, index, threads):
        """``bar.arrive index, threads``: count this warp's threads on barrier ``index`` without waiting."""
        _check_ints("named_barrier_arrive", (index, threads))
        return types.void(index, threads), _u32_operands_codegen("bar.arrive $0, $1;")

    @functools.cache
    def set_max_registers(count, increase):
        """The intrinsic ``f()``: ``setmaxnreg.{inc,dec}.sync.aligned.u32 count``, this warpgroup's registers
        per thread raised (``increase``) or lowered to ``count`` (24 .. 256, a multiple of 8)."""
        if count % 8 or not 24 <= count <= 256:
            raise ValueError(f"setmaxnreg: {count} registers (24 .. 256, a multiple of 8)")
        text = f"setmaxnreg.{'inc' if increase else 'dec'}.sync.aligned.u32 {count};"

        @intrinsic
        def set_registers(typingctx):
            return types.void(), _u32_operands_codegen(text)

        return set_registers

    @intrinsic
    def fence_mbarrier_init(typingctx):
        """``fence.mbarrier_init``: the initialised mbarriers are visible to the other threads and the TMA."""
        return types.void(), _u32_operands_codegen("fence.mbarrier_init.release.cluster;")

    @intrinsic
    def tensormap_prefetch(typingctx, tensor_map):
        """``prefetch.tensormap``: start fetching the tensor map (a uint64 device array, 128 bytes)
        into the TMA unit's descriptor cache; returns at once."""
        if not isinstance(tensor_map, types.Array) or tensor_map.dtype != types.uint64:
            raise TypingError(f"tensormap_prefetch: tensor_map must be a uint64 device array, got {tensor_map}")
        sig = types.void(tensor_map)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            _void_asm(builder, "prefetch.tensormap [$0];", (_I64,), (builder.ptrtoint(data, _I64),), "l")
            return context.get_dummy_value()

        return sig, codegen

    @functools.cache
    def tma_load_2d(rows):
        """The intrinsic ``load(smem, dst, tensor_map, src, col, row, barrier)``: one 2-D TMA copy of a
        box (rows x 64, the tensor map's) into shared address ``dst``, completed on ``barrier``."""

        @intrinsic
        def load(typingctx, smem, dst, tensor_map, src, col, row, barrier):
            sig = tma_signature("tma_load_2d", smem, dst, tensor_map, src, col, row, barrier)

            def codegen(context, builder, sig, args):
                _void_asm(
                    builder,
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                    "[$0], [$1, {$2, $3}], [$4];",
                    TMA_OPERAND_TYPES,
                    tma_operands(context, builder, sig, args),
                    TMA_CONSTRAINTS,
                )
                return context.get_dummy_value()

            return sig, codegen

        return load

    TMA_OPERAND_TYPES = (_I32, _I64, _I32, _I32, _I32)  # a copy's destination, tensor map, column, row, mbarrier
    TMA_CONSTRAINTS = "r,l,r,r,r"

    def tma_signature(name, smem, dst, tensor_map, src, col, row, barrier, *more_ints):
        """Typing of a TMA copy intrinsic ``(smem, dst, tensor_map, src, col, row, barrier, *more_ints)``."""
        _check_ints(name, (dst, col, row, barrier, *more_ints))
        if not isinstance(tensor_map, types.Array) or tensor_map.dtype != types.uint64:
            raise TypingError(f"{name}: tensor_map must be a uint64 device array, got {tensor_map}")
        return types.void(smem, dst, tensor_map, src, col, row, barrier, *more_ints)

    def tma_operands(context, builder, sig, args):
        """A TMA copy's operands (``TMA_OPERAND_TYPES``): shared destination, the tensor map's global
        address, column, row, mbarrier."""
        map_data = context.make_array(sig.args[2])(context, builder, value=args[2]).data
        return [
            _u32(context, builder, args[1], sig.args[1]),
            builder.ptrtoint(map_data, _I64),
            *(_u32(context, builder, args[i], sig.args[i]) for i in (4, 5, 6)),
        ]
