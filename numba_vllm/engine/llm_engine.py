"""The engine: requests in, tokens out, many at once over a paged KV cache.

`LLMEngine` is the streaming core (vLLM's names): `add_request`, `step`, `abort_request`. Each step
the scheduler picks what runs (`StepPlan`), the runner executes it and samples, the scheduler
advances the requests, and each request's `OutputBuilder` turns its new token into text and decides
whether it stops; finished requests give back their pages and slot. `LLM` is the offline API on
top: hand it all prompts, get all outputs back in order.

Overlapped scheduling (`EngineConfig.async_scheduling`, on by default): the host schedules step n+1
and launches it while the device still runs step n, then collects step n's tokens and runs its stop
checks while n+1 runs. Step n+1 is planned as if step n's sampled tokens were known: the scheduler
records them as None (`Scheduler.update`) and the runner feeds them to step n+1 on the device (from
the previous step's sampled-token buffer); `Scheduler.fill` puts them in once collected. What keeps
this exact:
- a request that step n finishes by its output budget is known in advance: it is held out of step
  n+1 (`Scheduler.schedule(hold=...)`);
- a request that step n finishes otherwise (a stop token or string) has one extra token computed in
  step n+1, which is dropped (`update` and `fill` skip finished requests), as vLLM does; the same for
  a request aborted while a step runs;
- pages freed by a finished, aborted or preempted request may be handed out while a step in flight
  still writes them: the device runs steps in launch order, so the new owner's writes come later;
- a step whose tokens the host must sample (top-k, top-p, min-p: the runner reads its logits), or
  with logits edits (penalties, logit_bias, min_tokens, bad_words: they count each request's output
  on the host) or logprobs (computed from its logits when it is collected), is collected before the
  next step is scheduled (serial order), as is every step without `async_scheduling`;
- so is a step with a structured-output row: the next step's token mask is computed from the
  request's grammar advanced by this step's token (`_complete`), which must be known first.
A `step()` call therefore returns the outputs of the step launched by the call before it (the first
call returns none).

A request with `n` > 1 sequences is fanned out into n child requests (as vLLM V1 does), which share
the prompt's full KV pages through the prefix cache: only the first child is scheduled at first, its
siblings join once its prompt is computed (the step after the one that computes it), so each finds the prompt's full
pages cached instead of computing them beside it in the same step. Only the prompt's last, partial
page (and at least its last token) is computed per child. With prefix caching off there is nothing
to share and all children are scheduled at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import PageAllocator, pages_for_tokens
from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.llm_args import llm_engine_config, normalize_prompts
from numba_vllm.engine.logits_edits import LogitsEdits, bad_word_token_ids
from numba_vllm.engine.logprobs import LogprobsCollector
from numba_vllm.engine.output import CompletionOutput, OutputBuilder, RequestOutput
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.sampling_defaults import model_sampling_defaults
from numba_vllm.engine.scheduler import Scheduler, StepPlan
from numba_vllm.engine.stats import EngineStats, StepStats, collect_stats, step_stats
from numba_vllm.engine.structured import StructuredOutputs
from numba_vllm.executor.backend import create_runner, prepare_backend, resolve_backend
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint

WARM_UP_GRAPH_TOKENS = 4096  # `warm_up` records decode graphs for sequences up to this long; longer ones on first use

_STATUS_OF_REASON = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass
class _Family:
    """The child requests of one request (one child when n is 1; its id is the request's own)."""

    output: RequestOutput
    child_ids: list[str]  # child i fills output.outputs[i]
    first: Request  # child 0
    held: list[Request]  # children not yet given to the scheduler: they wait for child 0's prompt


class StepFailedError(RuntimeError):
    """`LLM.generate` / `LLM.chat`: a step failed, and with it a request of the call (the engine
    itself stays usable; `LLMEngine.step` explains)."""


class LLMEngine:
    """Continuous (or, for comparison, static) batching over batch slots and a waiting queue, with
    one of three runners."""

    def __init__(self, checkpoint: Checkpoint, engine_config: EngineConfig | None = None, detokenize: bool = True):
        """`detokenize=False`: outputs carry token ids only, no text, and stop strings are not checked (a
        server's engine core, whose front end does both)."""
        self.checkpoint = checkpoint
        self.detokenize = detokenize
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.engine_config = ec = engine_config or EngineConfig()
        self.backend = resolve_backend(ec.backend)
        # Capacity (KV pages, max_model_len, step size) is decided once, as the runner is built.
        self.runner, self.capacity = create_runner(checkpoint, ec, self.backend)
        self.lengths = LengthPolicy(self.capacity.max_model_len, self.config.vocab_size)
        allocator = PageAllocator(self.capacity.num_pages, enable_caching=ec.enable_prefix_caching)
        cap = self.capacity
        self.scheduler = Scheduler(
            ec.max_num_seqs, cap.max_num_batched_tokens, allocator, cap.max_model_len, scheduling=ec.scheduling,
            long_prefill_token_threshold=cap.long_prefill_token_threshold, cache_key=prefix_cache_key(checkpoint),
        )  # fmt: skip
        self.structured = StructuredOutputs.for_model(self.config, self.tokenizer)  # compiles constraints
        # Sampling values requests take unless they set their own (engine/sampling_defaults.py).
        self.sampling_defaults = model_sampling_defaults(self.config, ec.generation_config)
        self._builders: dict[str, OutputBuilder] = {}  # by child request id, while it runs
        self._families: dict[str, _Family] = {}  # by request id, until every child has finished
        self._holding: dict[str, _Family] = {}  # the families with held children, by request id
        self._in_flight: _Flight | None = None  # launched, its tokens not collected yet
        self._logprobs: dict[str, LogprobsCollector] = {}  # by child request id: those that asked for logprobs
        self._token_texts: dict[int, str] = {}  # decoded tokens of logprobs, by id
        self._last_plan: tuple[int, StepPlan] | None = None  # (step index, plan) of the last step, for `last_step`
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0  # requests that lost their pages and recomputed, over the engine's life
        self.num_failed_steps = 0  # steps whose runner raised (their requests failed), over the engine's life
        self.last_step_error: Exception | None = None  # what the last failed step raised

    @property
    def max_model_len(self) -> int:
        """The longest a request may grow, prompt + output (`self.lengths` holds the rules)."""
        return self.lengths.max_model_len

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> RequestOutput:
        """Queue a prompt (text, or token ids); returns its output, filled in as steps run.

        A prompt the model cannot run (empty, too long for `max_model_len`, ids outside the
        vocabulary) raises `PromptError` (a ValueError) for this request alone, and so does a
        structured-output constraint that does not compile (`GrammarError`). With `params.n` > 1
        the request runs as n children `f"{i}_{request_id}"` (vLLM's naming); child i samples with
        seed `params.seed + i` when a seed is given, so the sequences differ and each is reproducible.
        """
        if request_id in self._families:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if self.tokenizer is None:
                raise ValueError(f"{self.checkpoint.source} has no tokenizer; give prompts as token ids")
            ids = self.tokenizer.encode(text)
        else:
            ids = [int(t) for t in prompt]
        self.lengths.check_prompt(ids)
        constraint = params.structured_outputs
        if constraint is not None:
            self.structured.compile(constraint)  # GrammarError (a ValueError) before anything is queued
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        if any(c in self._builders for c in child_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        output = RequestOutput(request_id, text, ids, [CompletionOutput(i) for i in range(n)])
        budget = self.lengths.max_new_tokens(len(ids), params.max_tokens)
        # child i > 0 leaves the prompt's logprobs to child 0 (and so may share its cached pages)
        child_params = [params] if n == 1 else [
            dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(n)
        ]  # fmt: skip
        edits = [self._logits_edits(p, ids) for p in child_params]  # raises before anything is registered
        children = []
        for i, child_id in enumerate(child_ids):
            grammar = self.structured.matcher(constraint) if constraint is not None else None  # each child its own state
            children.append(Request(child_id, ids, child_params[i], next(self._arrivals), logits_edits=edits[i], grammar=grammar))
            self._builders[child_id] = OutputBuilder(
                output, output.outputs[i], child_params[i], self.config, self.tokenizer, budget, self.detokenize
            )
            self._collect_logprobs_of(child_id, child_params[i], output, output.outputs[i])
        share = self.scheduler.allocator.enable_caching  # the siblings wait only where there are pages to share
        first, held = (children[:1], children[1:]) if share else (children, [])
        for request in first:
            self.scheduler.add(request)
        self._families[request_id] = family = _Family(output, child_ids, children[0], held)
        if held:
            self._holding[request_id] = family
        return output

    def _collect_logprobs_of(
        self, child_id: str, params: SamplingParams, output: RequestOutput, completion: CompletionOutput
    ) -> None:
        """Give a child that asks for logprobs (or the prompt's) a collector; its lists are the output's."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return
        collector = LogprobsCollector(len(output.prompt_token_ids), params.logprobs is not None,
                                      params.prompt_logprobs is not None, self._decode_token)  # fmt: skip
        self._logprobs[child_id] = collector
        completion.logprobs, completion.cumulative_logprob = collector.logprobs, collector.cumulative_logprob
        if collector.prompt_logprobs is not None:
            output.prompt_logprobs = collector.prompt_logprobs

    def _decode_token(self, token_id: int) -> str | None:
        """A logprob's decoded_token: the token's own text (special tokens included), None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logits_edits(self, params: SamplingParams, prompt_ids: list[int]) -> LogitsEdits | None:
        """The request's logits edits (None when it has none); a logit_bias id outside the vocabulary,
        or bad_words without a tokenizer, is a ValueError naming the field."""
        if not params.edits_logits:
            return None
        outside = [t for t in params.logit_bias or () if t >= self.config.vocab_size]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary (0 .. {self.config.vocab_size - 1})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"bad_words: {self.checkpoint.source} has no tokenizer to tokenize them")
        bad_words = bad_word_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stop_ids.add(self.tokenizer.eos_token_id)
        return LogitsEdits(params, prompt_ids, stop_ids, bad_words)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (queued or running, every one of its sequences); its pages and slots are freed."""
        family = self._families.get(request_id)
        if family is None:
            return
        for index in range(len(family.child_ids)):
            self.abort_sequence(request_id, index)
        self._families.pop(request_id, None)  # (gone already: its last sequence ended it)
        self._holding.pop(request_id, None)

    def abort_sequence(self, request_id: str, index: int) -> None:
        """Stop one sequence of a request (``outputs[index]``, finish_reason "abort") while its
        siblings go on: a server's front end that found a stop string in it says so. Its pages and
        slot are freed (a sibling not yet admitted is never admitted); the request finishes when its
        last sequence does. Unknown requests and finished sequences are ignored."""
        family = self._families.get(request_id)
        if family is None or not 0 <= index < len(family.child_ids):
            return
        child_id = family.child_ids[index]
        builder = self._builders.pop(child_id, None)
        if builder is None:  # finished already
            return
        self._logprobs.pop(child_id, None)
        builder.abort()
        waiting = [r for r in family.held if r.request_id == child_id]
        if waiting:
            family.held.remove(waiting[0])
        elif self.scheduler.abort(child_id):
            self.runner.release(child_id)
        if family.output.finished:
            del self._families[request_id]
            self._holding.pop(request_id, None)

    def warm_up(self) -> None:
        """Compile the kernels and record the decode-step CUDA graphs (for sequences of up to
        `WARM_UP_GRAPH_TOKENS`) now, before the first request: a server does this once at start-up so
        no request pays for it. Nothing to do on the numpy backend; slow in the simulator."""
        warm = getattr(self.runner, "warm_up", None)
        if warm is not None:
            warm(pages_for_tokens(min(self.capacity.max_model_len, WARM_UP_GRAPH_TOKENS)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._families) or self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step of the batch; return the outputs that got a token, and those that failed
        (with overlapped scheduling, those of the step launched by the previous call: see the module
        docstring).

        A step whose runner raises (at launch or at collect) fails the requests it scheduled, and
        only those: each ends with finish_reason "error" and `RequestOutput.error` saying why (the
        exception is kept in `last_step_error`), its pages and slot freed; requests that were
        waiting or preempted are untouched, and the scheduler is ready for the next step. Retrying
        the same batch could fail the same way forever, so the engine gives those requests up. A
        KeyboardInterrupt fails nobody: a step interrupted as it launches is dropped as if it never
        ran, and a step whose tokens were being waited for is collected by the next call (the step
        launched after it is dropped: it is recomputed); the interrupt goes on.
        """
        previous, self._in_flight = self._in_flight, None
        ahead = previous is None or previous.feeds_next  # may the next step be launched before it is collected?
        try:
            current = self._launch(previous) if ahead else None
        except BaseException:  # interrupted: nothing new runs, the step in flight stays
            self._in_flight = previous
            raise
        try:
            outputs = self._complete(previous) if previous is not None else []
        except BaseException:  # interrupted while waiting for it: collected by the next call, before anything else
            if current is not None and current.error is None:
                self.scheduler.discard(current.plan)
            previous.interrupted = True
            self._in_flight = previous
            raise
        if not ahead:
            current = self._launch(None)
        if current is None:
            return outputs
        if current.error is not None:
            return _unique(outputs + self._fail_step(current.plan, current.error))
        self.scheduler.update(current.plan, {s.request.request_id: None for s in current.plan.sequences if s.samples})
        if self.engine_config.async_scheduling and current.feeds_next:
            self._in_flight = current
            return outputs
        return _unique(outputs + self._complete(current))

    def _launch(self, previous: _Flight | None) -> _Flight | None:
        """Schedule the next step (holding out the requests `previous` finishes) and launch it, its
        unknown tokens fed from `previous`; None when there is nothing to run yet. A launch that raises
        drops the plan (`Scheduler.discard`) and returns it with the error."""
        self._release_siblings()
        plan = self.scheduler.schedule(hold=self._finishing(previous) if previous is not None else ())
        if plan.is_empty and not plan.preempted_request_ids:  # nothing, or only requests finishing in flight
            self.scheduler.update(plan, {})
            return None
        self._last_plan = (self.num_steps, plan)
        if self.engine_config.verbose:
            print(f"step {self.num_steps}:", *plan.describe(self.scheduler.allocator), sep="\n", file=sys.stderr)
        try:
            handle = None if plan.is_empty else self.runner.launch(plan, previous.handle if previous is not None else None)
        except BaseException as e:
            self.scheduler.discard(plan)
            if not isinstance(e, Exception):
                raise
            return _Flight(plan, None, error=e)
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted_request_ids)
        return _Flight(plan, handle)

    def _finishing(self, flight: _Flight) -> set[str]:
        """Requests the step in flight certainly finishes: it samples the last token of their budget."""
        ids = set()
        for s in flight.plan.sequences:
            builder = self._builders.get(s.request.request_id)
            if s.samples and not s.request.is_finished and builder is not None:
                if len(builder.completion.token_ids) + 1 >= builder.max_new_tokens:
                    ids.add(s.request.request_id)
        return ids

    def _complete(self, flight: _Flight) -> list[RequestOutput]:
        """Collect a launched step's tokens; stop checks and output for each request that got one (a
        collect that raises fails the step's requests). A step whose requests have all finished
        meanwhile (a stop string, an abort) is not waited for: nothing of it is used."""
        if flight.handle is None or all(s.request.is_finished for s in flight.plan.sequences):
            return []
        try:
            sampled = self.runner.collect(flight.handle)
        except Exception as e:
            return self._fail_step(flight.plan, e)
        if self._logprobs:
            self._collect_prompt_logprobs(flight.handle)
        updated: dict[int, RequestOutput] = {}  # each request's output once, however many of its children moved
        for request in self.scheduler.fill(flight.plan, sampled):
            builder = self._builders.get(request.request_id)
            if builder is None:  # a sibling failed earlier in this loop, and ended it
                continue
            output = builder.output
            if builder.completion.index == 0:
                output.num_cached_tokens = request.num_cached_tokens
            token = sampled[request.request_id]
            grammar = request.grammar
            if grammar is not None and not grammar.accept(token):  # the mask allowed it: a bug, or llguidance's limits
                output = self._fail(request, f"structured output: token {token} does not fit the grammar: {grammar.error}")
                updated[id(output)] = output
                continue
            collector = self._logprobs.get(request.request_id) if self._logprobs else None
            if collector is not None and collector.logprobs is not None:
                collector.add_sampled(flight.handle.logprobs[request.request_id])
                builder.completion.cumulative_logprob = collector.cumulative_logprob
            builder.add(token, stop=grammar is not None and grammar.is_finished)
            if builder.completion.finished():
                self.scheduler.finish(request, _STATUS_OF_REASON[builder.completion.finish_reason])
                self.runner.release(request.request_id)
                del self._builders[request.request_id]
                self._logprobs.pop(request.request_id, None)
            updated[id(output)] = output
        for output in updated.values():
            if output.finished:
                self._families.pop(output.request_id, None)  # (already gone if a sequence failed)
        return list(updated.values())

    def _release_siblings(self) -> None:
        """Hand held children to the scheduler once child 0's prompt is computed (recorded by
        `Scheduler.update`, also while that step still runs: the device runs steps in launch order), or
        child 0 has ended: the prompt's full pages are in the prefix cache for them to share."""
        for request_id, family in list(self._holding.items()):
            first = family.first
            if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
                for request in reversed(family.held):  # ahead of requests that arrived after theirs, in index order
                    self.scheduler.add(request, front=True)
                family.held = []
                del self._holding[request_id]

    def _collect_prompt_logprobs(self, handle) -> None:
        """Hand a collected step's prompt logprobs (chunks that sample nothing included) to their requests."""
        for request_id, (first, pos) in handle.prompt_logprobs.items():
            collector = self._logprobs.get(request_id)
            if collector is not None:
                collector.add_prompt(first, pos)

    def _fail_step(self, plan: StepPlan, error: Exception) -> list[RequestOutput]:
        """Fail the requests of a step whose runner raised (those not finished yet)."""
        self.num_failed_steps += 1
        self.last_step_error = error
        message = f"the engine step failed: {type(error).__name__}: {error}"
        failed: dict[int, RequestOutput] = {}
        for s in plan.sequences:
            if not s.request.is_finished and s.request.request_id in self._builders:  # not ended with a failed sibling
                output = self._fail(s.request, message)
                failed[id(output)] = output
        return list(failed.values())

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End a request whose step failed (FINISHED_ERROR): pages and slot freed, output marked; the
        request's other sequences (its siblings) end with it."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self.runner.release(request.request_id)
        builder = self._builders.pop(request.request_id)
        builder.fail(message)
        family = self._families.pop(builder.output.request_id)
        self._holding.pop(builder.output.request_id, None)
        held = {r.request_id for r in family.held}
        for child_id in family.child_ids:
            self._logprobs.pop(child_id, None)
            sibling = self._builders.pop(child_id, None)
            if sibling is not None:
                sibling.fail(message)
                if child_id not in held:
                    self.scheduler.abort(child_id)
                    self.runner.release(child_id)
        return builder.output

    # ---- state ---------------------------------------------------------------------------------
    def last_step(self) -> StepStats | None:
        """What the last step ran (each slot's request, prefill or decode, tokens, pages; who was
        preempted), as plain values built on demand; None before the first step. For timelines."""
        if self._last_plan is None:
            return None
        return step_stats(self._last_plan[1], self._last_plan[0])

    def stats(self, requests: bool = False, pages: bool = False) -> EngineStats:
        """A snapshot of slots, pages and counters, for readers outside the engine (server metrics,
        banners, benchmarks); with ``requests``, also each running and waiting request, and with
        ``pages`` as well, each one's page ids. Call it on the thread that steps the engine; the
        snapshot itself may go to any thread."""
        return collect_stats(self.scheduler, self.num_steps, self.num_preemptions, requests, pages, self.num_failed_steps)


def prefix_cache_key(checkpoint: Checkpoint) -> bytes:
    """What the K/V of a token prefix depends on besides the tokens: the model (its source and its
    config). Folded into every prefix-cache page hash."""
    return f"{checkpoint.source}\0{checkpoint.config!r}".encode()


class LLM:
    """Offline inference: `LLM(model).generate(prompts, params)` -> outputs in prompt order.

    Takes vLLM's common keywords (`engine/llm_args.py`: max_model_len, gpu_memory_utilization,
    enforce_eager, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, generation_config,
    seed, dtype, tokenizer, tensor_parallel_size, ...) and numba-vllm's own EngineConfig fields;
    a keyword or value that cannot be honoured is refused in one line naming `LLM`. `seed`: a request
    without a seed of its own gets one drawn from a generator seeded with it, so a script's runs repeat.
    """

    def __init__(self, model: str | None = None, backend: str = "auto", **kwargs):
        seed = kwargs.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"LLM: seed={seed!r} must be a non-negative integer")
        prepare_backend(backend)
        engine_config = llm_engine_config(model, backend, resolve_backend(backend), kwargs)
        self.engine = LLMEngine(load_checkpoint(model), engine_config)
        self._seeds = None if seed is None else np.random.default_rng(seed)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (`encode`, `decode`, `apply_chat_template`); None for a checkpoint without one."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the model's generation_config.json
        values (with generation_config="auto", the default), else SamplingParams' own defaults."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order. A prompt is a text, a list
        of token ids, `{"prompt": text}` or `{"prompt_token_ids": [...]}`; one prompt or a list of them."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [self._seeded(sp) for sp in _per_prompt(sampling_params, len(prompts))]
        outputs = [self.engine.add_request(f"gen-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params, strict=True)]
        self._run(outputs, use_tqdm)
        return outputs

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (a list of {role, content}) and generate."""
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ValueError(f"{self.engine.checkpoint.source} has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in conversations]
        return self.generate(ids, sampling_params, use_tqdm)

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """With LLM(seed=...): a request without a seed of its own gets the generator's next one."""
        if self._seeds is None or params.seed is not None or params.greedy:
            return params
        return dataclasses.replace(params, seed=int(self._seeds.integers(2**31)))

    def _run(self, outputs: list[RequestOutput], use_tqdm: bool) -> None:
        """Step until every request is done. With ``use_tqdm`` and stderr a terminal, a tqdm bar (as in
        vLLM) shows prompts done, elapsed time and ETA, and the input (prompt) and output (generated)
        tokens per second so far; a prompt counts as input once its first token is out."""
        bar = None
        if use_tqdm and sys.stderr.isatty():
            from tqdm import tqdm  # only when a bar is drawn

            # miniters=0: redraw every mininterval even while no prompt finishes (the rates move on)
            bar = tqdm(total=len(outputs), desc="Processed prompts", unit="prompt", miniters=0, dynamic_ncols=True)
        input_tokens = output_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                updated = self.engine.step()  # each got exactly one new token, or failed
                failed = next((o for o in updated if o.error is not None), None)
                if failed is not None:
                    raise StepFailedError(f"request {failed.request_id}: {failed.error}") from self.engine.last_step_error
                if bar is not None:
                    input_tokens += sum(len(o.prompt_token_ids) for o in updated if len(o.outputs[0].token_ids) == 1)
                    output_tokens += len(updated)
                    elapsed = max(bar.format_dict["elapsed"], 1e-9)
                    rates = f"input {input_tokens / elapsed:.1f} tok/s, output {output_tokens / elapsed:.1f} tok/s"
                    bar.set_postfix_str(rates, refresh=False)
                    bar.update(sum(o.finished for o in updated))
        except BaseException:
            for o in outputs:  # Ctrl-C or a failure: leave the engine clean for the next call
                if not o.finished:
                    self.engine.abort_request(o.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()


@dataclass(eq=False)
class _Flight:
    """A launched step: its plan and the runner's handle (None for a plan that only preempted, or
    one whose launch raised `error`)."""

    plan: StepPlan
    handle: object
    error: Exception | None = None
    interrupted: bool = False  # an interrupt came while its tokens were awaited

    @property
    def feeds_next(self) -> bool:
        """Whether the next step may be launched before this one is collected."""
        return self.handle is not None and self.handle.feeds_next and not self.interrupted


def _unique(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each output once, in first-seen order (a request may get its token and then fail in one call)."""
    seen = set()
    return [o for o in outputs if not (id(o) in seen or seen.add(id(o)))]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
