"""Steps with prefill tokens, piecewise from CUDA graphs: all but attention recorded per token count.

Why: under load most steps mix prompt chunks with decodes. Launched kernel by kernel, such a step
(Llama 3.2 1B: ~215 launches) costs several milliseconds of Python before the GPU has its work.
A whole-step graph, as for decode steps, does not fit: the attention kernels' grids follow the
step's sequences (how many prompts, how long the longest chunk), not just its token count. The rest
of the step does not: once the step is padded to a token bucket (`inputs.StepLayout.pack`), the
embedding, every product, norm, activation and RoPE/K-V store, and the head depend on T (and B) alone.

So, as vLLM v1 does, the step is cut at the attentions (`DeviceModel.piece` / `attention` / `head`):
- per token bucket T, each of the model's `num_pieces` pieces (the embedding and layer 0's qkv
  product and RoPE; then, per layer boundary, the output projection, the MLP and the next layer's
  qkv and RoPE; the last layer's output projection and MLP) is recorded into its own graph;
- per sampled-row bucket B, the head and the sampler are one more graph;
- a step replays its L + 1 piece graphs and its head graph, and launches each layer's attention
  between two pieces, eagerly, on the same stream: for Llama 3.2 1B, 18 replays and 32 (48 when
  the decode attention splits its contexts) launches instead of ~215.

A piece graph reads the step's token ids, positions and kv indices at the bucket's fixed offsets of
the packed buffer and the model's step buffers; the head graph reads the sample rows and sampler
inputs. Everything an attention launch reads is in the same buffer, uploaded before the first piece.

Cost (estimated for Llama 3.2 1B, `--max-num-seqs 64 --max-num-batched-tokens 2048`: 52 token
buckets and 11 row buckets; `benchmarks/mixed_graphs_gpu.py` measures it): ~900 piece graphs of
6-14 kernel nodes and 11 head graphs. The graphs share every buffer (the packed inputs, the model's
step buffers), so what they hold is the driver's own record of their ~10,000 nodes, a few KB each
at most: some tens of MB. Recording a bucket is its first step run eagerly (for the full
2112-token bucket ~20 ms on an H200, most of it the step's own work; it compiles nothing new once
`warm_up` has run) plus 17 recordings of ~0.5 ms each (the launches' Python, then instantiation
and upload): all buckets take about a second, in `KernelRunner.warm_up` or on first use.
"""

from __future__ import annotations

from numba_vllm.executor.cuda_graph import GraphRecorder
from numba_vllm.executor.inputs import SamplerInputs, StepShape
from numba_vllm.model.llama import DeviceModel, StepInputs


class PiecewiseGraphs:
    """Runs steps with prefill tokens: pieces and head replayed from graphs, attention launched eagerly."""

    def __init__(self, model: DeviceModel, recorder: GraphRecorder | None = None):
        self.model = model
        self.recorder = recorder  # None: run the pieces eagerly on the graphs' inputs (the simulator's stand-in)
        self._pieces: dict[int, list | None] = {}  # T -> one graph per piece (None when emulated)
        self._heads: dict[int, object] = {}  # B -> head-and-sampler graph (None when emulated)

    @property
    def num_graphs(self) -> int:
        recorded = sum(len(p) for p in self._pieces.values() if p is not None)
        return recorded + sum(g is not None for g in self._heads.values())

    @property
    def token_counts(self) -> set[int]:
        """The token buckets seen so far (recorded, or emulated)."""
        return set(self._pieces)

    def run(self, shape: StepShape, inputs: StepInputs, sampler: SamplerInputs) -> None:
        """Queue the step (pieces, attentions, head, sampler) on the current launch stream; a new
        token or row bucket runs eagerly and is recorded."""
        model, t = self.model, shape.num_tokens
        graphs = self._pieces.get(t)
        for p in range(model.num_pieces):
            if graphs is not None:
                self.recorder.replay(graphs[p])
            else:
                model.piece(inputs, p)
            if p < len(model.layers):
                model.attention(inputs, p)
        if t not in self._pieces:
            self._pieces[t] = self._record_pieces(inputs) if self.recorder is not None else None
        b = shape.num_sampled
        if not b:
            return
        head = self._heads.get(b)
        if head is not None:
            self.recorder.replay(head)
            return
        self._head_and_sample(inputs, sampler)
        if self.recorder is not None:
            head = self.recorder.record(lambda: self._head_and_sample(inputs, sampler), f"the head ({b} rows)")
        self._heads[b] = head

    def _record_pieces(self, inputs: StepInputs) -> list:
        t = inputs.token_ids.shape[0]
        graphs = []
        for p in range(self.model.num_pieces):
            graphs.append(self.recorder.record(lambda p=p: self.model.piece(inputs, p), f"piece {p} of a {t}-token step"))
        return graphs

    def _head_and_sample(self, inputs: StepInputs, sampler: SamplerInputs) -> None:
        self.model.sample(self.model.head(inputs), sampler)
