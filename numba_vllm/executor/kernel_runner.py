"""The kernel runner: a StepPlan -> device arrays -> `DeviceModel.forward` -> sampled tokens.

The same code runs on the GPU (`cuda` backend) and, unchanged, in the Numba simulator (`sim`).
Sequences are reordered so prefilling ones (prompts or chunks) come first and decoding ones last,
matching the two attention kernels. Decode-only steps are replayed from CUDA graphs (`cuda_graph.py`)
unless `enforce_eager`; other steps launch kernel by kernel, with the step's int32 inputs packed into
one buffer and uploaded in one copy. Sampling happens on the device where it can (inside the graph
for a replayed step): greedy rows by argmax, temperature-only rows by the Gumbel-max kernel (noise
from the request's seed and output index, so a request's tokens do not depend on its batch); rows
with top-k or top-p copy their logits to the host sampler. Rows with a structured-output constraint
have their forbidden tokens set to -inf on the device first (`kernels/logits_mask.py`), so every
sampler, the host's included, sees the masked logits. Their bitmasks are computed on the host while
the device runs the forward pass (`TokenMasks`); in a replayed step, which samples inside the graph,
those rows are masked after it and the step's rows sampled again.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.scheduler import StepPlan
from numba_vllm.engine.structured import bitmask_words, fill_token_bitmasks
from numba_vllm.executor.capacity import Capacity
from numba_vllm.executor.cuda_graph import DecodeGraphs, SamplingRows
from numba_vllm.executor.host_sampling import RequestSamplers
from numba_vllm.executor.inputs import null_decode_step, null_prefill_step, step_arrays
from numba_vllm.kernels.logits_mask import apply_token_bitmask
from numba_vllm.kernels.matmul import GEMV_MAX_TOKENS
from numba_vllm.kernels.sample import argmax, sample_gumbel
from numba_vllm.model.llama import DeviceModel, StepInputs

SEED_MASK = 0xFFFFFFFF  # the device sampler takes 32-bit seeds


class KernelRunner:
    """Owns the device model, its KV pool and activation buffers; executes steps."""

    def __init__(self, model: DeviceModel, capacity: Capacity, engine_config: EngineConfig, graphs: str = "none"):
        """Allocate the KV cache and step buffers `capacity` plans for. `graphs`: "capture" replays
        decode steps from CUDA graphs, "emulate" runs them eagerly on the graphs' padded buffers (the
        simulator's stand-in, for tests), "none" runs every step eagerly."""
        self.model = model
        self.num_pages = capacity.num_pages
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_step_tokens = capacity.max_step_tokens
        model.allocate(capacity.num_pages, capacity.max_step_tokens, engine_config.max_num_seqs)
        self.decode_graphs = None if graphs == "none" else DecodeGraphs(model, self.max_num_seqs, capture=graphs == "capture")
        self.host_samplers = RequestSamplers()
        self._seeds: dict[str, int] = {}
        self._seed_rng = np.random.default_rng()

    def execute(self, plan: StepPlan) -> dict[str, int]:
        seqs = sorted(plan.sequences, key=lambda s: s.is_decode)  # prefill first (stable: slot order within)
        requests = [s.request for s in seqs if s.samples]
        masks = TokenMasks(requests, self.model.config.vocab_size)
        if self.decode_graphs is not None and self.decode_graphs.handles(seqs):
            # every row samples; the masks are computed on the host while the graph runs
            logits, tokens = self.decode_graphs.run(seqs, self._sampling_rows(requests), host_work=masks.compute)
            if masks.apply(logits):  # the graph sampled those rows unmasked: sample again
                tokens = self._sample_on_device(requests, logits[: len(requests)])
        else:
            logits = self.model.forward(upload_inputs(*step_arrays(seqs)))  # (B, V) device, still running
            masks.compute()
            masks.apply(logits)
            tokens = self._sample_on_device(requests, logits)
        out = self._sample_on_host(requests, logits, [int(t) for t in tokens])
        return dict(zip((r.request_id for r in requests), out, strict=True))

    def release(self, request_id: str) -> None:
        self.host_samplers.release(request_id)
        self._seeds.pop(request_id, None)

    # ---- warming up ----------------------------------------------------------------------------
    def warm_up(self, max_pages: int) -> None:
        """Compile every kernel variant a step can use, and record the decode graphs of sequences up
        to `max_pages` pages, before the first request: otherwise the first steps of each new shape
        pay for it (a second or so per kernel). Each run is a dummy step whose tokens all read and
        write the null page; the KV cache of real sequences is not touched.

        Variants: gemv per token count 1 .. GEMV_MAX_TOKENS; the tensor-core GEMM's tilings and K splits,
        which it picks by the product's shape (prefill steps of 16, 32, 64, ... tokens up to a full
        token budget: every tiling the step sizes can reach, a cached prefix's short chunks included);
        both attention kernels; the samplers.
        """
        for num_tokens in range(1, min(GEMV_MAX_TOKENS + 1, self.max_step_tokens) + 1):  # every gemv, then the GEMM
            step = null_decode_step(num_tokens, min(num_tokens, self.max_num_seqs))
            self._sample_all(self.model.forward(upload_inputs(step, 0, 0)))
        full = self.max_step_tokens - self.max_num_seqs  # a full token budget of one prompt
        sizes = [n for n in (2 << k for k in range(3, 20)) if n < full] + [full]  # 16, 32, ... and the full budget
        for num_tokens in sizes:
            self._sample_all(self.model.forward(upload_inputs(null_prefill_step(num_tokens), num_tokens, num_tokens)))
        if self.decode_graphs is not None:
            self.decode_graphs.record_all(max_pages)

    def _sample_all(self, logits) -> None:
        """Run both device samplers on every row (their results are dropped)."""
        rows = logits.shape[0]
        tokens = cuda.device_array(rows, np.int32)
        argmax(logits, tokens, self.model.sampler_workspace)
        ones = cuda.to_device(np.ones(rows, np.float32))
        zeros = cuda.to_device(np.zeros(rows, np.int32))
        sample_gumbel(logits, ones, cuda.to_device(np.zeros(rows, np.uint32)), zeros, tokens, self.model.sampler_workspace)
        tokens.copy_to_host()

    # ---- sampling ------------------------------------------------------------------------------
    def _sampling_rows(self, requests) -> SamplingRows:
        """The device sampler's per-row inputs: temperature (0 = greedy), seed, output index."""
        params = [r.sampling_params for r in requests]
        return SamplingRows(
            temperatures=np.array([0.0 if p.greedy else p.temperature for p in params], np.float32),
            seeds=np.array([self._seed(r) if not p.greedy else 0 for r, p in zip(requests, params, strict=True)], np.uint32),
            steps=np.array([len(r.output_token_ids) for r in requests], np.int32),
        )

    def _sample_on_device(self, requests, logits) -> np.ndarray:
        """One token per row of `logits` (B, V): argmax when every row is greedy, else the Gumbel-max sampler."""
        if not requests:
            return np.zeros(0, np.int32)
        tokens = cuda.device_array(len(requests), np.int32)
        if all(r.sampling_params.greedy for r in requests):
            argmax(logits, tokens, self.model.sampler_workspace)
        else:
            rows = self._sampling_rows(requests)
            temperatures, seeds, steps = (cuda.to_device(a) for a in (rows.temperatures, rows.seeds, rows.steps))
            sample_gumbel(logits, temperatures, seeds, steps, tokens, self.model.sampler_workspace)
        return tokens.copy_to_host()

    def _sample_on_host(self, requests, logits, tokens: list[int]) -> list[int]:
        """Replace the device's pick for rows with top-k or top-p: their logits go to the host sampler."""
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.greedy and (p.top_k or p.top_p < 1):
                tokens[i] = self.host_samplers.sample(r, logits[i].copy_to_host())
        return tokens

    def _seed(self, request) -> int:
        """The request's 32-bit sampling seed: its own, or one drawn once for it."""
        seed = self._seeds.get(request.request_id)
        if seed is None:
            given = request.sampling_params.seed
            seed = given & SEED_MASK if given is not None else int(self._seed_rng.integers(0, SEED_MASK))
            self._seeds[request.request_id] = seed
        return seed


class TokenMasks:
    """A step's structured-output masks: which rows are constrained and their bitmasks, computed on
    the host (while the device runs the step's forward pass), then applied to the logits on the device.
    A step with no constrained row computes, uploads and launches nothing."""

    def __init__(self, requests, vocab_size: int):
        self.requests = requests  # the step's sampling rows, row i for requests[i]
        self.vocab_size = vocab_size
        self.rows: list[int] = []  # the constrained rows
        self.bitmask: np.ndarray | None = None  # (len(rows), ceil(V / 32)) int32

    def compute(self) -> None:
        self.rows = [i for i, r in enumerate(self.requests) if r.grammar is not None]
        if self.rows:
            self.bitmask = np.empty((len(self.rows), bitmask_words(self.vocab_size)), np.int32)
            fill_token_bitmasks([self.requests[i].grammar for i in self.rows], self.bitmask)

    def apply(self, logits) -> bool:
        """Set the forbidden tokens' logits to -inf in the constrained rows of `logits` (B', V) device;
        whether there were any."""
        if not self.rows:
            return False
        apply_token_bitmask(logits, cuda.to_device(np.array(self.rows, np.int32)), cuda.to_device(self.bitmask))
        return True


def upload_inputs(parts: dict[str, np.ndarray], num_prefill_tokens: int, prefill_max_new_tokens: int) -> StepInputs:
    """Pack a step's int32 arrays (StepInputs' names) into one buffer, upload it in one copy, and
    return the StepInputs whose fields are views of it."""
    packed = cuda.to_device(np.concatenate([a.ravel() for a in parts.values()]).astype(np.int32, copy=False))
    views, start = {}, 0
    for name, a in parts.items():
        views[name] = packed[start : start + a.size].reshape(a.shape)
        start += a.size
    return StepInputs(**views, num_prefill_tokens=num_prefill_tokens, prefill_max_new_tokens=prefill_max_new_tokens)
