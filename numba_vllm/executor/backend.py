"""Which backend runs the model, and building its runner with the engine's capacity.

Three backends behind one runner interface (`execute(plan) -> {request_id: token_id}`,
`release(request_id)`): `cuda` (the kernels on the GPU), `sim` (the same kernels in the Numba CUDA
simulator) and `numpy` (the float32 reference model). `auto` picks cuda when a GPU is usable.
"""

from __future__ import annotations

import os
import sys

from numba_vllm.engine.config import EngineConfig
from numba_vllm.executor.capacity import Capacity, max_step_tokens, plan_capacity
from numba_vllm.loading.checkpoint import Checkpoint


def resolve_backend(backend: str) -> str:
    """`auto` -> `cuda` when a GPU is usable, else `numpy`; `sim` requires the simulator to be on."""
    if backend == "auto":
        return "cuda" if gpu_available() else "numpy"
    if backend == "sim" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise ValueError("backend 'sim' needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported (numba-vllm run does this)")
    if backend == "cuda":
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            raise ValueError("backend 'cuda' cannot run with NUMBA_ENABLE_CUDASIM=1 set; use --backend sim")
        if not gpu_available():
            raise ValueError("backend 'cuda' needs an NVIDIA GPU with a working driver; none is usable here")
    return backend


def prepare_backend(backend: str) -> None:
    """Turn the simulator on for `sim` if numba's CUDA module is not imported yet (it reads the
    variable once, at import)."""
    if backend == "sim" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        if "numba.cuda" in sys.modules:
            raise ValueError("backend 'sim' must be chosen before numba.cuda is imported; set NUMBA_ENABLE_CUDASIM=1")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def gpu_available() -> bool:
    """Whether numba can use a real CUDA GPU here (never true under the simulator)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # no driver, broken install: no GPU
        return False


def create_runner(checkpoint: Checkpoint, engine_config: EngineConfig, backend: str):
    """(runner, Capacity) for a resolved `backend`: the weights are loaded where the model runs, the
    capacity planned with what is left, then the runner allocates the KV cache and step buffers."""
    config = checkpoint.config
    if backend == "numpy":
        from numba_vllm.executor.numpy_runner import NumpyRunner

        capacity = plan_capacity(config, engine_config, backend)
        return NumpyRunner(config, checkpoint.weights, capacity.num_pages), capacity

    from numba import cuda

    from numba_vllm.executor.kernel_runner import KernelRunner
    from numba_vllm.kernels._launch import num_sms
    from numba_vllm.model.llama import DeviceModel, buffer_bytes

    model = DeviceModel(
        config, checkpoint.weights, engine_config.prefill_gemm, engine_config.prefill_attention, engine_config.decode_attention
    )
    free = cuda.current_context().get_memory_info()[0] if backend == "cuda" else None
    step_bytes = buffer_bytes(config, max_step_tokens(engine_config, backend), engine_config.max_num_seqs, num_sms())
    capacity: Capacity = plan_capacity(config, engine_config, backend, free, step_bytes)
    graphs = "capture" if backend == "cuda" and not engine_config.enforce_eager else "none"
    return KernelRunner(model, capacity, engine_config, graphs=graphs), capacity
