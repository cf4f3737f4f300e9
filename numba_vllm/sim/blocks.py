"""The simulator's block manager: pooled threads, rendezvous rounds, and a barrier that sleeps.

numba-cuda 0.30.4's simulator runs a kernel one block at a time, every CUDA thread of the block as
a Python thread; its block manager starts fresh threads for every block and busy-polls them to
detect ``syncthreads``. ``PooledBlockManager`` replaces it (``simulator.install()`` puts it in
place), and its blocks also run the warp intrinsics of ``simulator.py``.

Every synchronising operation is a *rendezvous round*: threads deposit a value in the open
round, block until the round is complete, then read what they need from it.

- ``syncthreads`` (and ``syncthreads_count/and/or``): one round for the whole block. It is
  complete when every thread that has not yet exited has arrived; a thread that returns early
  is dropped from the barrier, as on the stock simulator.
- Warp operations (``shfl_*_sync``, ``ballot/any/all_sync``, ``syncwarp``): one round per
  (warp, mask). It is complete when every lane of ``mask & present & ~exited`` has arrived;
  *present* excludes the missing lanes of a partial last warp (``blockDim`` not a multiple of
  32). Each lane then reads its source lane from the round (the PTX rules are in ``simulator.py``).
- Group operations of consecutive threads (a warpgroup's ``wgmma``, ``kernels/wgmma.py``): one
  round per group, complete when every thread of the group that exists and has not exited has
  arrived.

The lane that completes a round removes it from the open rounds before waking the others, and
each lane keeps a reference to its own round: a fast lane that starts the next shuffle opens a
fresh round instead of overwriting values a slow lane has not read yet.

Deadlocks are detected exactly, not guessed: the block counts its live threads and the threads
waiting in incomplete rounds, and when every live thread waits, no round can ever complete
(for example half a warp in a shuffle and the other half in ``syncthreads``, or a mask naming
a lane that is waiting elsewhere). The thread that closes the cycle raises
``SimulatorDeadlockError`` describing who waits where. A wait that lasts longer than
``hang_timeout_s`` (env ``NUMBA_VLLM_SIM_HANG_TIMEOUT``, default 30 s) also raises it: that
catches a thread looping forever while others wait for it.

Scheduling. Simulated threads are reusable worker threads from a pool (starting a Python thread
costs more than running a small kernel body), and the launching thread sleeps on a condition
variable until the block finishes instead of polling. A waiting thread sleeps on a lock of its
own; the thread that completes a round releases only the first waiter's lock, and each woken
waiter releases the next one ("baton passing"). This is a condition variable's notify_all
spread out over the waiters: waking all of them at once (``threading.Condition``) makes up to
1024 threads fight over the GIL, which made a 1024-thread ``syncthreads`` ~3x slower. Block
start-up works the same way: each worker starts the next thread before running its own.

One core. Only the thread holding the GIL runs, so the simulated threads gain nothing from more
than one core, and every hand-over between two of them on different cores costs a cross-core
wake-up. The pool pins its workers to the core the launching thread runs on
(``sched_setaffinity``, Linux; env ``NUMBA_VLLM_SIM_ONE_CORE=0`` leaves them to the OS).

When a thread raises, the block aborts: every waiting thread is woken to unwind, and the launch
re-raises the first error, prefixed with the thread's ``tid``/``ctaid`` as the stock simulator
does.

Clusters (``kernels/cluster.py``). Inside ``simulated_clusters(size)`` (what ``_launch.launch`` does
for a launch with clusters of ``(1, 1, size)`` blocks, ``gridDim.z == size``), the blocks of a
cluster, which the simulator hands over one after another (z varies fastest), are held back until
the last has come and then run at once, each with its own shared memory (the stock simulator has
one per launch, which is enough when blocks run one at a time): ``cluster_blocks()`` lists them by
rank, ``dynamic_shared()`` is a block's dynamic shared memory, and ``cluster_barrier()`` is a
rendezvous of every live thread of the cluster. A block whose partner failed stops waiting for it
(``raise_if_cluster_failed``). Waits on other blocks (the cluster barrier, an mbarrier, a named
barrier: ``wait_on_cluster``) sleep on a condition variable that the arrival completing the phase
notifies, and count as hung after ``hang_timeout_s`` per block of the cluster with no new arrival:
the blocks' threads share one interpreter, and on a loaded machine one block can trail the others
by minutes.
"""

import contextlib
import os
import queue
import threading
import time

import numpy as np

FULL_MASK = 0xFFFFFFFF
WARP_SIZE = 32

hang_timeout_s = float(os.environ.get("NUMBA_VLLM_SIM_HANG_TIMEOUT", "30"))
"""Longest a simulated thread may wait in one round before the launch fails (seconds)."""

one_core = os.environ.get("NUMBA_VLLM_SIM_ONE_CORE", "1") != "0" and hasattr(os, "sched_setaffinity")
"""Whether a launch's simulated threads run pinned to the launching thread's core (module docstring)."""


class SimulatorDeadlockError(RuntimeError):
    """A simulated block can make no progress: every live thread waits in a round."""


class WarpSyncError(RuntimeError):
    """A warp operation that is undefined on a GPU (wrong mask, undefined integer read)."""


class _Aborted(Exception):
    """Raised in waiting threads when another thread of the block failed."""


tracer_for = None
"""Set by ``stepping.break_in`` while a breakpoint is armed: ``tracer_for(block_idx, thread_idx)``
is a tracer whose ``run(block)`` plays that CUDA thread, or None to play it untraced."""


def _format_ids(ids):
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``: compact thread or lane lists for error messages."""
    spans = []
    for i in sorted(ids):
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def _lanes(mask):
    return [lane for lane in range(WARP_SIZE) if mask >> lane & 1]


# Rendezvous rounds


class _Round:
    """A rendezvous: the waiting threads sleep on their own locks until it completes."""

    def __init__(self):
        self.done = False
        self.waiters = []  # one acquired lock per waiting thread; released to wake it

    def add_waiter(self):
        """A new waiter's position; it sleeps until ``waiters[position]`` is released."""
        waiter = threading.Lock()
        waiter.acquire()
        self.waiters.append(waiter)
        return len(self.waiters) - 1

    def wake_first(self):
        """Completion: wake waiter 0; each woken waiter then wakes the next (``pass_on``)."""
        if self.waiters:
            self.waiters[0].release()

    def pass_on(self, position):
        if position + 1 < len(self.waiters):
            self.waiters[position + 1].release()

    def wake_all(self):
        """Abort: wake every waiter at once (they unwind and pass nothing on)."""
        for waiter in self.waiters:
            waiter.release()


class _BarrierRound(_Round):
    """One ``syncthreads`` of the whole block; counts true predicates for the reductions."""

    key = "syncthreads"

    def __init__(self):
        super().__init__()
        self.thread_ids = []  # arrivals, for error messages
        self.num_true = 0

    def is_complete(self, block):
        return len(self.thread_ids) == block.num_live

    def describe(self, block):
        return f"threads {_format_ids(self.thread_ids)} wait in syncthreads"


class _WarpRound(_Round):
    """One warp operation of the lanes in ``mask``: the lanes' values and predicates."""

    def __init__(self, kind, warp, mask):
        super().__init__()
        self.key = (warp, mask)
        self.kind = kind
        self.warp = warp
        self.mask = mask
        self.values = [ABSENT] * WARP_SIZE  # (32,) value deposited by each lane
        self.arrived = 0  # lane bitmask
        self.true_mask = 0  # lanes whose value was truthy (for votes)

    def missing(self, block):
        """Lanes the round still waits for."""
        return self.mask & block.present[self.warp] & ~block.exited[self.warp] & ~self.arrived

    def is_complete(self, block):
        return self.missing(block) == 0

    def describe(self, block):
        return (
            f"warp {self.warp}: lanes {_format_ids(_lanes(self.arrived))} wait in "
            f"{self.kind} (mask {self.mask:#010x}) for lanes "
            f"{_format_ids(_lanes(self.missing(block)))}"
        )


class _GroupRound(_Round):
    """One operation of the ``count`` consecutive threads from ``first`` (e.g. a warpgroup)."""

    def __init__(self, kind, first, count):
        super().__init__()
        self.key = ("group", first, count)
        self.kind = kind
        self.first = first
        self.count = count
        self.values = [ABSENT] * count  # (count,) value deposited by each thread of the group
        self.arrived = set()  # thread ids

    def missing(self, block):
        """Threads of the group the round still waits for (existing, not exited, not arrived)."""
        last = min(self.first + self.count, block.num_threads)
        return [t for t in range(self.first, last) if t not in self.arrived and not block._has_exited(t)]

    def is_complete(self, block):
        return not self.missing(block)

    def describe(self, block):
        return (
            f"threads {_format_ids(self.arrived)} wait in {self.kind} (group of {self.count} from "
            f"thread {self.first}) for threads {_format_ids(self.missing(block))}"
        )


ABSENT = object()  # value slot of a lane that did not take part in a round


# One running block


class Block:
    """State of one simulated thread block: its rounds, live threads, and first error."""

    def __init__(self, fn, args, block_idx, block_dim, debug):
        self.fn = fn
        self.args = args
        self.block_idx = block_idx
        self.block_dim = block_dim
        self.debug = debug
        self.num_threads = block_dim[0] * block_dim[1] * block_dim[2]
        num_warps = -(-self.num_threads // WARP_SIZE)
        self.present = [  # (num_warps,) lane bitmask of the lanes that exist
            (1 << min(WARP_SIZE, self.num_threads - WARP_SIZE * w)) - 1 for w in range(num_warps)
        ]
        self.exited = [0] * num_warps  # (num_warps,) lane bitmask of finished lanes
        self.lock = threading.Lock()  # guards everything below
        self.finished = threading.Condition(self.lock)  # the launching thread waits on it
        self.num_live = self.num_threads
        self.num_blocked = 0  # live threads waiting in an incomplete round
        self.open_rounds = {}  # round key -> round still collecting arrivals
        self.error = None  # (exception, traceback) of the first failure
        self.workers = []  # (num_threads,) worker playing each linear thread id
        self.cluster = None  # the _Cluster this block runs in (a cluster launch), else None
        self.shared = None  # with a cluster: this block's own FakeCUDAShared

    def cluster_blocks(self):
        """The blocks of this block's cluster by rank (a launch without clusters: this one alone)."""
        return [self] if self.cluster is None else self.cluster.blocks

    def dynamic_shared(self):
        """This block's dynamic shared memory, (bytes,) int8."""
        if self.shared is not None:
            return self.shared._dynshared
        from numba.cuda.simulator import kernel

        return kernel._kernel_context.shared._dynshared

    def cluster_barrier(self):
        """``barrier.cluster`` arrive + wait: until every live thread of the cluster has arrived."""
        if self.cluster is None:
            self.syncthreads(threading.current_thread(), False)
        else:
            self.cluster.barrier()

    def raise_if_cluster_failed(self):
        """In a wait on another block: unwind when any block of the cluster has failed."""
        if any(block.error is not None for block in self.cluster_blocks()):
            raise _Aborted()

    def start_thread(self, thread_id):
        """Start one thread; each thread starts the next before running (see ``_Worker.run``)."""
        if thread_id < self.num_threads:
            self.workers[thread_id].assign(self, thread_id)

    def run_thread(self):
        """Run the kernel body for the calling worker (already bound to a thread index)."""
        if self.debug:
            with np.errstate(divide="raise"):
                self.fn(*self.args)
        else:
            self.fn(*self.args)

    def syncthreads(self, thread, predicate):
        """Block-wide barrier; returns the completed round (for its ``num_true``)."""
        with self.lock:
            self._check_abort()
            rnd = self.open_rounds.get(_BarrierRound.key)
            if rnd is None:
                rnd = self.open_rounds[_BarrierRound.key] = _BarrierRound()
            rnd.thread_ids.append(thread.thread_id)
            if predicate:
                rnd.num_true += 1
            position = self._arrive(rnd)
        self._wait(rnd, position)
        return rnd

    def warp_round(self, thread, kind, mask, value):
        """Deposit ``value`` in the (warp, mask) round, wait for it to complete, return it."""
        mask = int(mask) & FULL_MASK
        lane = thread.thread_id % WARP_SIZE
        if not mask >> lane & 1:
            raise WarpSyncError(
                f"lane {lane} called {kind} with mask {mask:#010x}, which does not include it"
            )
        warp = thread.thread_id // WARP_SIZE
        with self.lock:
            self._check_abort()
            rnd = self.open_rounds.get((warp, mask))
            if rnd is None:
                rnd = self.open_rounds[(warp, mask)] = _WarpRound(kind, warp, mask)
            elif rnd.kind != kind:
                raise WarpSyncError(
                    f"warp {warp}, mask {mask:#010x}: lane {lane} called {kind} while lanes "
                    f"{_format_ids(_lanes(rnd.arrived))} wait in {rnd.kind}"
                )
            rnd.values[lane] = value
            rnd.arrived |= 1 << lane
            if value:
                rnd.true_mask |= 1 << lane
            position = self._arrive(rnd)
        self._wait(rnd, position)
        return rnd

    def group_round(self, thread, kind, first, count, value):
        """Deposit ``value`` in the round of threads ``first .. first + count - 1``, wait for it
        to complete, return it (``values[i]`` is thread ``first + i``'s deposit, ABSENT if none)."""
        with self.lock:
            self._check_abort()
            key = ("group", first, count)
            rnd = self.open_rounds.get(key)
            if rnd is None:
                rnd = self.open_rounds[key] = _GroupRound(kind, first, count)
            elif rnd.kind != kind:
                raise WarpSyncError(
                    f"thread {thread.thread_id} called {kind} while threads {_format_ids(rnd.arrived)} "
                    f"of its group wait in {rnd.kind}"
                )
            rnd.values[thread.thread_id - first] = value
            rnd.arrived.add(thread.thread_id)
            position = self._arrive(rnd)
        self._wait(rnd, position)
        return rnd

    def thread_finished(self, thread, error):
        """Record that ``thread`` returned (or raised ``error``); complete rounds it blocked."""
        with self.lock:
            self.num_live -= 1
            self.exited[thread.thread_id // WARP_SIZE] |= 1 << thread.thread_id % WARP_SIZE
            if error is not None:
                self._fail(error)
            elif self.error is None:
                for rnd in list(self.open_rounds.values()):
                    if rnd.is_complete(self):
                        self._release(rnd)
                if self.num_live and self.num_blocked == self.num_live:
                    self._fail((self._deadlock_error(), None))
            if self.num_live == 0:
                self.finished.notify_all()
        if self.cluster is not None:  # a cluster barrier that waited only on this thread completes now
            self.cluster.thread_exited()

    def wait_finished(self):
        """Launching thread: sleep until every thread returned; after a failure, not forever."""
        with self.lock:
            deadline = None
            while self.num_live:
                if self.error is not None and deadline is None:
                    deadline = time.monotonic() + hang_timeout_s
                if deadline is None:
                    self.finished.wait()
                elif not self.finished.wait(deadline - time.monotonic()):
                    return  # stuck threads stay busy and are not reused; report the error

    def _wait(self, rnd, position):
        """Sleep (without the block lock) until ``rnd`` completes or the block aborts."""
        if position is None:
            return  # this thread completed the round
        waiter = rnd.waiters[position]
        if not waiter.acquire(timeout=hang_timeout_s):
            with self.lock:
                timed_out = not rnd.done
                if timed_out and self.error is None:
                    raise SimulatorDeadlockError(
                        f"waited more than {hang_timeout_s:g} s: {rnd.describe(self)}; threads "
                        f"still running: {_format_ids(self._running_ids())}. If the kernel is "
                        "only slow, raise NUMBA_VLLM_SIM_HANG_TIMEOUT."
                    )
            waiter.acquire()  # completed or aborted meanwhile: the wake-up is on its way
        if not rnd.done:
            raise _Aborted()  # woken by _fail
        rnd.pass_on(position)

    # Everything below runs with self.lock held.

    def _arrive(self, rnd):
        """After a deposit: complete ``rnd`` (None), or return the waiter position to sleep on."""
        if rnd.is_complete(self):
            self._release(rnd)
            return None
        self.num_blocked += 1
        if self.num_blocked == self.num_live:
            raise self._deadlock_error()
        return rnd.add_waiter()

    def _release(self, rnd):
        del self.open_rounds[rnd.key]
        rnd.done = True
        self.num_blocked -= len(rnd.waiters)
        rnd.wake_first()

    def _check_abort(self):
        if self.error is not None:
            raise _Aborted()

    def _fail(self, error):
        """Record the block's first error and wake every waiting thread to unwind."""
        if self.error is None:
            self.error = error
            for rnd in self.open_rounds.values():
                rnd.wake_all()
        self.finished.notify_all()

    def _running_ids(self):
        waiting = set()
        for rnd in self.open_rounds.values():
            if isinstance(rnd, _BarrierRound):
                waiting.update(rnd.thread_ids)
            elif isinstance(rnd, _GroupRound):
                waiting.update(rnd.arrived)
            else:
                waiting.update(WARP_SIZE * rnd.warp + lane for lane in _lanes(rnd.arrived))
        return [t for t in range(self.num_threads) if t not in waiting and not self._has_exited(t)]

    def _has_exited(self, thread_id):
        return self.exited[thread_id // WARP_SIZE] >> thread_id % WARP_SIZE & 1

    def _deadlock_error(self):
        sites = "; ".join(rnd.describe(self) for rnd in self.open_rounds.values())
        exited = [t for t in range(self.num_threads) if self._has_exited(t)]
        return SimulatorDeadlockError(
            f"deadlock: every live thread waits and no round can complete: {sites}; "
            f"exited threads: {_format_ids(exited)}"
        )


# Reusable worker threads


class _Worker(threading.Thread):
    """A pooled Python thread that plays one CUDA thread per task.

    The fake ``cuda`` module reads ``threadIdx``, ``blockIdx`` and ``thread_id`` and calls
    ``syncthreads*`` on ``threading.current_thread()``, so the worker carries them.
    """

    def __init__(self, pool):
        super().__init__(daemon=True, name="cudasim-worker")
        self._pool = pool
        self._tasks = queue.SimpleQueue()  # (block, thread_id) to play next
        self.core = None  # the core this thread is pinned to (None: any the process may use)
        self.block = None
        self.threadIdx = None
        self.blockIdx = None
        self.thread_id = None  # linear: threadIdx.x + blockDim.x * (threadIdx.y + ...)

    def assign(self, block, thread_id):
        """Hand this idle worker the CUDA thread ``thread_id`` of ``block``."""
        self._tasks.put((block, thread_id))

    def pin(self, core):
        """Run this (started) thread on ``core`` alone, unless it already does; None: leave it.
        Returns False if the system refused (a sandbox without the right, a core taken away)."""
        if core is None or core == self.core:
            return True
        try:
            os.sched_setaffinity(self.native_id, {core})  # a thread id: this thread alone (Linux)
        except OSError:
            return False
        self.core = core
        return True

    def run(self):
        from numba.cuda.simulator.kernelapi import Dim3

        while True:
            block, thread_id = self._tasks.get()
            block.start_thread(thread_id + 1)
            bx, by, _ = block.block_dim
            self.block = block
            self.thread_id = thread_id
            self.threadIdx = Dim3(thread_id % bx, thread_id // bx % by, thread_id // (bx * by))
            self.blockIdx = Dim3(*block.block_idx)
            error = None
            tracer = tracer_for(block.block_idx, tuple(self.threadIdx)) if tracer_for is not None else None
            try:
                if tracer is None:
                    block.run_thread()
                else:
                    tracer.run(block)
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - any failure goes to the launcher
                error = self._located(exc)
            self._pool.put_back(self)
            block.thread_finished(self, error)

    def _located(self, exc):
        """The exception, re-created with the stock simulator's ``tid=.. ctaid=..`` prefix."""
        where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
        try:
            located = type(exc)(f"{where}: {exc}" if str(exc) else where)
        except Exception:  # noqa: BLE001 - its constructor wants other arguments
            located = exc
        return located, exc.__traceback__

    def syncthreads(self):
        self.block.syncthreads(self, False)

    def syncthreads_count(self, value):
        return self.block.syncthreads(self, value).num_true

    def syncthreads_and(self, value):
        rnd = self.block.syncthreads(self, value)
        return 1 if rnd.num_true == len(rnd.thread_ids) else 0

    def syncthreads_or(self, value):
        return 1 if self.block.syncthreads(self, value).num_true else 0


class _WorkerPool:
    """Idle workers, kept across blocks and launches; grows to the largest block seen."""

    def __init__(self):
        self._idle = []
        self._lock = threading.Lock()

    def take(self, count, core=None):
        """``count`` idle workers (started if the pool has too few), pinned to ``core`` (None: as they
        are); a refused pin turns pinning off for the process (``one_core``)."""
        global one_core
        with self._lock:
            workers = [self._idle.pop() for _ in range(min(count, len(self._idle)))]
        while len(workers) < count:
            worker = _Worker(self)
            worker.start()
            workers.append(worker)
        if not all(worker.pin(core) for worker in workers):
            one_core = False  # refused once, refused again: stop asking at every launch
        return workers

    def put_back(self, worker):
        with self._lock:
            self._idle.append(worker)


_POOL = _WorkerPool()


class _Cluster:
    """The blocks of one cluster, run at once, and their ``barrier.cluster`` rendezvous."""

    def __init__(self, blocks):
        self.blocks = blocks  # by rank
        self.lock = threading.Lock()
        self.completed = threading.Condition(self.lock)  # notified when a rendezvous completes
        self.arrived = 0
        self.generation = 0  # completed rendezvous

    def barrier(self):
        with self.lock:
            generation = self.generation
            self.arrived += 1
            self._complete_if_all_arrived()

        def passed():  # (called with the lock held)
            return self.generation != generation

        wait_on_cluster(self.blocks[0], self.completed, passed, lambda: self.arrived, lambda: (
            f"in barrier.cluster: {self.arrived} of {sum(block.num_live for block in self.blocks)} live threads "
            "of the cluster arrived"))  # fmt: skip

    def thread_exited(self):
        """A thread of the cluster returned: it no longer counts at the rendezvous."""
        with self.lock:
            self._complete_if_all_arrived()

    def _complete_if_all_arrived(self):
        if self.arrived and self.arrived >= sum(block.num_live for block in self.blocks):
            self.arrived = 0
            self.generation += 1
            self.completed.notify_all()


RECHECK_S = 0.2  # a thread waiting on other blocks looks this often for a failed block or a stall


def wait_on_cluster(block, changed, done, progress, describe):
    """Sleep on ``changed`` until ``done()``, for a wait on other blocks of ``block``'s cluster (a
    barrier.cluster, an mbarrier, a named barrier). ``changed`` is a ``threading.Condition`` whose
    lock guards what ``done()`` and ``progress()`` read (both are called with it held), notified by
    whoever makes ``done()`` true (a phase completing). Every ``RECHECK_S`` the waiter also wakes by
    itself: it unwinds when a block of the cluster has failed, and raises SimulatorDeadlockError after
    ``hang_timeout_s`` per block of the cluster (read now: stepping raises it) with no change of
    ``progress()``: the blocks' threads share one interpreter, and one can trail the others.

    (Polling instead, with pauses of 0.1-2 ms, spent most of a wgmma kernel's simulated time in the
    pollers' wake-ups: 23 s against 8 s for a prefill tiling test.)"""
    patience = hang_timeout_s * len(block.cluster_blocks())
    state, deadline = ABSENT, None
    with changed:
        while not done():
            block.raise_if_cluster_failed()
            now, clock = progress(), time.monotonic()
            if now != state:  # an arrival came: wait afresh
                state, deadline = now, clock + patience
            if clock > deadline:
                raise SimulatorDeadlockError(f"waited more than {patience:g} s with no arrival {describe()}")
            changed.wait(min(RECHECK_S, deadline - clock))


class _BlockShared:
    """The launch's ``cuda.shared`` during a cluster launch: each block's arrays are its own."""

    def __init__(self, launch_shared):
        self._size = launch_shared._dynshared_size

    def array(self, shape, dtype, alignment=None):
        block = threading.current_thread().block
        return block.shared.array(shape, dtype, alignment)


_cluster_size = 1  # blocks per cluster of the launch in progress (``simulated_clusters``)
_held_blocks = []  # blocks of the current cluster handed over so far


@contextlib.contextmanager
def simulated_clusters(size):
    """Run the launch inside as clusters of ``size`` consecutive blocks (``gridDim.z == size``)."""
    global _cluster_size
    _cluster_size = int(size)
    _held_blocks.clear()
    try:
        yield
    finally:
        _cluster_size = 1
        _held_blocks.clear()


class PooledBlockManager:
    """Drop-in replacement for the simulator's ``BlockManager`` (same constructor and ``run``)."""

    def __init__(self, f, grid_dim, block_dim, debug):
        self._f = f
        self._block_dim = block_dim
        self._debug = debug

    def run(self, grid_point, *args):
        block = Block(self._f, args, tuple(grid_point), tuple(self._block_dim), self._debug)
        if _cluster_size == 1:
            from numba.cuda.simulator import kernel

            _poison(kernel._kernel_context.shared._dynshared)
            _run_blocks([block])
            return
        _held_blocks.append(block)
        if len(_held_blocks) < _cluster_size:
            return  # the rest of the cluster comes next
        from numba.cuda.simulator import kernel
        from numba.cuda.simulator.kernelapi import FakeCUDAShared

        launch_module = kernel._kernel_context
        if not isinstance(launch_module._shared, _BlockShared):
            launch_module._shared = _BlockShared(launch_module._shared)
        blocks = list(_held_blocks)
        _held_blocks.clear()
        cluster = _Cluster(blocks)
        for b in blocks:
            b.cluster = cluster
            b.shared = FakeCUDAShared(launch_module._shared._size)
            _poison(b.shared._dynshared)
        _run_blocks(blocks)


def _poison(dynamic_shared):
    """Fill a block's dynamic shared memory with 0xFF bytes before it starts: NaN as bf16 and fp32,
    as if an earlier block had left garbage there (a GPU never zeroes it), so a kernel that reads
    what it never wrote fails its tests instead of reading the simulator's zeros."""
    dynamic_shared.fill(-1)


def _launching_core():
    """The core the calling thread runs on (``/proc/thread-self/stat``'s field 39), where the launch's
    simulated threads go (``one_core``); None when pinning is off or the system does not say."""
    if not one_core:
        return None
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return int(fields[39 - 3])  # fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def _run_blocks(blocks):
    """Run ``blocks`` at once; re-raise the first error, by rank."""
    core = _launching_core()
    for block in blocks:
        block.workers = _POOL.take(block.num_threads, core)
    for block in blocks:
        block.start_thread(0)
    for block in blocks:
        block.wait_finished()
    for block in blocks:
        if block.error is not None:
            exc, tb = block.error
            raise exc.with_traceback(tb)
