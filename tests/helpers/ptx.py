"""Compile the kernel registry's variants to PTX without a GPU and inspect the result.

Compilation is ``numba_vllm.bench.kernel_report.compile_ptx`` (a child process with the simulator off,
the kernels, signatures and block sizes of its ``REGISTRY``). Results are kept for the test session,
so the PTX test files and the kernel report test compile each kernel once; under pytest-xdist they
are also written to a folder the run's workers share (``SHARED_DIR``, set by ``tests/conftest.py``),
so a variant one worker compiled is read, not compiled again, by the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from numba_vllm.bench import kernel_report

F64_OP = re.compile(r"^\s*[a-z][\w.]*\.f64\b", re.M)  # an instruction working on doubles
_COMPILED: dict[tuple[str, bool], dict] = {}  # (variant key, lineinfo) -> compile_ptx's result
SHARED_DIR: Path | None = None  # the xdist workers' common folder of results, one JSON file a variant


def _shared_file(key: str, lineinfo: bool) -> Path | None:
    if SHARED_DIR is None:
        return None
    return SHARED_DIR / f"{hashlib.sha1(key.encode()).hexdigest()}-{int(lineinfo)}.json"


def compile_ptx(variants, lineinfo: bool = False) -> dict[str, dict]:
    """{variant key: {'ptx', 'threads', 'max_registers'} or {'error': message}} for ``variants``.

    lineinfo: compile as ``make profile`` does (``NUMBA_VLLM_LINEINFO=1``: line tables in every kernel
    and device function).
    """
    missing = []
    for v in variants:
        if (v.key, lineinfo) in _COMPILED:
            continue
        shared = _shared_file(v.key, lineinfo)
        if shared is not None and shared.is_file():
            _COMPILED[v.key, lineinfo] = json.loads(shared.read_text())
        else:
            missing.append(v)
    if missing:
        for key, result in kernel_report.compile_ptx(missing, lineinfo).items():
            _COMPILED[key, lineinfo] = result
            shared = _shared_file(key, lineinfo)
            if shared is not None:  # written whole, then renamed: a reader never sees half a file
                partial = shared.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps(result))
                partial.replace(shared)
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
