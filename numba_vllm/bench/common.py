"""What the benchmarks share: the model, the engine and its options, the clock, tables and JSON.

Timing: `LLMEngine.step()` returns only once the step's tokens are on the host (the runner copies the
sampled ids back), so `time.perf_counter()` around a step measures the whole step, device work
included. Only the ends of a run need an explicit `cuda.synchronize()`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import pages_for_tokens
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint, random_checkpoint
from numba_vllm.model.config import ModelConfig

TOKEN_ID_HIGH = 10000  # prompt token ids are uniform in [0, TOKEN_ID_HIGH) (capped by the vocabulary)
DEFAULT_PEAK_BANDWIDTH_TBS = 4.24  # H200 device-to-device copy bandwidth, TB/s (bytes read + written)
LLAMA_3_2_1B_CONFIG_DIR = "tests/data/llama-3.2-1b-instruct"  # in the repository: config.json of Llama 3.2 1B

Log = Callable[[str], None]


class BenchError(ValueError):
    """A benchmark cannot run as asked (bad sizes for the model, a missing feature): one line."""


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the model -----------------------------------------------------------------------------------
def load_model(model: str | None, random_weights: str | None, seed: int = 0) -> tuple[Checkpoint, str, float]:
    """The checkpoint to benchmark, a line describing it, and the seconds it took to load or build.

    `random_weights` is a directory with a Hugging Face `config.json`: bf16 weights are drawn in
    memory (speed does not depend on their values), so nothing is downloaded.
    """
    if (model is None) == (random_weights is None):
        raise BenchError(
            "give exactly one of --model PATH or --random-weights CONFIG_DIR "
            f"(Llama 3.2 1B shapes: --random-weights {LLAMA_3_2_1B_CONFIG_DIR})"
        )
    t0 = time.perf_counter()
    if random_weights is not None:
        ckpt = random_checkpoint(random_weights, seed=seed)
        what = f"random bf16 weights, config {random_weights}"
    else:
        ckpt = load_checkpoint(model)
        what = str(ckpt.source)
    return ckpt, what, time.perf_counter() - t0


def weight_bytes_per_decode_step(config: ModelConfig) -> int:
    """Bytes of weights one decode step must read: every matrix once, as bf16 (the device model keeps
    bf16 weights whatever the checkpoint's dtype). The embedding table is only gathered from (a row a
    token), so it counts only when it doubles as the head (tied embeddings)."""
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size  # the untied embedding: one row per token
    return 2 * params


def check_length(config: ModelConfig, max_model_len: int, what: str) -> None:
    if max_model_len > config.max_position_embeddings:
        raise BenchError(
            f"{what} need {max_model_len} positions; the model has max_position_embeddings {config.max_position_embeddings}"
        )


def random_token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """`n` token ids uniform in [0, 10000) (or the whole vocabulary when it is smaller)."""
    return rng.integers(0, min(TOKEN_ID_HIGH, vocab_size), int(n)).tolist()


# ---- the engine ----------------------------------------------------------------------------------
def engine_config_has(field_name: str) -> bool:
    """Whether this engine's EngineConfig has a field (the benchmarks pass newer settings only then)."""
    return field_name in {f.name for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine settings a benchmark exposes (the rest keep EngineConfig's defaults)."""

    backend: str = "cuda"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # cuda: no CUDA graphs (where the engine has them)
    async_scheduling: bool = True  # overlapped scheduling (where the engine has it)
    enable_prefix_caching: bool = True  # reuse cached prompt-prefix pages (where the engine has them)
    prefill_gemm: str = EngineConfig.prefill_gemm  # the kernels (EngineConfig's fields, where the engine has them)
    prefill_attention: str = EngineConfig.prefill_attention
    decode_attention: str = EngineConfig.decode_attention

    def engine_config(self, max_model_len: int, scheduling: str | None = None) -> EngineConfig:
        kwargs = dict(
            backend=self.backend,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            num_pages=self.num_pages,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        if scheduling is not None:
            if engine_config_has("scheduling"):
                kwargs["scheduling"] = scheduling
            elif scheduling != "continuous":
                raise BenchError(
                    f"scheduling {scheduling!r} needs EngineConfig.scheduling, which this engine does not have; "
                    "use --scheduling continuous"
                )
        if engine_config_has("enforce_eager"):
            kwargs["enforce_eager"] = self.enforce_eager
        elif self.enforce_eager:
            raise BenchError("--enforce-eager needs EngineConfig.enforce_eager, which this engine does not have")
        if engine_config_has("async_scheduling"):
            kwargs["async_scheduling"] = self.async_scheduling
        if engine_config_has("enable_prefix_caching"):
            kwargs["enable_prefix_caching"] = self.enable_prefix_caching
        for name in ("prefill_gemm", "prefill_attention", "decode_attention"):
            value = getattr(self, name)
            if engine_config_has(name):
                kwargs[name] = value
            elif value != EngineOptions.__dataclass_fields__[name].default:
                raise BenchError(f"--{name.replace('_', '-')} needs EngineConfig.{name}, which this engine does not have")
        return EngineConfig(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_engine(ckpt: Checkpoint, engine_config: EngineConfig):
    """An `LLMEngine` on the checkpoint, and the seconds it took (weights uploaded, cache allocated)."""
    from numba_vllm.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(ckpt, engine_config)
    synchronize(engine.backend)
    return engine, time.perf_counter() - t0


def synchronize(backend: str) -> None:
    if backend == "cuda":
        from numba import cuda

        cuda.synchronize()


def release_device_memory(backend: str) -> None:
    """Free what dropped engines held, now: numba defers device frees to a queue, and the next engine
    (or transformers) sizes its cache from the memory it finds free."""
    gc.collect()
    if backend == "cuda":
        from numba import cuda

        cuda.synchronize()
        ctx = cuda.current_context()
        for owner in (getattr(ctx, "memory_manager", None), ctx):  # device arrays queue on the memory manager
            pending = getattr(owner, "deallocations", None)
            if pending is not None:
                pending.clear()


def warm_up(engine, prompt_len: int, num_requests: int = 2, max_tokens: int = 3) -> float:
    """Run a few short greedy requests so every kernel a step uses is compiled (prefill, batched
    decode, sampling); returns the seconds taken. Benchmarks report this apart from their figures."""
    rng = np.random.default_rng(12345)
    prompt_len = max(1, min(prompt_len, engine.max_model_len - max_tokens - 1))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    if engine.backend == "cuda":
        engine.warm_up()  # every kernel variant and the common decode graphs (slow in the simulator: skipped there)
    outs = [
        engine.add_request(f"warmup-{i}", random_token_ids(rng, prompt_len, engine.config.vocab_size), params)
        for i in range(num_requests)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    synchronize(engine.backend)
    if not all(o.finished for o in outs):
        raise BenchError("the warm-up requests did not finish")
    return time.perf_counter() - t0


def record_decode_graphs(engine, max_tokens_per_sequence: int) -> float:
    """cuda: record the decode-step CUDA graphs every batch of the workload can need, before timing
    (a server does this at start-up); returns the seconds taken (0 without graphs)."""
    graphs = getattr(engine.runner, "decode_graphs", None)
    if graphs is None or not graphs.capture:
        return 0.0
    t0 = time.perf_counter()
    engine.runner.record_decode_graphs(pages_for_tokens(max_tokens_per_sequence))
    synchronize(engine.backend)
    return time.perf_counter() - t0


class DeviceMemory:
    """Peak device memory in use (total - free, as the driver reports it), sampled when asked; on the
    host backends there is none and `peak_gib` is None."""

    def __init__(self, backend: str):
        self.backend = backend
        self.peak_bytes: int | None = None

    def sample(self) -> None:
        if self.backend != "cuda":
            return
        from numba import cuda

        free, total = cuda.current_context().get_memory_info()
        used = int(total - free)
        self.peak_bytes = used if self.peak_bytes is None else max(self.peak_bytes, used)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / 2**30


def device_name(backend: str) -> str:
    if backend == "cuda":
        from numba import cuda

        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    if backend == "sim":
        return "Numba CUDA simulator (CPU)"
    return f"NumPy reference model ({platform.processor() or platform.machine()})"


def environment(backend: str) -> dict:
    """Versions and the device, recorded with every result."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {
        "device": device_name(backend),
        "python": platform.python_version(),
        "numba_vllm": ver("numba-vllm"),
        "numba": ver("numba"),
        "numba_cuda": ver("numba-cuda"),
        "numpy": np.__version__,
    }


# ---- statistics ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def ms_stats(seconds: Sequence[float]) -> dict:
    """Median, p90, mean, min and max of durations, in milliseconds (None entries when empty)."""
    if not seconds:
        return {"median_ms": None, "p90_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None}
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


# ---- output --------------------------------------------------------------------------------------
def count_text(n: int) -> str:
    """1236000000 -> '1.24B', 69952 -> '70.0K'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if suffix == 'B' else 1}f}{suffix}"
    return str(n)


def bytes_text(n: float) -> str:
    for scale, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def fmt(value, digits: int = 2) -> str:
    """A table cell: numbers rounded, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.{digits}f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain aligned text table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    out = [] if title is None else [title]
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


def check_json_path(path: str | None) -> None:
    """Fail before a long run, not after it, when the JSON file cannot be written there."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise BenchError(f"--json {path}: is a directory")
    if not p.parent.is_dir():
        raise BenchError(f"--json {path}: no such directory {p.parent}")


def write_json(path: str | None, result: dict) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
