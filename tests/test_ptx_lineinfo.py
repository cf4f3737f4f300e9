"""Every kernel compiles with line information, as ``make profile`` builds them.

``NUMBA_VLLM_LINEINFO=1`` (``kernels/jit.py``) adds line tables to every kernel and device function,
so that Nsight Compute maps SASS back to the Python lines. NVVM then also receives debug records of
each device function's argument types, and it can reject a kernel that compiles without them: a
device function whose module is linked twice (once per specialisation of a caller) failed with
"Symbol name with unsupported characters" (gemm_tc's ``_w_pair``). And a kernel that calls a
function compiled elsewhere (``.extern .func``: numba's float32 -> bf16 store calls CUDA's C++
constructor) fails at link time, because the debug-info flags of the two modules conflict (rope's
cache stores did). Compiled without a GPU like the other PTX tests, for every kernel (one variant
each, every variant of gemv); the PTX must carry ``.loc`` directives that point at the kernel's
Python file.

NVVM also rejects some kernels for reasons that depend on how their optimised code comes out (gemv's
2- and 4-token RMSNorm variants, ``NVVM_REJECTS``); ``jit.py`` then compiles such a kernel without
line tables, with a warning, which the last test checks on a stand-in dispatcher. The kernels are the
registry's (``numba_vllm/bench/kernel_report.py``).
"""

import re
import types

import pytest

from numba_vllm.bench.kernel_report import REGISTRY
from tests.helpers import ptx as ptx_check

NVVM_REJECTS = {"gemv t2 norm", "gemv t4 norm"}  # "ERROR_COMPILATION" with line tables (numba-cuda 0.30, NVVM 13.5)


# Every kernel, in one variant each, and every variant of gemv (whose NVVM rejections depend on the
# variant): a line-table failure of the kinds above comes from a kernel's source and the device
# functions it calls, which its other tilings share. Half the registry's compile time.
FIRST_OF_EACH = {v.name: v for v in reversed(REGISTRY)}  # each kernel's first variant in the registry
VARIANTS = [v for v in REGISTRY if v.name == "gemv" or FIRST_OF_EACH[v.name] is v]


@pytest.mark.slow  # compiles ~40 variants (seconds each)
@pytest.mark.timeout(900)
def test_every_kernel_compiles_with_line_information():
    assert {v.name for v in VARIANTS} == {v.name for v in REGISTRY}
    result = ptx_check.compile_ptx(VARIANTS, lineinfo=True)
    failed = {name: r["error"] for name, r in result.items() if "error" in r}
    assert set(failed) == NVVM_REJECTS, failed  # a kernel leaving the set: NVVM accepts it now, drop it
    assert all("ERROR_COMPILATION" in e for e in failed.values()), failed
    result = {name: r for name, r in result.items() if name not in NVVM_REJECTS}
    for name, r in result.items():
        files = re.findall(r'^\s*\.file\s+\d+\s+"([^"]+)"', r["ptx"], re.MULTILINE)
        assert any(f.endswith(".py") for f in files), f"{name}: no Python source file in the line table"
        assert re.search(r"^\s*\.loc\s", r["ptx"], re.MULTILINE), f"{name}: no .loc directives"
        assert ".extern .func" not in r["ptx"], f"{name}: calls an external function, which will not link with line info"


class _Dispatcher:
    """The parts of a numba dispatcher that ``jit._line_info_optional`` uses; its compile fails with line info."""

    def __init__(self, fails_without_line_info=False):
        self.targetoptions = {"lineinfo": True}
        self.py_func = types.SimpleNamespace(__name__="some_kernel")
        self.compiled = []
        self.fails_without_line_info = fails_without_line_info

    def compile(self, signature):
        if self.targetoptions["lineinfo"] or self.fails_without_line_info:
            raise RuntimeError("ERROR_COMPILATION (9)")
        self.compiled.append(signature)
        return signature


def test_a_kernel_nvvm_rejects_with_line_info_compiles_without_and_warns():
    from numba_vllm.kernels.jit import _line_info_optional

    d = _line_info_optional(_Dispatcher())
    with pytest.warns(RuntimeWarning, match="some_kernel: compiled without line information.*ERROR_COMPILATION"):
        assert d.compile("sig1") == "sig1"
    assert d.targetoptions["lineinfo"] is False and d.compiled == ["sig1"]
    assert d.compile("sig2") == "sig2"  # later signatures go straight to no line tables

    broken = _line_info_optional(_Dispatcher(fails_without_line_info=True))  # a real compile error
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="ERROR_COMPILATION"):
        broken.compile("sig")
