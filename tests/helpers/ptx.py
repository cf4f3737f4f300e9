"""Compile the kernel registry's variants to PTX without a GPU and inspect the result.

Compilation is ``numba_vllm.bench.kernel_report.PtxCompiler`` (a child process with the simulator off,
the kernels, signatures and block sizes of its ``REGISTRY``). Results are kept for the test session,
so the PTX test files and the kernel report test compile each kernel once; under pytest-xdist they
are also written to a folder the run's workers share (``SHARED_DIR``, set by ``tests/conftest.py``),
so a variant one worker compiled is read, not compiled again, by the others. Workers that need the
same variants at the same time share the work: each claims the variants no one has claimed yet
(a ``.claim`` file, created atomically), one at a time, compiles them, and then waits for the ones
another worker claimed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path

from numba_vllm.bench import kernel_report

F64_OP = re.compile(r"^\s*[a-z][\w.]*\.f64\b", re.M)  # an instruction working on doubles
_COMPILED: dict[tuple[str, bool], dict] = {}  # (variant key, lineinfo) -> compile_ptx's result
SHARED_DIR: Path | None = None  # the xdist workers' common folder of results, one JSON file a variant
POLL_S = 0.5  # how often a worker looks for a variant another worker compiles


def _shared_file(key: str, lineinfo: bool) -> Path | None:
    if SHARED_DIR is None:
        return None
    return SHARED_DIR / f"{hashlib.sha1(key.encode()).hexdigest()}-{int(lineinfo)}.json"


def _claim(result: Path) -> bool:
    """Claim the compilation of ``result``'s variant for this process: False if another has it."""
    try:
        fd = os.open(result.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _claimer_alive(result: Path) -> bool:
    """Whether the process that claimed ``result``'s variant still runs (a claim it gave up is gone)."""
    try:
        pid = result.with_suffix(".claim").read_text()
    except FileNotFoundError:
        return False
    if not pid:  # claimed this instant, its pid not yet written
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    return True


def _publish(key: str, lineinfo: bool, result: dict) -> None:
    _COMPILED[key, lineinfo] = result
    shared = _shared_file(key, lineinfo)
    if shared is not None:  # written whole, then renamed: a reader never sees half a file
        partial = shared.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(result))
        partial.replace(shared)


def _read_shared(key: str, lineinfo: bool) -> bool:
    """Take ``key``'s result from the shared folder if a worker has written it there."""
    shared = _shared_file(key, lineinfo)
    if shared is None or not shared.is_file():
        return False
    _COMPILED[key, lineinfo] = json.loads(shared.read_text())
    return True


def compile_ptx(variants, lineinfo: bool = False) -> dict[str, dict]:
    """{variant key: {'ptx', 'threads', 'max_registers'} or {'error': message}} for ``variants``.

    lineinfo: compile as ``make profile`` does (``NUMBA_VLLM_LINEINFO=1``: line tables in every kernel
    and device function).
    """
    waiting = [v for v in variants if (v.key, lineinfo) not in _COMPILED and not _read_shared(v.key, lineinfo)]
    claimed = []  # this process's claims not yet published (given up if compiling fails)
    with contextlib.ExitStack() as stack:  # the compiler child, started for the first variant this process compiles
        compiler = None
        try:
            while waiting:
                for v in list(waiting):
                    shared = _shared_file(v.key, lineinfo)
                    if _read_shared(v.key, lineinfo):
                        waiting.remove(v)
                        continue
                    if shared is not None and not _claim(shared):
                        continue  # another worker compiles it
                    claimed.append(shared)
                    compiler = compiler or stack.enter_context(kernel_report.PtxCompiler(lineinfo))
                    _publish(v.key, lineinfo, compiler.compile(v))
                    claimed.pop()
                    waiting.remove(v)
                if waiting:  # each one left is claimed by another worker: wait for its result, or for its claim to go
                    time.sleep(POLL_S)
                    for v in waiting:
                        shared = _shared_file(v.key, lineinfo)
                        if not shared.is_file() and not _claimer_alive(shared):
                            shared.with_suffix(".claim").unlink(missing_ok=True)
        finally:
            for shared in claimed:
                if shared is not None:
                    shared.with_suffix(".claim").unlink(missing_ok=True)
    return {v.key: _COMPILED[v.key, lineinfo] for v in variants}


def ptx_problems(ptx: str, hot: bool) -> list[str]:
    """What is wrong with a kernel's PTX: FP64 arithmetic anywhere; local memory in hot kernels."""
    problems = [f"FP64 instruction: {m.group(0).strip()}" for m in F64_OP.finditer(ptx)][:3]
    if hot and "__local_depot" in ptx:
        problems.append("uses local memory (__local_depot): a register array spilled or was indexed at run time")
    return problems


def check_compiled_clean(result: dict, hot: bool) -> None:
    """Assert that one kernel's compile_ptx result is PTX with none of ptx_problems."""
    assert "error" not in result, result.get("error")
    assert ptx_problems(result["ptx"], hot) == []
