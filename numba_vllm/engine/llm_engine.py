"""The engine: requests in, tokens out, many at once over a paged KV cache.

`LLMEngine` is the streaming core (vLLM's names): `add_request`, `step`, `abort_request`. Each step
the scheduler picks what runs (`StepPlan`), the runner executes it and samples, the scheduler
advances the requests, and each request's `OutputBuilder` turns its new token into text and decides
whether it stops; finished requests give back their pages and slot. `LLM` is the offline API on
top: hand it all prompts, get all outputs back in order.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import PageAllocator, pages_for_tokens
from numba_vllm.engine.lengths import LengthPolicy
from numba_vllm.engine.output import OutputBuilder, RequestOutput
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import Scheduler, StepPlan
from numba_vllm.engine.stats import EngineStats, StepStats, collect_stats, step_stats
from numba_vllm.engine.structured import StructuredOutputs
from numba_vllm.executor.backend import create_runner, prepare_backend, resolve_backend
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint

WARM_UP_GRAPH_TOKENS = 4096  # `warm_up` records decode graphs for sequences up to this long; longer ones on first use

_STATUS_OF_REASON = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


class StepFailedError(RuntimeError):
    """`LLM.generate` / `LLM.chat`: a step failed, and with it a request of the call (the engine
    itself stays usable; `LLMEngine.step` explains)."""


class LLMEngine:
    """Continuous (or, for comparison, static) batching over batch slots and a waiting queue, with
    one of three runners."""

    def __init__(self, checkpoint: Checkpoint, engine_config: EngineConfig | None = None):
        self.checkpoint = checkpoint
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
        eos_ids = [*self.config.eos_token_ids, *(self.tokenizer.stop_token_ids if self.tokenizer is not None else ())]
        self.structured = StructuredOutputs(self.tokenizer, self.config.vocab_size, eos_ids)  # compiles constraints
        self._builders: dict[str, OutputBuilder] = {}
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
        structured-output constraint that does not compile (`GrammarError`).
        """
        if request_id in self._builders:
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
        grammar = self.structured.matcher(constraint) if constraint is not None else None  # GrammarError: a ValueError
        request = Request(request_id, ids, params, next(self._arrivals), grammar=grammar)
        self.scheduler.add(request)
        output = RequestOutput(request_id, ids, prompt=text)
        budget = self.lengths.max_new_tokens(len(ids), params.max_tokens)
        self._builders[request_id] = OutputBuilder(output, params, self.config, self.tokenizer, budget)
        return output

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (queued or running); its pages and slot are freed."""
        builder = self._builders.pop(request_id, None)
        if builder is not None and self.scheduler.abort(request_id):
            builder.abort()
            self.runner.release(request_id)

    def warm_up(self) -> None:
        """Compile the kernels and record the decode-step CUDA graphs (for sequences of up to
        `WARM_UP_GRAPH_TOKENS`) now, before the first request: a server does this once at start-up so
        no request pays for it. Nothing to do on the numpy backend; slow in the simulator."""
        warm = getattr(self.runner, "warm_up", None)
        if warm is not None:
            warm(pages_for_tokens(min(self.capacity.max_model_len, WARM_UP_GRAPH_TOKENS)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return the outputs that got a token, and
        those that failed.

        A step whose runner raises fails the requests it scheduled, and only those: each ends with
        finish_reason "error" and `RequestOutput.error` saying why (the exception is kept in
        `last_step_error`), its pages and slot freed; requests that were waiting or preempted are
        untouched, and the scheduler is ready for the next step. Retrying the same batch could fail
        the same way forever, so the engine gives those requests up. A KeyboardInterrupt during the
        forward pass fails nobody: the step is dropped as if it never ran, and the interrupt goes on.
        """
        plan = self.scheduler.schedule()
        self._last_plan = (self.num_steps, plan)
        if self.engine_config.verbose:
            print(f"step {self.num_steps}:", *plan.describe(self.scheduler.allocator), sep="\n", file=sys.stderr)
        try:
            sampled = self.runner.execute(plan) if not plan.is_empty else {}
        except BaseException as e:
            self.scheduler.discard(plan)
            if not isinstance(e, Exception):
                raise
            self.num_failed_steps += 1
            self.last_step_error = e
            message = f"the engine step failed: {type(e).__name__}: {e}"
            return [self._fail(seq.request, message) for seq in plan.sequences]
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted_request_ids)
        updated = []
        for request in self.scheduler.update(plan, sampled):
            builder = self._builders[request.request_id]
            output = builder.output
            output.num_cached_tokens = request.num_cached_tokens
            token = request.output_token_ids[-1]
            grammar = request.grammar
            if grammar is not None and not grammar.accept(token):  # the mask allowed it: a bug, or llguidance's limits
                updated.append(self._fail(request, f"structured output: token {token} does not fit the grammar: {grammar.error}"))
                continue
            builder.add(token, stop=grammar is not None and grammar.is_finished)
            if output.finished:
                self.scheduler.finish(request, _STATUS_OF_REASON[output.finish_reason])
                self.runner.release(request.request_id)
                del self._builders[request.request_id]
            updated.append(output)
        return updated

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End a request whose step failed (FINISHED_ERROR): pages and slot freed, output marked."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self.runner.release(request.request_id)
        builder = self._builders.pop(request.request_id)
        builder.fail(message)
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
    """Offline inference: `LLM(model).generate(prompts, params)` -> outputs in prompt order."""

    def __init__(self, model: str | None = None, backend: str = "auto", **engine_args):
        engine_config = EngineConfig(backend=backend, **engine_args)
        prepare_backend(engine_config.backend)
        self.engine = LLMEngine(load_checkpoint(model), engine_config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion, batched; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
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
                failed = next((o for o in updated if o.finish_reason == "error"), None)
                if failed is not None:
                    raise StepFailedError(f"request {failed.request_id}: {failed.error}") from self.engine.last_step_error
                if bar is not None:
                    input_tokens += sum(len(o.prompt_token_ids) for o in updated if len(o.token_ids) == 1)
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


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
