"""CUDA graphs: launches recorded once and replayed in one call; decode steps replayed whole.

Why: a plain numba launch spends 25-48 us marshalling its arguments in Python, so a decode step of
~200 launches costs 5-10 ms on the host while the GPU needs about 1 ms for it. A CUDA graph records
the launches once (grids, blocks, argument values) and the driver replays them at ~1 us per kernel.

What a graph freezes, and how each step still differs:
- argument values, pointers included: every array a kernel reads stays at one address. The step's
  inputs (token ids, positions, kv indices, context lengths, block tables, the sampler's
  temperatures, seeds and output indices) sit at fixed offsets of one packed int32 device buffer
  (`inputs.StepLayout`), which each step fills with one asynchronous copy (`staging.py`); the
  activations are the model's step buffers, the sampled tokens go to one device array.
- shapes: the token count, batch size and block-table width are baked into grids and strides. A step
  is padded to buckets (`inputs.py` says how, and pads eager steps the same way, so replayed and
  eager steps compute the same thing), and graphs are keyed by those buckets.

`GraphRecorder` records a stretch of launches on the runner's stream (through
`kernels._launch.launching_on`: no launcher knows about graphs). Two users:
- `DecodeGraphs` (here): a decode-only step is one graph per (batch bucket B, table width W), the
  sampler included: one upload, one replay, one download of the tokens.
- `PiecewiseGraphs` (`piecewise_graphs.py`): a step with prefill tokens, whose attention grids
  follow its sequences, replays everything else from graphs recorded per token bucket.

A graph is made the first time its key is needed: the step runs once eagerly on its own views
(which compiles any kernel those shapes need, so nothing is loaded during the recording, and gives
this step's results), then the same calls are recorded. Replays are the same kernels on the same
shapes as that eager run, so their results are identical to it.

Under the simulator there is nothing to record: with no recorder (`recorder=None`) everything else
(buckets, padding, the packed buffer) is kept and the step runs eagerly on it, so CI checks the
graph paths' inputs.
"""

from __future__ import annotations

from numba_vllm.errors import KernelError
from numba_vllm.executor.inputs import SamplerInputs, StepShape
from numba_vllm.kernels._launch import launching_on
from numba_vllm.model.llama import DeviceModel, StepInputs


class GraphRecorder:
    """Records launches into CUDA graphs on one stream, and replays them there."""

    def __init__(self, stream):
        self.stream = stream  # a cuda.core stream (blocking: ordered after the default stream's work)

    def record(self, run, what: str):
        """Record the launches `run()` makes into a graph (nothing runs while recording); `what` names
        the graph in errors."""
        builder = self.stream.create_graph_builder()
        try:
            builder.begin_building("relaxed")
            try:
                with launching_on(builder):
                    run()
            finally:
                builder.end_building()
            graph = builder.complete()
            graph.upload(self.stream)
        except KernelError:
            raise
        except Exception as e:  # a driver error while recording: say which graph
            raise KernelError(f"CUDA graph of {what}: {e}") from e
        finally:
            builder.close()
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.stream)


class DecodeGraphs:
    """Runs decode-only steps from graphs recorded per (batch bucket, block-table width)."""

    def __init__(self, model: DeviceModel, recorder: GraphRecorder | None = None):
        self.model = model
        self.recorder = recorder  # None: run eagerly on the graphs' inputs (the simulator's stand-in)
        self._graphs: dict[tuple[int, int], object] = {}  # (B, W) -> graph (None when emulated)

    @property
    def capture(self) -> bool:
        return self.recorder is not None

    @property
    def num_graphs(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    @staticmethod
    def handles(shape: StepShape) -> bool:
        """Whether a step of this shape is decode-only (then every row samples)."""
        return shape.num_prefill_seqs == 0 and shape.num_decode_rows == shape.num_tokens > 0

    def has(self, batch: int, width: int) -> bool:
        return (batch, width) in self._graphs

    def run(self, shape: StepShape, inputs: StepInputs, sampler: SamplerInputs) -> None:
        """Queue the step (forward and sampler) on the current launch stream; a new (B, W) runs eagerly
        and is recorded."""
        key = (shape.num_tokens, shape.decode_width)
        graph = self._graphs.get(key)
        if graph is not None:
            self.recorder.replay(graph)
            return
        self._forward_and_sample(inputs, sampler)
        if self.recorder is not None:
            what = f"the decode step (batch {key[0]}, {key[1]} pages)"
            graph = self.recorder.record(lambda: self._forward_and_sample(inputs, sampler), what)
        self._graphs[key] = graph

    def _forward_and_sample(self, inputs: StepInputs, sampler: SamplerInputs) -> None:
        """What the graph holds: the model's step, then the sampler on every row."""
        self.model.sample(self.model.forward(inputs), sampler)
