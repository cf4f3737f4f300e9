"""The kernel runner: a StepPlan -> device arrays -> `DeviceModel.forward` -> sampled tokens.

The same code runs on the GPU (`cuda` backend) and, unchanged, in the Numba simulator (`sim`).
Sequences are reordered so prefilling ones (prompts or chunks) come first and decoding ones last,
matching the two attention kernels. Decode-only steps are replayed from CUDA graphs (`cuda_graph.py`)
unless `enforce_eager`; other steps launch kernel by kernel, with the step's int32 inputs packed into
one buffer and uploaded in one copy. Sampling happens on the device where it can (inside the graph
for a replayed step): greedy rows by argmax, temperature-only rows by the Gumbel-max kernel (noise
from the request's seed and output index, so a request's tokens do not depend on its batch); rows
with top-k or top-p copy their logits to the host sampler.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.logprobs import PositionLogprobs
from numba_vllm.engine.scheduler import ScheduledSequence, StepPlan
from numba_vllm.executor.capacity import Capacity
from numba_vllm.executor.cuda_graph import DecodeGraphs, SamplingRows
from numba_vllm.executor.host_sampling import RequestSamplers
from numba_vllm.executor.inputs import null_decode_step, null_prefill_step, step_arrays
from numba_vllm.executor.numpy_runner import prompt_logprob_targets
from numba_vllm.kernels.gather import gather_rows
from numba_vllm.kernels.logits_edits import edit_logits
from numba_vllm.kernels.logprobs import logprobs
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
        self.step_logprobs: dict[str, PositionLogprobs] = {}  # request id -> its sampled token's logprobs
        self.step_prompt_logprobs: dict[str, tuple[int, PositionLogprobs]] = {}  # id -> (first prompt index, logprobs)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        seqs = sorted(plan.sequences, key=lambda s: s.is_decode)  # prefill first (stable: slot order within)
        requests, logprob_rows, edited, prompt_logprobs = _sampling_rows_of(seqs)
        self.step_logprobs, self.step_prompt_logprobs = {}, {}
        if self.decode_graphs is not None and self.decode_graphs.handles(seqs):
            logits, tokens = self.decode_graphs.run(seqs, self._sampling_rows(requests))  # every row samples
            raw = self._edit(requests, edited, logits, logprob_rows)
            if edited:
                tokens = self.decode_graphs.resample()[: len(requests)]
        else:
            logits = self.model.forward(upload_inputs(*step_arrays(seqs)))  # (B, V) device
            raw = self._edit(requests, edited, logits, logprob_rows)
            tokens = self._sample_on_device(requests, logits)
        out = self._sample_on_host(requests, logits, [int(t) for t in tokens])
        if logprob_rows:
            self._sampled_logprobs(requests, logprob_rows, raw, out)
        if prompt_logprobs:
            self._prompt_logprobs(seqs)
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
        both attention kernels; the samplers, the logits edits and logprobs kernels.
        """
        for num_tokens in range(1, min(GEMV_MAX_TOKENS + 1, self.max_step_tokens) + 1):  # every gemv, then the GEMM
            step = null_decode_step(num_tokens, min(num_tokens, self.max_num_seqs))
            self._sample_all(self.model.forward(upload_inputs(step, 0, 0)))
        full = self.max_step_tokens - self.max_num_seqs  # a full token budget of one prompt
        sizes = [n for n in (2 << k for k in range(3, 20)) if n < full] + [full]  # 16, 32, ... and the full budget
        for num_tokens in sizes:
            self._sample_all(self.model.forward(upload_inputs(null_prefill_step(num_tokens), num_tokens, num_tokens)))
        logits = self.model.forward(upload_inputs(null_decode_step(1, 1), 0, 0))  # (1, V): the edits and logprobs kernels
        no_entries = [np.zeros(1, np.int32), np.zeros(2, np.int32)] + [np.zeros(0, np.int32)] * 3 + [np.zeros(0, np.float32)]
        edit_logits(logits, *(cuda.to_device(a) for a in no_entries), cuda.to_device(np.ones((1, 3), np.float32)))
        device_logprobs(logits, np.zeros(1, np.int32), np.zeros(1, np.int32), 0)
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

    # ---- edits and logprobs --------------------------------------------------------------------
    def _edit(self, requests, edited: list[int], logits, logprob_rows: list[int]):
        """Edit the rows `edited` of `logits` in place; return where the raw logits of `logprob_rows`
        are: (device array, its row of each): a copy made first when the step edits, else `logits`."""
        if not edited:
            return logits, np.array(logprob_rows, np.int32)
        raw = logits
        if logprob_rows:
            raw = cuda.device_array((len(logprob_rows), logits.shape[1]), np.float32)  # (R, V)
            gather_rows(logits, cuda.to_device(np.array(logprob_rows, np.int32)), raw)
        rows = [requests[i].logits_edits.row(requests[i].output_token_ids) for i in edited]
        offsets = np.zeros(len(rows) + 1, np.int32)
        offsets[1:] = np.cumsum([len(e.tokens) for e in rows])
        arrays = (
            np.array(edited, np.int32), offsets,
            *(np.concatenate([getattr(e, name) for e in rows]) for name in ("tokens", "flags", "counts", "bias")),
            np.array([e.penalties for e in rows], np.float32).reshape(len(rows), 3),
        )  # fmt: skip
        edit_logits(logits, *(cuda.to_device(a) for a in arrays))
        return raw, np.arange(len(logprob_rows), dtype=np.int32)

    def _sampled_logprobs(self, requests, logprob_rows: list[int], raw, tokens: list[int]) -> None:
        """Logprobs of the sampled tokens of `logprob_rows` from the raw logits (`_edit`'s result)."""
        logits, rows = raw
        chosen = np.array([tokens[i] for i in logprob_rows], np.int32)
        k = max(requests[i].sampling_params.logprobs for i in logprob_rows)
        for i, pos in zip(logprob_rows, _split(device_logprobs(logits, rows, chosen, k), len(logprob_rows)), strict=True):
            own_k = requests[i].sampling_params.logprobs
            pos.top_ids, pos.top_logprobs = pos.top_ids[:, :own_k], pos.top_logprobs[:, :own_k]
            self.step_logprobs[requests[i].request_id] = pos

    def _prompt_logprobs(self, seqs: list[ScheduledSequence]) -> None:
        """Logprobs of the prompt tokens this step's chunks predict, for the requests that ask: the
        head over those positions, `max_num_seqs` rows at a time, then the logprobs kernel."""
        offset = 0
        for s in seqs:
            first = prompt_logprob_targets(s)
            if first is not None:
                r = s.request
                targets = np.array(r.prompt_token_ids[first : min(s.context_len + 1, r.num_prompt_tokens)], np.int32)  # (P,)
                parts = []
                for start in range(0, len(targets), self.max_num_seqs):
                    chunk = targets[start : start + self.max_num_seqs]
                    rows = np.arange(offset + start, offset + start + len(chunk), dtype=np.int32)  # its tokens' rows in the step
                    logits = self.model.head(cuda.to_device(rows))
                    parts.append(device_logprobs(logits, np.arange(len(chunk)), chunk, r.sampling_params.prompt_logprobs))
                self.step_prompt_logprobs[r.request_id] = (first, _concat(parts))
            offset += s.num_new_tokens

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
        """Replace the device's pick for rows with top-k, top-p or min-p: their logits (edited) go to the host sampler."""
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.greedy and (p.top_k or p.top_p < 1 or p.min_p > 0):
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


def upload_inputs(parts: dict[str, np.ndarray], num_prefill_tokens: int, prefill_max_new_tokens: int) -> StepInputs:
    """Pack a step's int32 arrays (StepInputs' names) into one buffer, upload it in one copy, and
    return the StepInputs whose fields are views of it."""
    packed = cuda.to_device(np.concatenate([a.ravel() for a in parts.values()]).astype(np.int32, copy=False))
    views, start = {}, 0
    for name, a in parts.items():
        views[name] = packed[start : start + a.size].reshape(a.shape)
        start += a.size
    return StepInputs(**views, num_prefill_tokens=num_prefill_tokens, prefill_max_new_tokens=prefill_max_new_tokens)


def _sampling_rows_of(seqs: list[ScheduledSequence]) -> tuple[list, list[int], list[int], bool]:
    """(the requests that sample, in row order; the rows that want logprobs; the rows that edit their
    logits; whether any sequence wants prompt logprobs), in one pass: it runs every step."""
    requests, logprob_rows, edited, prompt_logprobs = [], [], [], False
    for s in seqs:
        r = s.request
        p = r.sampling_params
        if p.prompt_logprobs is not None:
            prompt_logprobs = True
        if s.samples:
            if p.logprobs is not None:
                logprob_rows.append(len(requests))
            if r.logits_edits is not None:
                edited.append(len(requests))
            requests.append(r)
    return requests, logprob_rows, edited, prompt_logprobs


def device_logprobs(logits, rows: np.ndarray, token_ids: np.ndarray, k: int) -> PositionLogprobs:
    """The logprobs kernel over rows (R,) of the device `logits`, for tokens (R,), top k; only the
    (R, k + 1) results come back."""
    n = len(rows)
    out_logprobs = cuda.device_array((n, k + 1), np.float32)
    out_ids = cuda.device_array((n, k + 1), np.int32)
    logprobs(logits, cuda.to_device(np.asarray(rows, np.int32)), cuda.to_device(np.asarray(token_ids, np.int32)), k,
             out_logprobs, out_ids)  # fmt: skip
    lp, ids = out_logprobs.copy_to_host(), out_ids.copy_to_host()
    return PositionLogprobs(np.asarray(token_ids, np.int32), lp[:, 0], ids[:, 0], ids[:, 1:], lp[:, 1:])


def _split(pos: PositionLogprobs, n: int) -> list[PositionLogprobs]:
    """One PositionLogprobs per position."""
    return [PositionLogprobs(*(a[i : i + 1] for a in (pos.token_ids, pos.logprobs, pos.ranks, pos.top_ids, pos.top_logprobs)))
            for i in range(n)]  # fmt: skip


def _concat(parts: list[PositionLogprobs]) -> PositionLogprobs:
    names = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")
    return PositionLogprobs(*(np.concatenate([getattr(p, n) for p in parts]) for n in names))
