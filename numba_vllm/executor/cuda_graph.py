"""Decode steps replayed from CUDA graphs: the ~200 launches of a step recorded once, replayed in one call.

Why: a plain numba launch spends 25-48 us marshalling its arguments in Python, so a decode step of
~200 launches costs 5-10 ms on the host while the GPU needs about 1 ms for it. A CUDA graph records
the launches once (grids, blocks, argument values) and the driver replays them at ~1 us per kernel.

What a graph freezes, and how each step still differs:
- argument values, pointers included: every array a kernel reads stays at one address. The step's
  inputs (token ids, positions, kv indices, context lengths, the sampling temperatures, seeds and
  output indices, block tables) live in one int32 device buffer per graph (temperatures as float32
  bits); each step fills its pinned host twin and uploads it with one copy, then replays.
- the sampler is in the graph too (`sample_gumbel`: greedy rows are a plain argmax), so a step is
  one upload, one replay and one 4-byte-per-row download of the sampled tokens.
- shapes: the batch size B and the block-table width W are baked into grids and strides. Graphs are
  keyed by (B, W) buckets: the batch is padded up to the next size in `batch_buckets` (a padding
  row decodes token 0 at position 0 into slot 0 of the null page, attends to that one slot, is
  sampled greedily, and its logits and token are ignored), the table width up to the next power of two pages.
- which kernels run: only decode-only steps are replayed. A step with prefill tokens has grids that
  depend on its chunk lengths and runs eagerly, launch by launch.

A graph is made the first time its (B, W) is needed: the step runs once eagerly on the graph's own
buffers (which compiles any kernel those shapes need, so nothing is loaded during the recording,
and gives this step's logits), then the same `DeviceModel.forward` call is recorded through
`kernels.launch.launching_on`. Replays are the same kernels on the same shapes as that eager run,
so their results are identical to it.

Under the simulator there is nothing to record: `capture=False` keeps everything else (buckets,
padding, the packed buffer) and runs the step eagerly on it, so CI checks the graph path's inputs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
from numba import cuda

from numba_vllm.engine.kv_cache import NULL_PAGE_ID
from numba_vllm.engine.scheduler import ScheduledSequence
from numba_vllm.errors import KernelError
from numba_vllm.executor.inputs import kv_index, table_width
from numba_vllm.kernels._launch import launching_on
from numba_vllm.kernels.sample import sample_gumbel
from numba_vllm.model.llama import DeviceModel, StepInputs


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are recorded for: 1, 2, 4, 8, then steps of 8 up to 128, of 16 up to 256,
    of 32 up to 512 ... (an eighth of the power of two below), capped at and including `max_num_seqs`.
    A batch is padded by less than an eighth of its size (past 8)."""
    sizes, n = [1, 2, 4], 8
    while n < max_num_seqs:
        sizes.append(n)
        n += max(8, (1 << (n.bit_length() - 1)) // 8)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


@dataclass
class SamplingRows:
    """Per-row inputs of the device sampler (numpy, one entry per sequence of the step)."""

    temperatures: np.ndarray  # (B,) float32, 0 = greedy
    seeds: np.ndarray  # (B,) uint32
    steps: np.ndarray  # (B,) int32: each request's output index


class _StepGraph:
    """One (B, W) bucket: its packed input buffer, host and device, its sampled tokens, and (once
    recorded) its graph.

    The int32 buffer holds, in order: token ids (B,), positions (B,), kv indices (B,), context
    lengths (B,), temperatures (B,) as float32 bits, seeds (B,) as uint32 bits, output indices (B,),
    block tables (B, W); `inputs` and the sampler's arrays are views of the device copy, so the
    graph reads them.
    """

    def __init__(self, batch: int, width: int, sample_rows):
        self.batch, self.width = batch, width
        self.host = cuda.pinned_array(7 * batch + batch * width, np.int32)  # page-locked: a fast upload
        self.device = cuda.to_device(self.host)
        b, d = batch, self.device
        self.inputs = StepInputs(
            token_ids=d[0:b],
            positions=d[b : 2 * b],
            kv_indices=d[2 * b : 3 * b],
            num_prefill_tokens=0,
            prefill_cu_seqlens=None,
            prefill_start_pos=None,
            prefill_block_tables=None,
            prefill_max_new_tokens=0,
            decode_context_lens=d[3 * b : 4 * b],
            decode_block_tables=d[7 * b :].reshape(b, width),
            sample_rows=sample_rows[:b],  # (B,) 0..B-1: every row samples
        )
        self.temperatures = d[4 * b : 5 * b].view(np.float32)
        self.seeds = d[5 * b : 6 * b].view(np.uint32)
        self.steps = d[6 * b : 7 * b]
        self.tokens = cuda.device_array(b, np.int32)  # (B,) the sampled tokens
        self.host_tokens = cuda.pinned_array(b, np.int32)
        self.graph = None  # cuda.core Graph once recorded
        self.logits = None  # (B, V) the device buffer forward writes

    def upload(self, seqs: list[ScheduledSequence], sampling: SamplingRows | None, stream=0) -> None:
        """Pack the decoding sequences' inputs (padding rows after them) and copy them to the device
        (queued on `stream` when given: the host buffer must then stay untouched until it has run)."""
        b, h, n = self.batch, self.host, len(seqs)
        h[: 7 * b] = 0  # padding rows: token 0, position 0, kv index 0 (null page, slot 0), greedy ...
        h[3 * b : 4 * b] = 1  # ... attending to that one slot
        tables = h[7 * b :].reshape(b, self.width)
        tables[:] = NULL_PAGE_ID
        for row, s in enumerate(seqs):
            h[row] = s.token_ids[0]
            h[b + row] = s.start_position
            h[2 * b + row] = kv_index(s.page_ids, s.start_position)
            h[3 * b + row] = s.context_len
            tables[row, : len(s.page_ids)] = s.page_ids
        if sampling is not None:
            h[4 * b : 4 * b + n] = sampling.temperatures.view(np.int32)
            h[5 * b : 5 * b + n] = sampling.seeds.view(np.int32)
            h[6 * b : 6 * b + n] = sampling.steps
        if stream:
            copy_async(self.device, self.host, stream)
        else:
            self.device.copy_to_device(self.host)

    def forward_and_sample(self, model: DeviceModel) -> None:
        """What the graph holds: the model's step, then the sampler on every row."""
        self.logits = model.forward(self.inputs)
        sample_gumbel(self.logits, self.temperatures, self.seeds, self.steps, self.tokens, model.sampler_workspace)


def copy_async(dst, src, stream) -> None:
    """Queue a copy of a whole array between pinned host memory and the device on `stream`.

    numba's `copy_to_device` / `copy_to_host` spend ~90 / ~16 us in Python per call (they slice and
    check the arrays); the driver-level copies below them take ~4 us. Per step that is most of the
    host time of a batch-1 decode, so the replay path calls them directly. dst and src: one a pinned
    host array, the other a device array of the same size.
    """
    from numba.cuda.cudadrv import driver

    if driver.is_device_memory(dst):
        driver.host_to_device(dst, src, src.nbytes, stream=stream)
    else:
        driver.device_to_host(dst, src, dst.nbytes, stream=stream)


class DecodeGraphs:
    """Runs decode-only steps of up to `max_num_seqs` sequences from recorded CUDA graphs."""

    def __init__(self, model: DeviceModel, max_num_seqs: int, capture: bool = True):
        self.model = model
        self.capture = capture
        self.batch_sizes = batch_buckets(max_num_seqs)
        self._sample_rows = cuda.to_device(np.arange(self.batch_sizes[-1], dtype=np.int32))
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        # The stream graphs are recorded and replayed on, with the step's upload and download, as numba
        # and as cuda.core see it. Blocking: ordered after the default stream's eager kernels and copies.
        self._numba_stream = cuda.stream() if capture else None  # (the simulator records nothing)
        self._stream = None  # made at the first recording

    @property
    def num_graphs(self) -> int:
        return sum(g.graph is not None for g in self._graphs.values())

    def handles(self, seqs: list[ScheduledSequence]) -> bool:
        """Whether this step can be replayed: every sequence decodes one token, and the batch fits a bucket."""
        return 0 < len(seqs) <= self.batch_sizes[-1] and all(s.is_decode for s in seqs)

    def run(self, seqs: list[ScheduledSequence], sampling: SamplingRows, host_work=None):
        """Run one decode step and sample every row; returns (logits (B', V) f32 device array of the
        padded batch, sampled tokens (len(seqs),) int32 host array), row i for seqs[i]. (Slicing a
        numba device array costs tens of microseconds: the caller indexes the rows it needs.)
        `host_work`: a callable run while the device works on the step (before waiting for it)."""
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(seqs))]
        step = self._step(batch, table_width(max(len(s.page_ids) for s in seqs)))
        if step.graph is not None:  # queued on one stream, one wait at the end
            step.upload(seqs, sampling, self._numba_stream)
            step.graph.launch(self._stream)
            copy_async(step.host_tokens, step.tokens, self._numba_stream)
            if host_work is not None:
                host_work()
            self._numba_stream.synchronize()
        else:
            step.upload(seqs, sampling)
            self._first_run(step)
            if host_work is not None:
                host_work()
            step.tokens.copy_to_host(step.host_tokens)
        return step.logits, step.host_tokens[: len(seqs)]

    def record_all(self, max_pages: int) -> None:
        """Make every graph a sequence of up to `max_pages` pages can need, now (each bucket run once
        on padding rows only), so that no later step pays for compiling and recording."""
        widths = sorted({table_width(p) for p in range(1, max_pages + 1)})
        for batch in self.batch_sizes:
            for width in widths:
                step = self._step(batch, width)
                if step.logits is None:
                    step.upload([], None)
                    self._first_run(step)

    def _step(self, batch: int, width: int) -> _StepGraph:
        step = self._graphs.get((batch, width))
        if step is None:
            step = self._graphs[(batch, width)] = _StepGraph(batch, width, self._sample_rows)
        return step

    def _first_run(self, step: _StepGraph) -> None:
        """Run the step eagerly (its result, and its kernels compiled), then record it."""
        step.forward_and_sample(self.model)
        if self.capture:
            step.graph = self._record(step)

    def _record(self, step: _StepGraph):
        """Record `forward` on the step's buffers into a CUDA graph (nothing runs while recording)."""
        from cuda.core import Stream

        if self._stream is None:
            self._stream = Stream.from_handle(int(self._numba_stream.handle))
        builder = self._stream.create_graph_builder()
        try:
            builder.begin_building("relaxed")
            try:
                with launching_on(builder):
                    step.forward_and_sample(self.model)
            finally:
                builder.end_building()
            graph = builder.complete()
            graph.upload(self._stream)
        except KernelError:
            raise
        except Exception as e:  # a driver error while recording: say which graph
            raise KernelError(f"CUDA graph of the decode step (batch {step.batch}, {step.width} pages): {e}") from e
        finally:
            builder.close()
        return graph
