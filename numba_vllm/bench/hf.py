"""The Hugging Face transformers peer for `--compare-hf`: the same model, the same weights, the same
workload, in the same process, after the engine has given its device memory back.

torch and transformers are imported inside these functions only: they are never dependencies of
the engine. The model is `transformers.LlamaForCausalLM` built from the checkpoint's config (its
Hugging Face `config.json` form) with bf16 parameters, SDPA attention, and the checkpoint's own
arrays copied in (bf16 bits reinterpreted, no rounding; a tied head shares the embedding matrix).
It runs on the GPU when the engine's backend is `cuda`, else on the CPU (smoke runs).

- latency: `model.generate` on the same B prompts, greedy, `max_new_tokens` = `min_new_tokens` = the
  output length (EOS cannot end it early). A logits processor notes the (synchronized) time each
  time the model hands over logits: the first is the end of prefill (TTFT), the gaps between the
  next ones are the decode steps. Per-token time = (total - prefill) / (output length - 1). With
  `compile=True`, a static cache and transformers' automatic `torch.compile` of the decode step
  (each batch size is warmed up with a full run first, so compilation is not timed).
- throughput: transformers' continuous batching (`continuous_batching_context_manager`, whose
  manager's `add_request` takes each request's own `max_new_tokens`; EOS disabled), all requests
  submitted at once, results collected as they finish. A transformers whose manager cannot take a
  per-request length falls back to one `generate_batch` call with the longest output length for
  every request, and says so in `note` (tokens/s then counts the tokens actually generated).
"""

from __future__ import annotations

import copy
import gc
import inspect
import time

import numpy as np

from numba_vllm.bench.common import BenchError, Log, log_stderr, ms_stats, ratio
from numba_vllm.loading.bf16 import BF16
from numba_vllm.loading.checkpoint import Checkpoint


def _import():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise BenchError(
            f"--compare-hf needs torch and transformers, which are not importable here ({e}); "
            "install them (pip install torch transformers) or leave --compare-hf out"
        ) from None
    return torch, transformers


def require(device: str) -> dict:
    """Check, before any benchmark runs, that the transformers peer can run on `device`; its versions."""
    torch, transformers = _import()
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--compare-hf on the cuda backend needs torch with CUDA, but torch.cuda.is_available() is False")
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def device_for(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _to_torch(torch, w: np.ndarray):
    """A checkpoint array as a CPU bf16 tensor: bf16 bits reinterpreted as is, other floats rounded."""
    w = np.ascontiguousarray(w)
    if w.dtype == BF16:
        bits = w.view(np.int16)
        if not bits.flags.writeable:
            bits = bits.copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.array(w, dtype=np.float32)).to(torch.bfloat16)


def build_model(ckpt: Checkpoint, device: str):
    """`LlamaForCausalLM` on `device` with the checkpoint's weights in bf16; and the seconds taken."""
    torch, _ = _import()
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    hf_config = LlamaConfig.from_dict(ckpt.config.to_dict())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created in bf16 (buffers such as RoPE's keep float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):
            pass  # keep what the model picked
    state = {name: _to_torch(torch, w) for name, w in ckpt.weights.items()}
    incompatible = model.load_state_dict(state, strict=False)
    missing = set(incompatible.missing_keys)
    tied = ckpt.config.tie_word_embeddings
    if incompatible.unexpected_keys or missing - ({"lm_head.weight"} if tied else set()):
        raise BenchError(
            f"the transformers model does not match the checkpoint: missing {sorted(missing)}, "
            f"unexpected {sorted(incompatible.unexpected_keys)}"
        )
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if tied and head.data_ptr() != embed.data_ptr():
        with torch.no_grad():
            head.copy_(embed)  # the tie was not kept: give the head the embedding's values
    for p in model.parameters():
        if p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
    model.eval()
    _sync(torch, device)
    return model, time.perf_counter() - t0


def _release(torch, device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _description(torch, transformers, device: str, what: str) -> str:
    return f"transformers {transformers.__version__}, torch {torch.__version__}, LlamaForCausalLM bf16 on {device}; {what}"


def _special_tokens(ckpt: Checkpoint) -> dict:
    eos = list(ckpt.config.eos_token_ids)
    return {"pad_token_id": eos[0] if eos else 0, "eos_token_id": eos or None}


# ---- latency -------------------------------------------------------------------------------------
def run_latency(ckpt: Checkpoint, device: str, prompts_by_batch: dict[int, list[list[int]]], output_len: int,
                compile: bool = False, log: Log = log_stderr) -> dict:  # fmt: skip
    """`generate` at each batch size on the given prompts; rows shaped like the engine's."""
    torch, transformers = _import()
    require(device)
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Notes when each step's logits are ready (synchronized); changes nothing."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            _sync(torch, device)
            self.times.append(time.perf_counter())
            return scores

    model, load_s = build_model(ckpt, device)
    log(f"[hf] model built in {load_s:.1f} s on {device}")
    base = dict(do_sample=False, **_special_tokens(ckpt))
    if compile:
        base["cache_implementation"] = "static"

    def generate(model, prompts, new_tokens, clock=None):
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        kwargs = dict(base, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        if clock is not None:
            kwargs["logits_processor"] = LogitsProcessorList([clock])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out.shape[1] - ids.shape[1]

    rows, warmup_s = [], 0.0
    try:
        for b, prompts in prompts_by_batch.items():
            t = time.perf_counter()
            generate(model, prompts, output_len if compile else min(8, output_len))  # compile needs the real shapes
            _sync(torch, device)
            warmup_s += time.perf_counter() - t
            clock = StepClock()
            _sync(torch, device)
            t0 = time.perf_counter()
            new = generate(model, prompts, output_len, clock)
            _sync(torch, device)
            total = time.perf_counter() - t0
            if new != output_len or len(clock.times) != output_len:
                raise BenchError(
                    f"transformers generated {new} tokens ({len(clock.times)} steps) at batch {b}, expected {output_len}"
                )
            prefill = clock.times[0] - t0
            stats = ms_stats(np.diff(clock.times).tolist())
            rows.append({
                "batch_size": b,
                "ttft_ms": prefill * 1e3,
                "decode_ms_median": stats["median_ms"],
                "decode_ms_p90": stats["p90_ms"],
                "decode_ms_mean": stats["mean_ms"],
                "per_token_ms": (total - prefill) / (output_len - 1) * 1e3,
                "decode_tokens_per_s": None if not stats["median_ms"] else b / (stats["median_ms"] * 1e-3),
                "output_tokens": b * new,
                "total_s": total,
            })  # fmt: skip
            log(f"[hf] batch {b}: ttft {prefill * 1e3:.1f} ms, decode median {stats['median_ms']:.2f} ms/step")
    finally:
        del model
        _release(torch, device)
    what = "generate(), greedy, " + ("static cache + torch.compile (auto)" if compile else "dynamic cache, eager")
    return {
        "description": _description(torch, transformers, device, what),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": device,
        "compile": compile,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "results": rows,
    }


# ---- throughput ----------------------------------------------------------------------------------
def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_throughput(ckpt: Checkpoint, device: str, prompts: list[list[int]], output_lens: list[int],
                   log: Log = log_stderr) -> dict:  # fmt: skip
    """The offline workload through transformers' continuous batching; a run shaped like the engine's."""
    torch, transformers = _import()
    require(device)
    from transformers import GenerationConfig

    model, load_s = build_model(ckpt, device)
    log(f"[hf] model built in {load_s:.1f} s on {device}; continuous batching, {len(prompts)} requests")
    # EOS left unset: transformers' continuous batching then disables it (-1), as ignore_eos does.
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), pad_token_id=_special_tokens(ckpt)["pad_token_id"])
    peak = [0]

    def sample_memory():
        if device == "cuda":
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], int(total - free))

    try:
        run = None
        cm = getattr(model, "continuous_batching_context_manager", None)
        if cm is not None:
            run = _run_manager(torch, cm, gen, prompts, output_lens, device, sample_memory)
        if run is None:
            run = _run_generate_batch(torch, model, gen, prompts, device, sample_memory)
    finally:
        del model
        _release(torch, device)
    generated = run.pop("output_tokens")
    elapsed = run["elapsed_s"]
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "description": _description(torch, transformers, device, run.pop("what")),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": device,
        "load_s": load_s,
        **run,
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "steps": None,
        "preemptions": None,
        "median_step_ms": None,
        "peak_device_memory_GiB": peak[0] / 2**30 if device == "cuda" else None,
        "expected_output_tokens": sum(output_lens),
        "output_tokens_ratio_to_expected": ratio(generated, sum(output_lens)),
    }


def _collect(manager, ids: set[str], sample_memory) -> dict:
    """Wait for every request in `ids` to finish; their outputs by request id."""
    results = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=1)
        sample_memory()
        if out is None:
            if not manager.is_running():
                raise BenchError(f"transformers' continuous batching stopped with {len(ids) - len(results)} requests unfinished")
            continue
        if getattr(out, "error", None):
            raise BenchError(f"transformers failed request {out.request_id}: {out.error}")
        if out.request_id in ids and out.is_finished():
            results[out.request_id] = out
    return results


def _workload_hints(prompts, output_lens):
    """What `generate_batch` tells the manager about its workload (it sizes the cache and batch from
    it), so the manager is set up as `generate_batch` would set it up; None where there is no such hint."""
    try:
        import dataclasses

        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    hints = {"max_prompt_length": max(len(p) for p in prompts), "max_generated_length": max(output_lens),
             "num_requests": len(prompts)}  # fmt: skip
    names = {f.name for f in dataclasses.fields(WorkloadHints)} if dataclasses.is_dataclass(WorkloadHints) else set(hints)
    return WorkloadHints(**{k: v for k, v in hints.items() if k in names})


def _run_manager(torch, cm, gen, prompts, output_lens, device, sample_memory) -> dict | None:
    """Per-request lengths through the continuous batching manager; None if its `add_request` cannot
    take a `max_new_tokens` (then the caller falls back to generate_batch)."""
    wanted = {"generation_config": gen, "block": True, "timeout": None, "warmup": True,
              "workload_hints": _workload_hints(prompts, output_lens)}  # fmt: skip
    kwargs = {k: v for k, v in wanted.items() if v is not None and _accepts(cm, k)} or {"generation_config": gen}
    t0 = time.perf_counter()
    with cm(**kwargs) as manager:
        if not _accepts(manager.add_request, "max_new_tokens"):
            return None
        eos = {"eos_token_id": -1} if _accepts(manager.add_request, "eos_token_id") else {}
        # warm-up (lazy initialization, first kernels): a short request, before the clock starts
        manager.add_request(input_ids=prompts[0][:32], request_id="warmup", max_new_tokens=4, **eos)
        _collect(manager, {"warmup"}, sample_memory)
        _sync(torch, device)
        warmup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        ids = {f"req-{i}" for i in range(len(prompts))}
        for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True)):
            manager.add_request(input_ids=p, request_id=f"req-{i}", max_new_tokens=int(n), **eos)
        results = _collect(manager, ids, sample_memory)
        _sync(torch, device)
        elapsed = time.perf_counter() - t1
    return {
        "what": "continuous batching (ContinuousBatchingManager.add_request with each request's max_new_tokens, EOS off)",
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "output_tokens": sum(len(r.generated_tokens) for r in results.values()),
        "per_request_output_lengths": True,
        "note": None,
    }


def _run_generate_batch(torch, model, gen, prompts, device, sample_memory) -> dict:
    t0 = time.perf_counter()
    warm = copy.deepcopy(gen)
    warm.max_new_tokens = 4
    model.generate_batch(inputs=[p[:32] for p in prompts[:2]], generation_config=warm, progress_bar=False)
    _sync(torch, device)
    warmup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    _sync(torch, device)
    elapsed = time.perf_counter() - t1
    sample_memory()
    if len(results) != len(prompts):
        raise BenchError(f"transformers' generate_batch returned {len(results)} of {len(prompts)} requests")
    return {
        "what": f"generate_batch (continuous batching) with max_new_tokens={gen.max_new_tokens} for every request",
        "warmup_s": warmup_s,
        "elapsed_s": elapsed,
        "output_tokens": sum(len(r.generated_tokens) for r in results.values()),
        "per_request_output_lengths": False,
        "note": (
            "this transformers cannot give each request its own max_new_tokens: every request was allowed "
            f"{gen.max_new_tokens} new tokens; tokens/s counts the tokens actually generated"
        ),
    }
