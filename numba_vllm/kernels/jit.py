"""The project's ``cuda.jit``: one place that knows which options the simulator rejects.

Kernels use ``@kernel(...)`` and device functions ``@device_function(...)`` instead of
``@cuda.jit``. On a GPU the options pass through unchanged. Under the simulator
(``NUMBA_ENABLE_CUDASIM=1``) the options its ``jit`` rejects (``lineinfo``, ``max_registers``,
``launch_bounds``, ``lto``, ``forceinline``) are dropped; they only tune code generation.

With ``NUMBA_VLLM_LINEINFO=1`` in the environment when a kernel is decorated, every kernel and
device function is compiled with ``lineinfo=True``: the cubin maps SASS back to the Python source
lines, so Nsight Compute's source view shows the hot lines of each kernel (``make profile``,
``docs/profiling.md``). Line tables do not change the generated code; under the simulator the
option is dropped like the others.

Launchers must configure the kernel at every call (``my_kernel[grid, block](...)``) and never
keep a configured launcher around: in the simulator, ``k[grid, block]`` reconfigures and returns
the kernel object itself, so two saved configurations of one kernel alias each other.
"""

import os

from numba import cuda

from numba_vllm.kernels.simulator import simulator_enabled

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
    return cuda.jit(*args, device=device, **options)


def kernel(*args, **options):
    """``cuda.jit`` for a global kernel: ``@kernel`` or ``@kernel(fastmath=True)``."""
    return _jit(args, options, device=False)


def device_function(*args, **options):
    """``cuda.jit(device=True)``: use as ``@device_function`` or ``@device_function(...)``."""
    return _jit(args, options, device=True)
