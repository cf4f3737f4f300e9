"""The layers keep to their side: the engine (host policy) imports no numba."""

import subprocess
import sys

import pytest

NUMBA_MODULES = "sorted(m for m in sys.modules if m == 'numba' or m.startswith(('numba.', 'llvmlite')))"


@pytest.mark.parametrize("module", ["numba_vllm.engine", "numba_vllm.engine.llm_engine", "numba_vllm"])
def test_importing_the_engine_imports_no_numba(module):
    code = f"import sys, {module}; print({NUMBA_MODULES})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"{module} pulled in {out}"
