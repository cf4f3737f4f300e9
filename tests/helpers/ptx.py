"""Compile kernels to PTX without a GPU and inspect the result.

`cuda.compile_ptx` needs the real CUDA target, while the rest of the CPU suite runs under the
simulator, so compilation happens in a child process with the simulator off. Signatures are written
as Python expressions over `types` (numba.cuda.types) and the shorthands below, e.g.
`(f32(2), bf16(2), f32(2), int32)`: `f32(n)`, `bf16(n)`, `i32(n)`, `u32(n)`, `u16(n)` are
C-contiguous arrays of n dimensions. A kernel is named by its module and attribute, so kernels that
factories build are bound to names in tests/helpers/ptx_kernels.py, which lists every kernel the
PTX tests compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_CHILD = r"""
import importlib, json, sys, types as pytypes
from numba import cuda
from numba.cuda import dispatcher, types
# Device functions are compiled for the current device's compute capability; there is no device
# here, so answer for the Hopper target the PTX is built for.
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
def _arr(dt):
    return lambda n: types.Array(dt, n, "C")
ns = dict(types=types, f32=_arr(types.float32), bf16=_arr(types.bfloat16), i32=_arr(types.int32),
          u32=_arr(types.uint32), u16=_arr(types.uint16), int32=types.int32, float32=types.float32,
          uint32=types.uint32, int64=types.int64)
request = json.loads(sys.stdin.read())
out = {}
for module, attr, sig in request["specs"]:
    kernel = getattr(importlib.import_module(module), attr)
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, eval(sig, ns), cc=(9, 0), lineinfo=request["lineinfo"])
        out[f"{module}.{attr}"] = {"ptx": ptx}
    except Exception as e:
        out[f"{module}.{attr}"] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""

F64_OP = re.compile(r"^\s*[a-z][\w.]*\.f64\b", re.M)  # an instruction working on doubles


def compile_ptx(specs: list[tuple[str, str, str, bool]], lineinfo: bool = False) -> dict[str, dict]:
    """{'module.kernel': {'ptx': text} or {'error': message}} for (module, kernel attr, signature, hot)
    specs (``hot`` is for ptx_problems; compiling ignores it).

    lineinfo: compile as ``make profile`` does (``NUMBA_VLLM_LINEINFO=1``: line tables in every kernel
    and device function).
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # imports tests.helpers
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", NUMBA_VLLM_LINEINFO="1" if lineinfo else "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    request = json.dumps({"specs": [spec[:3] for spec in specs], "lineinfo": lineinfo})
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=request, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"PTX compilation child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
