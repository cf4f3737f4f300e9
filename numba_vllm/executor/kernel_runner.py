"""The kernel runner: a StepPlan -> one packed upload -> `DeviceModel.forward` -> sampled tokens.

The same code runs on the GPU (`cuda` backend) and, unchanged, in the Numba simulator (`sim`).
Sequences are reordered so prefilling ones (prompts or chunks) come first and decoding ones last,
matching the two attention kernels. A step is padded to a bucketed shape (`inputs.py`) and its
int32 inputs go to the device in one asynchronous copy (`staging.py`); then, unless
`enforce_eager`, a decode-only step is replayed from one CUDA graph (`cuda_graph.py`) and a step
with prefill tokens from piecewise graphs with its attention launched between them
(`piecewise_graphs.py`); with `enforce_eager` it runs kernel by kernel, on the same padded shapes, so
the tokens are the same either way. Sampling happens on the device (inside the graph for a replayed
step): greedy rows by argmax, temperature-only rows by the Gumbel-max kernel (noise from the
request's seed and output index, so a request's tokens do not depend on its batch); rows with top-k,
top-p or min-p copy their logits to the host sampler.

Logits edits, token masks and logprobs (`_edit_and_mask`, `_sampled_logprobs`, `_prompt_logprobs`):
rows with penalties, logit_bias, min_tokens or bad_words are edited on the device in the step's
logits buffer, then rows with a structured-output constraint have the tokens their grammar forbids
set to -inf (`kernels/logits_mask.py`; their bitmasks are computed on the host while the device runs
the step's forward pass, `TokenMasks`), so every sampler, the host's included, sees edited and
masked logits. An eager step does this before its sampler runs; a step replayed from graphs samples
inside them (the decode graph, the piecewise head graph), so its rows are edited and masked after
the graph and sampled again (the samplers are deterministic: untouched rows draw the same tokens),
before the tokens are downloaded. Rows that want logprobs have their raw logits copied aside first
(vLLM's logprobs are the model's, unedited and unmasked). Logprobs are computed when the step is
collected: of the sampled tokens from the raw logits, of prompt tokens from the head run again over
the chunk's positions. Such a step does not feed the next (`KernelStep.feeds_next`): the edits count
each request's output on the host, the next mask needs this step's token advanced through the
grammar on the host, and the logprobs read the step's buffers, which the next step would overwrite.

A step is launched and collected apart (`launch` queues everything on the runner's stream and
returns; `collect` waits for its tokens), so the engine can schedule and launch step n+1 while step
n runs. A decoding sequence whose last token was sampled by the previous step and is not on the host
yet (its token id is None in the plan) gets it on the device: the previous step's sampled tokens are
copied into this step's token ids (`gather_rows`) before its first kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import pages_for_tokens
from numba_vllm.engine.logprobs import PositionLogprobs
from numba_vllm.engine.request import Request
from numba_vllm.engine.scheduler import ScheduledSequence, StepPlan
from numba_vllm.engine.structured import bitmask_words, fill_token_bitmasks
from numba_vllm.executor.capacity import Capacity
from numba_vllm.executor.cuda_graph import DecodeGraphs, GraphRecorder
from numba_vllm.executor.host_sampling import RequestSamplers
from numba_vllm.executor.inputs import SamplingRows, StepLayout, bucket, null_sequences, table_width
from numba_vllm.executor.numpy_runner import prompt_logprob_targets
from numba_vllm.executor.piecewise_graphs import PiecewiseGraphs
from numba_vllm.executor.staging import StagingSlot, StepStaging
from numba_vllm.kernels._launch import launching_on
from numba_vllm.kernels.gather import gather_rows
from numba_vllm.kernels.logits_edits import edit_logits
from numba_vllm.kernels.logits_mask import apply_token_bitmask
from numba_vllm.kernels.logprobs import logprobs
from numba_vllm.model.llama import DeviceModel, StepInputs

SEED_MASK = 0xFFFFFFFF  # the device sampler takes 32-bit seeds


@dataclass(eq=False)
class KernelStep:
    """A launched step: what `collect` needs, and what the next step needs to be fed from it."""

    requests: list[Request]  # the sampling sequences' requests, in row order
    rows: dict[str, int]  # request id -> its row of the sampled tokens
    host_rows: list[int]  # rows whose token the host samples at collect time (top-k / top-p / min-p)
    slot: StagingSlot
    edited: list[int] = field(default_factory=list)  # rows whose logits are edited before sampling
    constrained: list[int] = field(default_factory=list)  # rows with a structured-output constraint (masked before sampling)
    logprob_rows: list[int] = field(default_factory=list)  # rows that want their sampled token's logprobs
    prompt_targets: list[tuple[Request, int, int, np.ndarray]] = field(default_factory=list)
    # ^ per sequence that wants prompt logprobs: (request, its first token row in the step, first prompt index, ids (P,))
    raw: object = None  # (R, V) f32 device: the raw logits of logprob_rows, copied before edits and masks (None: untouched)
    edit_inputs: tuple = ()  # the edits kernel's device inputs, kept until the step is collected
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # set by collect: id -> sampled token's
    prompt_logprobs: dict[str, tuple[int, PositionLogprobs]] = field(default_factory=dict)  # id -> (first index, logprobs)

    @property
    def feeds_next(self) -> bool:
        """Whether the next step may be launched before this one is collected: its sampled tokens
        are final on the device (no row waits for the host sampler, which reads this step's logits),
        no row's edits count its output on the host, no grammar must see its token before the next
        step's masks can be computed, and no logprobs wait on its buffers."""
        return not (self.host_rows or self.edited or self.constrained or self.logprob_rows or self.prompt_targets)


class KernelRunner:
    """Owns the device model, its KV pool and step buffers, the staging and the graphs; runs steps."""

    def __init__(self, model: DeviceModel, capacity: Capacity, engine_config: EngineConfig, graphs: str = "none"):
        """Allocate the KV cache and step buffers `capacity` plans for. `graphs`: "capture" replays
        steps from CUDA graphs, "emulate" runs them eagerly on the graphs' inputs (the simulator's
        stand-in, for tests), "none" runs every step eagerly."""
        self.model = model
        self.num_pages = capacity.num_pages
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_step_tokens = capacity.max_step_tokens
        model.allocate(capacity.num_pages, capacity.max_step_tokens, engine_config.max_num_seqs)
        self.layout = StepLayout(capacity.max_step_tokens, self.max_num_seqs, pages_for_tokens(capacity.max_model_len))
        self.stream = cuda.stream()  # every step's copies and kernels, in order
        self.staging = StepStaging(self.layout, self.stream)
        recorder = GraphRecorder(self.staging.launch_stream) if graphs == "capture" else None
        self.decode_graphs = None if graphs == "none" else DecodeGraphs(model, recorder)
        self.piecewise_graphs = None if graphs == "none" else PiecewiseGraphs(model, recorder)
        self.host_samplers = RequestSamplers()
        self.token_masks = TokenMasks(model.config.vocab_size, self.max_num_seqs, self.stream)
        self._seeds: dict[str, int] = {}
        self._seed_rng = np.random.default_rng()
        self._latest: KernelStep | None = None  # the step launched last

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run a step and return its sampled tokens: `collect(launch(plan))`."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan, previous: KernelStep | None = None) -> KernelStep:
        """Queue the step on the device and return at once. `previous`: the step launched just before,
        whose sampled tokens feed this plan's decoding sequences whose token is None."""
        seqs, fed_sources = self._order(plan.sequences, previous)
        if fed_sources and (previous is not self._latest or not previous.feeds_next):
            raise ValueError("launch: unknown tokens are fed only from the step launched just before, sampled on the device")
        requests = [s.request for s in seqs if s.samples]
        host_rows = [i for i, r in enumerate(requests) if _host_sampled(r)]
        step = KernelStep(requests, {r.request_id: i for i, r in enumerate(requests)}, host_rows, None)
        _find_logits_work(step, seqs)
        step.slot = self.staging.take_slot(step)
        packed = self.layout.pack(step.slot.host, seqs, self._sampling_rows(requests), fed_sources)
        shape = packed.shape
        with launching_on(self.staging.launch_stream):
            self.staging.upload(step.slot, packed)
            inputs, sampler = self.staging.views(shape)
            if fed_sources:  # the previous step's samples -> this step's token ids, on the device
                sources, rows = self.layout.fed_views(self.staging.device, packed)
                gather_rows(self.staging.tokens_2d, sources, rows)
            sampled_in_graph = True
            if self.decode_graphs is not None and DecodeGraphs.handles(shape):
                self.decode_graphs.run(shape, inputs, sampler)  # forward and sampler
            elif self.piecewise_graphs is not None:
                self.piecewise_graphs.run(shape, inputs, sampler)  # pieces, attentions, then head and sampler
            else:
                sampled_in_graph = False
                logits = self.model.forward(inputs)  # (B, V), queued: the masks are computed while it runs
                self._edit_and_mask(step, logits)
                self.model.sample(logits, sampler)
            if sampled_in_graph and (step.edited or step.constrained):  # sampled from untouched rows: again
                logits = self.model.buffers["logits"][: sampler.tokens.shape[0]]  # (B', V) this step's padded rows
                self._edit_and_mask(step, logits)
                self.model.sample(logits, sampler)
            self.staging.download(step.slot, packed.num_sampled)
        self._latest = step
        return step

    def collect(self, step: KernelStep) -> dict[str, int]:
        """Wait for a launched step; its sampled token per request id."""
        if step.slot.owner is not step:
            raise RuntimeError("collect: a later step has taken this step's slot; collect each step before the next but one")
        step.slot.event.synchronize()
        tokens = step.slot.tokens[: len(step.requests)].tolist()
        if not step.feeds_next and self._latest is not step:
            raise RuntimeError("collect: a step that reads its logits when collected must be collected before the next launch")
        if step.host_rows:
            logits = self.model.buffers["logits"]  # (>= B, V) this step's (edited), as no later step has run
            for i in step.host_rows:
                tokens[i] = self.host_samplers.sample(step.requests[i], logits[i].copy_to_host())
        if step.logprob_rows:
            self._sampled_logprobs(step, tokens)
        if step.prompt_targets:
            self._prompt_logprobs(step)
        return dict(zip((r.request_id for r in step.requests), tokens, strict=True))

    def release(self, request_id: str) -> None:
        self.host_samplers.release(request_id)
        self._seeds.pop(request_id, None)

    def inputs_for(self, seqs: list[ScheduledSequence]) -> StepInputs:
        """Pack and upload the inputs of a step of `seqs` (prefilling first) and wait: what `launch`
        hands the model (for tracing a step op by op)."""
        slot = self.staging.take_slot(None)
        packed = self.layout.pack(slot.host, seqs, self._sampling_rows([s.request for s in seqs if s.samples]))
        self.staging.upload(slot, packed)
        self.stream.synchronize()
        return self.staging.views(packed.shape)[0]

    @staticmethod
    def _order(sequences: list[ScheduledSequence], previous: KernelStep | None) -> tuple[list[ScheduledSequence], list[int]]:
        """Prefilling sequences first, then decoding ones, those fed from `previous` last (slot order
        within each); and each fed one's row of the previous step's samples."""
        prefill = [s for s in sequences if not s.is_decode]
        decode = [s for s in sequences if s.is_decode and s.token_ids[0] is not None]
        fed = [s for s in sequences if s.is_decode and s.token_ids[0] is None]
        sources = []
        for s in fed:
            row = previous.rows.get(s.request.request_id) if previous is not None else None
            if row is None:
                raise ValueError(f"request {s.request.request_id}: its token is unknown and the previous step did not sample it")
            sources.append(row)
        return prefill + decode + fed, sources

    # ---- warming up ----------------------------------------------------------------------------
    def warm_up(self, max_pages: int) -> None:
        """Compile every kernel variant a step can use and record the graphs, before the first
        request: otherwise the first steps of each new shape pay for it (a second or so per kernel).
        Each run is a dummy step whose tokens all read and write the null page (`null_sequences`);
        the KV cache of real sequences is not touched.

        One step per token bucket (a prompt and up to max_num_seqs - 1 decodes). Every step is padded
        to a bucket, so these are all the shapes a product can have: every gemv variant, every tiling
        and K split the tensor-core GEMMs pick (a cached prefix's short chunk included), both
        attention kernels, the sampler; with graphs, each bucket's pieces and head are recorded. Then
        the logits edits, token mask and logprobs kernels, and the decode graphs of sequences up to `max_pages` pages.
        """
        for num_tokens in self.layout.token_sizes:
            num_decodes = min(num_tokens, self.max_num_seqs) - 1
            self.execute(StepPlan(null_sequences(num_tokens - num_decodes, num_decodes), [], 0, 0))
        self._warm_up_logits_work()
        self.record_decode_graphs(max_pages)

    def _warm_up_logits_work(self) -> None:
        """Compile the logits edits, token mask and logprobs kernels, on row 0 of the logits buffer
        (no entries; every token allowed)."""
        logits = self.model.buffers["logits"][:1]  # (1, V)
        no_entries = (np.zeros(1, np.int32), np.zeros(2, np.int32), *[np.zeros(0, np.int32)] * 3, np.zeros(0, np.float32),
                      np.ones((1, 3), np.float32))  # fmt: skip
        edit_logits(logits, *(cuda.to_device(a) for a in no_entries))
        all_allowed = np.full((1, bitmask_words(logits.shape[1])), -1, np.int32)  # (1, ceil(V / 32)): every bit set
        apply_token_bitmask(logits, cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(all_allowed))
        device_logprobs(logits, np.zeros(1, np.int32), np.zeros(1, np.int32), 0)

    def record_decode_graphs(self, max_pages: int) -> None:
        """Make every decode graph a sequence of up to `max_pages` pages can need, now (each (B, W)
        run once on padding rows only), so that no later step pays for compiling and recording."""
        if self.decode_graphs is None:
            return
        widths = sorted({table_width(p) for p in range(1, max_pages + 1)})
        for batch in self.layout.batch_sizes:
            for width in widths:
                if not self.decode_graphs.has(batch, width):
                    self.execute(StepPlan(null_sequences(0, batch, width), [], 0, 0))

    # ---- logits edits and logprobs -------------------------------------------------------------
    def _edit_and_mask(self, step: KernelStep, logits) -> None:
        """Queue, on the launch stream, before the step's (next) sampler: the raw logits of the
        logprob rows copied aside (into `step.raw`), the edits of `step.edited`, then the token masks
        of `step.constrained`, applied to `logits` (B', V) (the step's logits buffer) in place. Nothing
        when no row is edited or constrained."""
        if not (step.edited or step.constrained):
            return
        stream = self.stream
        if step.logprob_rows:
            step.raw = cuda.device_array((len(step.logprob_rows), logits.shape[1]), np.float32)  # (R, V)
            gather_rows(logits, cuda.to_device(np.array(step.logprob_rows, np.int32), stream=stream), step.raw)
        if step.edited:
            step.edit_inputs = tuple(cuda.to_device(a, stream=stream) for a in _edit_entries(step))
            edit_logits(logits, *step.edit_inputs)
        if step.constrained:
            self.token_masks.apply(logits, step.constrained, step.requests)

    def _sampled_logprobs(self, step: KernelStep, tokens: list[int]) -> None:
        """Logprobs of the sampled `tokens` of `step.logprob_rows`, from the raw logits (the copy made
        before the edits, else the step's logits buffer), into `step.logprobs`."""
        rows = step.logprob_rows
        if step.raw is not None:
            logits, at = step.raw, np.arange(len(rows), dtype=np.int32)
        else:
            logits, at = self.model.buffers["logits"], np.array(rows, np.int32)
        chosen = np.array([tokens[i] for i in rows], np.int32)
        k = max(step.requests[i].sampling_params.logprobs for i in rows)
        computed = device_logprobs(logits, at, chosen, k)  # (R,) positions, the top k of the most asked
        for p, i in enumerate(rows):
            own = step.requests[i].sampling_params.logprobs
            step.logprobs[step.requests[i].request_id] = _position(computed, p, own)

    def _prompt_logprobs(self, step: KernelStep) -> None:
        """Logprobs of the prompt tokens the step's chunks predict, into `step.prompt_logprobs`: the
        head run again over each chunk's positions (prefilling sequences' rows lead the step, in
        order), `max_num_seqs` rows at a time (padded to a batch bucket by repeating the last row,
        so the head's products have shapes warm-up compiled), then the logprobs kernel. Overwrites
        the step's logits."""
        for request, first_row, first, targets in step.prompt_targets:
            k = request.sampling_params.prompt_logprobs
            parts = []
            for start in range(0, len(targets), self.max_num_seqs):
                chunk = targets[start : start + self.max_num_seqs]  # (P',)
                rows = np.full(bucket(self.layout.batch_sizes, len(chunk)), first_row + start + len(chunk) - 1, np.int32)
                rows[: len(chunk)] = np.arange(first_row + start, first_row + start + len(chunk))  # (P'' >= P',)
                logits = self.model.head_rows(cuda.to_device(rows))  # (P'', V)
                parts.append(device_logprobs(logits, np.arange(len(chunk), dtype=np.int32), chunk, k))
            step.prompt_logprobs[request.request_id] = (first, _concat(parts))

    # ---- sampling ------------------------------------------------------------------------------
    def _sampling_rows(self, requests: list[Request]) -> SamplingRows:
        """The device sampler's per-row inputs: temperature (0 = greedy), seed, output index."""
        params = [r.sampling_params for r in requests]
        return SamplingRows(
            temperatures=np.array([0.0 if p.greedy else p.temperature for p in params], np.float32),
            seeds=np.array([self._seed(r) if not p.greedy else 0 for r, p in zip(requests, params, strict=True)], np.uint32),
            steps=np.array([len(r.output_token_ids) for r in requests], np.int32),
        )

    def _seed(self, request) -> int:
        """The request's 32-bit sampling seed: its own, or one drawn once for it."""
        seed = self._seeds.get(request.request_id)
        if seed is None:
            given = request.sampling_params.seed
            seed = given & SEED_MASK if given is not None else int(self._seed_rng.integers(0, SEED_MASK))
            self._seeds[request.request_id] = seed
        return seed


class TokenMasks:
    """Structured output's token masks of a step: each constrained row's bitmask computed on the host
    (llguidance, while the device runs the step's forward pass), copied to the device and applied to
    the logits there. A step with no constrained row computes, copies and launches nothing."""

    def __init__(self, vocab_size: int, max_rows: int, stream):
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.stream = stream  # the runner's numba stream: copies in order with the step's kernels
        self._rows = None  # (max_rows,) int32 device: the constrained rows' indices
        self._bitmask = None  # (max_rows, ceil(V / 32)) int32 device: their masks (made at the first constrained step)

    def apply(self, logits, rows: list[int], requests: list[Request]) -> None:
        """Compute the masks of `rows` (rows of `logits` (B, V) device, row i for requests[i], each with
        a grammar) and queue their application on the stream."""
        if self._bitmask is None:
            self._rows = cuda.device_array(self.max_rows, np.int32)
            self._bitmask = cuda.device_array((self.max_rows, bitmask_words(self.vocab_size)), np.int32)
        c = len(rows)
        bitmask = np.empty((c, bitmask_words(self.vocab_size)), np.int32)  # (C, ceil(V / 32)), pageable:
        fill_token_bitmasks([requests[i].grammar for i in rows], bitmask)  # an async copy from it is staged at once
        device_rows, device_bitmask = self._rows[:c], self._bitmask[:c]
        device_rows.copy_to_device(np.array(rows, np.int32), stream=self.stream)
        device_bitmask.copy_to_device(bitmask, stream=self.stream)
        apply_token_bitmask(logits, device_rows, device_bitmask)


def _host_sampled(request: Request) -> bool:
    """Rows with top-k, top-p or min-p are sampled on the host (the device samplers do none of them)."""
    p = request.sampling_params
    return not p.greedy and bool(p.top_k or p.top_p < 1 or p.min_p > 0)


def _find_logits_work(step: KernelStep, seqs: list[ScheduledSequence]) -> None:
    """Fill in the step's edited rows, constrained rows, logprob rows and prompt-logprob sequences, in one pass over
    `seqs` (in the step's order: prefilling first, their tokens' rows leading the step)."""
    row = 0
    for i, s in enumerate(seqs):
        r = s.request
        p = r.sampling_params
        if s.samples:
            if p.logprobs is not None:
                step.logprob_rows.append(row)
            if r.logits_edits is not None:
                step.edited.append(row)
            if r.grammar is not None:
                step.constrained.append(row)
            row += 1
        if p.prompt_logprobs is not None:
            targets = prompt_logprob_targets(s)
            if targets is not None:  # its first token's row: after the tokens of the sequences before it
                step.prompt_targets.append((r, sum(q.num_new_tokens for q in seqs[:i]), *targets))


def _edit_entries(step: KernelStep) -> tuple[np.ndarray, ...]:
    """The edits kernel's inputs for `step.edited`: rows (E,), offsets (E + 1,), then every row's
    entries concatenated: tokens, flags, counts (N,) int32, bias (N,) float32; penalties (E, 3) float32."""
    edits = [step.requests[i].logits_edits.row(step.requests[i].output_token_ids) for i in step.edited]
    offsets = np.zeros(len(edits) + 1, np.int32)
    offsets[1:] = np.cumsum([len(e.tokens) for e in edits])
    entries = (np.concatenate([getattr(e, name) for e in edits]) for name in ("tokens", "flags", "counts", "bias"))
    penalties = np.array([e.penalties for e in edits], np.float32).reshape(len(edits), 3)
    return (np.array(step.edited, np.int32), offsets, *entries, penalties)


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


_FIELDS = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")


def _position(pos: PositionLogprobs, p: int, k: int) -> PositionLogprobs:
    """Position p of `pos` alone, with its top k."""
    token_ids, lps, ranks, top_ids, top_lps = (getattr(pos, n)[p : p + 1] for n in _FIELDS)
    return PositionLogprobs(token_ids, lps, ranks, top_ids[:, :k], top_lps[:, :k])


def _concat(parts: list[PositionLogprobs]) -> PositionLogprobs:
    return PositionLogprobs(*(np.concatenate([getattr(p, n) for p in parts]) for n in _FIELDS))
