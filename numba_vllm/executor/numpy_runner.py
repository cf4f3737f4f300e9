"""Runners: turn a `StepPlan` into one forward pass and one sampled token per sampling sequence.

Three executors behind one interface, so the engine, its pages and its scheduler are the same
whatever runs the model: `launch(plan, previous=None) -> step` queues a step (a decoding sequence
whose token is None takes the token `previous` sampled for it), `collect(step) -> {request_id:
token_id}` waits for its tokens, `execute(plan)` does both, `release(request_id)` forgets a request;
a step's `feeds_next` says whether the next may be launched before it is collected.
- `NumpyRunner`: the float32 reference model (`reference.py`) over a paged K/V pool in host memory.
  Runs anywhere; the oracle the other two are tested against.
- `KernelRunner` (`kernel_runner.py`): the Numba CUDA kernels, on the GPU (`cuda`) or, unchanged,
  in the Numba simulator (`sim`).
Sampling is per request (`host_sampling.RequestSamplers`), so a request's tokens do not depend on
what else shares the batch. Besides the tokens, a collected step holds the logprobs its requests
asked for in `logprobs` and `prompt_logprobs` (`engine/logprobs.py`), read by the engine after
`collect`. A step with logits edits, logprobs or a structured-output row does not feed the next
(`feeds_next` is False): the edits count each request's output on the host, the kernel runner
computes logprobs from the step's logits at collect time, and the next step's token mask needs this
step's token advanced through the request's grammar on the host.

BLAS threads: a step's products are small (one decode token is a (1, K) @ (K, N) product per
layer), and OpenBLAS's worker threads spin while they wait for work, so beside any other busy thread
(the server's event loop, another process) they fight over the cores. Measured with SmolLM2-135M on
this project's 2-core machine while it was shared (load ~20): a decode step took 842 ms with one
BLAS thread and 3,669 ms with two, a 64-token prefill 2.4 s against 29 s. With the machine quieter,
two threads were 1.5x faster (41 against 61 ms a decode step). The slowdown under contention is the
one that hurts, so a step runs with `NUMPY_BLAS_THREADS` BLAS threads (threadpoolctl, for the
step only: the process's own setting is restored after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import ThreadpoolController

from numba_vllm.engine.logits_edits import apply_edits
from numba_vllm.engine.logprobs import PositionLogprobs, raw_logprobs
from numba_vllm.engine.scheduler import ScheduledSequence, StepPlan
from numba_vllm.engine.structured import GrammarMatcher, bitmask_words, fill_token_bitmasks, mask_logits
from numba_vllm.executor.host_sampling import RequestSamplers
from numba_vllm.executor.inputs import kv_indices
from numba_vllm.model.config import PAGE_SIZE, ModelConfig
from numba_vllm.model.reference import ReferenceModel

NUMPY_BLAS_THREADS = 1  # BLAS threads of a numpy step (see the module docstring)


class PagedHostCache:
    """The K/V pool in host memory: k, v (num_layers, num_pages * PAGE_SIZE, KVH, HD) f32.

    Row `page_id * PAGE_SIZE + offset` holds one token's K (or V) of one layer: the same kv index the
    GPU pool uses, so the NumPy backend exercises the engine's page bookkeeping exactly.
    """

    def __init__(self, config: ModelConfig, num_pages: int):
        shape = (config.num_hidden_layers, num_pages * PAGE_SIZE, config.num_key_value_heads, config.head_dim)
        self.k = np.zeros(shape, np.float32)  # untouched pages cost no memory until written
        self.v = np.zeros(shape, np.float32)

    def sequence(self, page_ids: list[int]) -> _SequenceCache:
        return _SequenceCache(self, page_ids)


class _SequenceCache:
    """One sequence's window onto the pool, with `reference.KVCache`'s write/read interface."""

    def __init__(self, pool: PagedHostCache, page_ids: list[int]):
        self.pool = pool
        self.page_ids = page_ids

    def write(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        idx = kv_indices(self.page_ids, positions)  # (T,)
        self.pool.k[layer, idx] = k
        self.pool.v[layer, idx] = v

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        idx = kv_indices(self.page_ids, np.arange(length))  # (L,): gathers the pages in token order
        return self.pool.k[layer, idx], self.pool.v[layer, idx]


@dataclass
class HostStep:
    """A step the NumPy runner has run: there is no device queue, so its tokens are there at once."""

    sampled: dict[str, int]  # request id -> sampled token
    feeds_next: bool = True  # False for a step with logits edits, logprobs or a structured-output row (see `_needs_serial`)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # request id -> its sampled token's
    prompt_logprobs: dict[str, tuple[int, PositionLogprobs]] = field(default_factory=dict)  # id -> (first index, logprobs)


class NumpyRunner:
    """The reference model, one sequence at a time, over the paged host cache."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], num_pages: int):
        self.model = ReferenceModel(config, weights)
        self.cache = PagedHostCache(config, num_pages)
        self.samplers = RequestSamplers()
        self.blas = ThreadpoolController()  # finds the BLAS libraries once; limiting them per step is then cheap

    def execute(self, plan: StepPlan) -> dict[str, int]:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan, previous: HostStep | None = None) -> HostStep:
        """Run the step now; a token still unknown to the engine (None) is the one `previous` sampled."""
        step = HostStep({})
        sampled = step.sampled
        with self.blas.limit(limits=NUMPY_BLAS_THREADS, user_api="blas"):
            for seq in plan.sequences:
                token_ids = seq.token_ids
                if None in token_ids:
                    rid = seq.request.request_id
                    known = previous.sampled if previous is not None else {}
                    if token_ids != [None] or rid not in known:
                        raise ValueError(f"request {rid}: its token is unknown and the previous step did not sample it")
                    token_ids = [known[rid]]
                cache = self.cache.sequence(seq.page_ids)
                targets = prompt_logprob_targets(seq)
                logits = self.model.forward(np.asarray(token_ids), seq.start_position, cache, all_logits=targets is not None)
                if targets is not None:  # (T, V): every position's logits, the last one samples
                    first, ids = targets
                    k = seq.request.sampling_params.prompt_logprobs
                    step.prompt_logprobs[seq.request.request_id] = (first, raw_logprobs(logits[: len(ids)], ids, k))
                    logits = logits[-1]  # (V,)
                if seq.samples:
                    sampled[seq.request.request_id] = token = self._sample(seq.request, logits)
                    k = seq.request.sampling_params.logprobs
                    if k is not None:
                        step.logprobs[seq.request.request_id] = raw_logprobs(logits[None], np.array([token]), k)
                step.feeds_next &= not _needs_serial(seq, targets)
        return step

    def collect(self, step: HostStep) -> dict[str, int]:
        return step.sampled

    def _sample(self, request, logits: np.ndarray) -> int:
        """One token from the row's raw logits (V,): edited first if the request edits them, then
        masked by its grammar if it has a structured-output constraint (copies: `logits` stays raw)."""
        if request.logits_edits is not None:
            logits = apply_edits(logits, request.logits_edits.row(request.output_token_ids))
        if request.grammar is not None:
            logits = constrained(request.grammar, logits)
        return self.samplers.sample(request, logits)

    def release(self, request_id: str) -> None:
        self.samplers.release(request_id)


def constrained(grammar: GrammarMatcher, logits: np.ndarray) -> np.ndarray:
    """A copy of one row of logits (V,) f32 with the tokens its grammar forbids at -inf."""
    bitmask = np.empty((1, bitmask_words(len(logits))), np.int32)  # (1, ceil(V / 32))
    fill_token_bitmasks([grammar], bitmask)
    masked = logits[None].copy()  # (1, V)
    mask_logits(masked, bitmask)
    return masked[0]
def _needs_serial(seq: ScheduledSequence, targets) -> bool:
    """Whether the step of `seq` must be collected before the next is launched, as the kernel runner
    has it: `seq` has prompt-logprob `targets`, or samples with logits edits (they count the output on
    the host), logprobs, or a structured-output constraint (the next mask needs this token advanced
    through the grammar)."""
    r = seq.request
    serial_row = r.logits_edits is not None or r.sampling_params.logprobs is not None or r.grammar is not None
    return targets is not None or (seq.samples and serial_row)


def prompt_logprob_targets(seq: ScheduledSequence) -> tuple[int, np.ndarray] | None:
    """The prompt tokens whose logprobs this chunk gives, for a request that asks: (the index of the
    first, its first position + 1; their ids (P,) int32, one per position of the chunk from its first,
    as far as the prompt goes). None when the request asks for none or the chunk predicts no prompt token."""
    r = seq.request
    first = seq.start_position + 1
    if r.sampling_params.prompt_logprobs is None or first >= r.num_prompt_tokens:
        return None
    end = min(seq.context_len + 1, r.num_prompt_tokens)  # the chunk's last position predicts token context_len
    return first, np.array(r.prompt_token_ids[first:end], np.int32)
