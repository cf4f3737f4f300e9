"""Stopping one simulated CUDA thread at a line of a kernel: ``break_in``.

``break_in(kernel, line, block=, thread=)`` stops one chosen CUDA thread at a line of a
kernel or device function, in pdb or in a callback (see its docstring and
docs/stepping_through_kernels.md).

It needs the simulator, where every CUDA thread is a Python thread, and one hook of its block
manager: while a breakpoint is armed, ``sim_blocks.tracer_for`` is set, and the pooled worker about
to play a CUDA thread asks it for a tracer; the chosen thread runs under ``sys.settrace``, the
others as usual.
"""

import bdb
import contextlib
import dis
import inspect
import os
import pdb
import sys

from numba_vllm.sim import blocks as sim_blocks
from numba_vllm.sim import warp as simulator

DEBUG_HANG_TIMEOUT_S = 24 * 3600.0
"""``sim_blocks.hang_timeout_s`` while a ``break_in`` that opens pdb is armed: a thread sitting at the pdb
prompt holds up the others at their next barrier or shuffle, and they must not give up."""

_PDB_SKIP = (
    "numba.*",
    "numba_vllm.sim.warp",
    "numba_vllm.sim.blocks",
    "numba_vllm.sim.stepping",
    "contextlib",
    "threading",
    "importlib*",
    "numpy*",
)
"""Modules pdb's ``s``/``n`` never stop in: the simulator's machinery between a kernel and its
device functions (ours and numba's), so ``s`` on ``block_sum(...)`` lands in ``block_sum``."""


class Breakpoint:
    """One armed ``break_in``: where to stop, at which thread, what to do there, and ``hits``."""

    def __init__(self, code, line, block, thread, on_hit, max_hits, intro):
        self.code = code  # the Python code object of the kernel or device function
        self.line = line  # line number in code.co_filename
        self.block = block  # (x, y, z) blockIdx of the thread that stops
        self.thread = thread  # (x, y, z) threadIdx
        self.on_hit = on_hit  # callback(frame), or None for pdb
        self.max_hits = max_hits  # stop at most this often (None: every time the line runs)
        self.intro = intro  # text printed before each pdb prompt
        self.hits = 0  # times the chosen thread reached the line

    @property
    def armed(self):
        return self.max_hits is None or self.hits < self.max_hits

    def where(self):
        return f"{self.code.co_name} ({os.path.basename(self.code.co_filename)}:{self.line})"


_breakpoints = []  # armed by break_in; a worker looks at them (via _tracer_for) when it starts playing a thread


@contextlib.contextmanager
def break_in(kernel, line=None, *, block=0, thread=0, on_hit=None, max_hits=None, intro=None):
    """Stop the CUDA thread ``thread`` of block ``block`` when it reaches ``line`` of ``kernel``.

    A context manager: the breakpoint is armed for the launches inside the ``with``::

        with break_in(rms_norm_kernel, "total = block_sum", block=1, thread=37):
            rms_norm(x, weight, out, eps)        # thread 37 of block 1 stops in pdb

    kernel: a ``@kernel`` or ``@device_function`` object (or its Python function). Every kernel
        made from the same source shares one code object, so any ``decode_attention_kernel_for(...)``
        stands for all of them.
    line: where to stop, before the line runs: a line number of the kernel's source file, or a
        piece of text found on exactly one line of the function; default its first line.
    block, thread: the chosen ``blockIdx`` and ``threadIdx``, an int (x) or a tuple (x, y, z).
    on_hit: ``on_hit(frame)`` is called in the simulated thread instead of opening pdb (for
        tests and scripts): ``frame.f_locals`` holds the kernel's locals; copy arrays you keep
        (shared memory is rewritten by later blocks).
    max_hits: stop at most this many times (the line may sit in a loop, the kernel may be launched
        often); then the breakpoint is spent. None: every time.
    intro: text printed before each pdb prompt (a cheat sheet).

    Yields the ``Breakpoint``; its ``hits`` counts the stops (0: the thread never got there, e.g.
    the grid has no such block). Only the chosen thread stops; the other threads of its block run
    on until they need it: a ``syncthreads``, or a shuffle of its warp, waits for it as on a GPU.
    While pdb may open, the hang timeout is raised to ``DEBUG_HANG_TIMEOUT_S`` so that they wait.
    In pdb, ``c`` runs on to the next stop and ``q`` aborts the launch (the launcher raises a
    ``KernelError`` caused by ``bdb.BdbQuit``).

    How: the pooled worker that is about to play the chosen thread turns on ``sys.settrace`` for
    itself alone (``threading.settrace`` would reach only threads started later, and the pool's
    workers are already running); the trace function watches the kernel's frames for the line.
    Raises RuntimeError when the simulator is off: on a GPU there is no Python thread to stop.
    """
    if not simulator.simulator_enabled():
        raise RuntimeError(
            "break_in needs the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 before numba is imported "
            "(on a GPU a kernel is machine code, not Python threads pdb can stop)"
        )
    simulator.install()
    fn = getattr(kernel, "py_func", kernel)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"break_in: {kernel!r} is not a kernel, a device function or a Python function")
    bp = Breakpoint(
        code, _resolve_line(code, line), _index3(block, "block"), _index3(thread, "thread"), on_hit, max_hits, intro
    )
    saved_timeout = sim_blocks.hang_timeout_s
    if on_hit is None:
        sim_blocks.hang_timeout_s = max(sim_blocks.hang_timeout_s, DEBUG_HANG_TIMEOUT_S)
    _breakpoints.append(bp)
    sim_blocks.tracer_for = _tracer_for
    try:
        yield bp
    finally:
        _breakpoints.remove(bp)
        if not _breakpoints:
            sim_blocks.tracer_for = None
        sim_blocks.hang_timeout_s = saved_timeout


def _index3(value, name):
    """``5`` or ``(5,)`` or ``(5, 0)`` -> ``(5, 0, 0)``."""
    values = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(values) <= 3 or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"break_in: {name} must be an int or a tuple of 1 to 3 ints >= 0, got {value!r}")
    return values + (0,) * (3 - len(values))


def _resolve_line(code, line):
    """The line number ``line`` names in ``code``: checked int, text found on one line, or the first."""
    code_lines = sorted({n for _, n in dis.findlinestarts(code) if n is not None})
    body = [n for n in code_lines if n > code.co_firstlineno] or code_lines
    where = f"{code.co_name} ({code.co_filename}, lines {body[0]}-{body[-1]})"
    if line is None:
        return body[0]
    if isinstance(line, int):
        if line not in code_lines:
            raise ValueError(f"break_in: line {line} has no code of {where}")
        return line
    source, first = inspect.getsourcelines(code)
    found = [n for n in code_lines if n >= first and line in source[n - first]]
    if len(found) != 1:
        which = "on no line with code" if not found else f"on lines {', '.join(map(str, found))}"
        raise ValueError(f"break_in: {line!r} is {which} of {where}; give more text or a line number")
    return found[0]


def _tracer_for(block_idx, thread_idx):
    """The tracer for the thread (block_idx, thread_idx), or None when no breakpoint names it."""
    chosen = [bp for bp in tuple(_breakpoints) if bp.armed and bp.block == block_idx and bp.thread == thread_idx]
    return _ThreadTracer(chosen) if chosen else None


class _KernelPdb(pdb.Pdb):
    """pdb whose ``c`` leaves the thread to ``break_in``'s tracer (pdb would switch tracing off)."""

    def set_continue(self):
        self._set_stopinfo(self.botframe, None, -1)  # stop nowhere; the tracer detaches pdb


class _ThreadTracer:
    """``sys.settrace`` functions of the one worker playing a chosen thread.

    Until a breakpoint's line is reached, only frames of the breakpoints' code are traced, for
    their ``line`` events. At a hit: ``on_hit(frame)``, or pdb's prompt; after ``n``, ``s``, ``r``
    or ``unt`` every event goes to pdb too, until ``c``.
    """

    def __init__(self, breakpoints):
        self.breakpoints = breakpoints
        self.codes = {bp.code for bp in breakpoints}
        self.debugger = None  # created at the first pdb stop
        self.stepping = False  # pdb follows the thread (after n, s, r, unt; or pdb's own breakpoints)

    def run(self, block):
        sys.settrace(self.on_call)
        try:
            block.run_thread()
        finally:
            sys.settrace(None)

    def on_call(self, frame, event, arg):
        """Global trace function: decides which new frames to trace."""
        traced = frame.f_code in self.codes
        if self.stepping:  # pdb may stop at the call (after s) and says whether to trace it
            traced = self.debugger.trace_dispatch(frame, event, arg) is not None or traced
            self.after_prompt()
        return self.on_event if traced else None

    def on_event(self, frame, event, arg):
        """Local trace function of the traced frames."""
        if event == "line" and frame.f_code in self.codes:
            for bp in self.breakpoints:
                if bp.code is frame.f_code and bp.line == frame.f_lineno and bp.armed:
                    bp.hits += 1
                    if bp.on_hit is not None:
                        bp.on_hit(frame)  # an exception here fails the launch, like one in the kernel
                    else:
                        self.open_pdb(bp, frame)
                        return self.on_event  # pdb has had this line
        if self.stepping:
            self.debugger.trace_dispatch(frame, event, arg)  # stops at the prompt when due
            self.after_prompt()
        return self.on_event

    def open_pdb(self, bp, frame):
        if self.debugger is None:
            self.debugger = _KernelPdb(skip=_PDB_SKIP, nosigint=True)
        dbg = self.debugger
        dbg.reset()
        dbg.botframe = _kernel_frame(frame)  # pdb's stack ends at the kernel: no simulator frames
        print(f"\n*** break_in: block {bp.block} thread {bp.thread} stopped in {bp.where()}, hit {bp.hits}")
        if bp.intro:
            print(bp.intro)
        dbg.interaction(frame, None)
        if dbg.quitting:
            raise bdb.BdbQuit
        self.after_prompt()

    def after_prompt(self):
        dbg = self.debugger
        self.stepping = dbg.stoplineno != -1 or bool(dbg.breaks)


def _kernel_frame(frame):
    """The outermost frame of the simulated thread's kernel (the one ``Block.run_thread`` called)."""
    while frame.f_back is not None and frame.f_back.f_code is not sim_blocks.Block.run_thread.__code__:
        frame = frame.f_back
    return frame
