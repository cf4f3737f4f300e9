"""The project's ``cuda.jit``: one place that knows which options the simulator rejects.

Kernels use ``@kernel(...)`` and device functions ``@device_function(...)`` instead of
``@cuda.jit``. On a GPU the options pass through unchanged. Under the simulator
(``NUMBA_ENABLE_CUDASIM=1``) the options its ``jit`` rejects (``lineinfo``, ``max_registers``,
``launch_bounds``, ``lto``, ``forceinline``) are dropped; they only tune code generation.

With ``NUMBA_VLLM_LINEINFO=1`` in the environment when a kernel is decorated, every kernel and
device function is compiled with ``lineinfo=True``: the cubin maps SASS back to the Python source
lines, so Nsight Compute's source view shows the hot lines of each kernel (``make profile``,
``docs/profiling.md``). Line tables do not change the generated code; under the simulator the
option is dropped like the others. NVVM rejects a few kernels with line tables that it compiles
without them ("Symbol name with unsupported characters", depending on how the optimised code comes
out: gemv's 2- and 4-token RMSNorm variants with numba-cuda 0.30). Such a kernel is compiled again
without them, with a warning that names it: profiling goes on, without source lines for it.

Launchers must configure the kernel at every call (``my_kernel[grid, block](...)``) and never
keep a configured launcher around: in the simulator, ``k[grid, block]`` reconfigures and returns
the kernel object itself, so two saved configurations of one kernel alias each other.
"""

import os
import warnings

from numba import cuda
from numba.cuda.core import config as cuda_config

from numba_vllm.sim.warp import simulator_enabled

# numba-cuda warns at every launch of fewer than 128 blocks ("Grid size 8 will likely result in GPU
# under-utilization"). The engine sizes its grids on purpose (a decode step of one sequence has few
# rows to spread; split-K and split-context grids are chosen by the GPU's SM count), so the warning
# would only fill a server's log: it is turned off here, where every kernel is declared, unless the
# user set NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS (the variable also keeps it off when numba re-reads its
# configuration from the environment).
if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
    os.environ["NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"] = "0"
    cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = False

SIMULATOR_IGNORED_OPTIONS = ("lineinfo", "max_registers", "launch_bounds", "lto", "forceinline")
LINEINFO_ENV = "NUMBA_VLLM_LINEINFO"  # "1": compile with line information, for profilers


def lineinfo_requested() -> bool:
    """Whether ``NUMBA_VLLM_LINEINFO=1`` asks for line information in every kernel."""
    return os.environ.get(LINEINFO_ENV) == "1"


def _jit(args, options, device):
    if lineinfo_requested():
        options = {"lineinfo": True, **options}
    if simulator_enabled():
        options = {k: v for k, v in options.items() if k not in SIMULATOR_IGNORED_OPTIONS}
    jitted = cuda.jit(*args, device=device, **options)
    if device or not options.get("lineinfo"):  # (the simulator has dropped it)
        return jitted
    if hasattr(jitted, "py_func"):  # @kernel: the dispatcher
        return _line_info_optional(jitted)
    return lambda func: _line_info_optional(jitted(func))  # @kernel(...): a decorator


def _line_info_optional(dispatcher):
    """Let ``dispatcher`` (a kernel compiled with line tables) fall back to none where NVVM fails."""
    compile_with_line_info = dispatcher.compile

    def compile(signature):
        try:
            return compile_with_line_info(signature)
        except Exception as e:
            if not dispatcher.targetoptions.get("lineinfo"):
                raise  # not a line-table problem
            dispatcher.targetoptions["lineinfo"] = False  # this kernel's later signatures too
            warnings.warn(
                f"{dispatcher.py_func.__name__}: compiled without line information, which NVVM "
                f"rejected ({type(e).__name__}: {e}); the profiler shows no source lines for it",
                RuntimeWarning,
                stacklevel=2,
            )
            return compile_with_line_info(signature)

    dispatcher.compile = compile  # numba compiles a new signature through self.compile
    return dispatcher


def kernel(*args, **options):
    """``cuda.jit`` for a global kernel: ``@kernel`` or ``@kernel(fastmath=True)``."""
    return _jit(args, options, device=False)


def device_function(*args, **options):
    """``cuda.jit(device=True)``: use as ``@device_function`` or ``@device_function(...)``."""
    return _jit(args, options, device=True)
