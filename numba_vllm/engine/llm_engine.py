"""The engine: requests in, tokens out, many at once over a paged KV cache.

`LLMEngine` is the streaming core (vLLM's names): `add_request`, `step`, `abort_request`. Each step
the scheduler picks what runs (`StepPlan`), the runner executes it and samples, the scheduler
advances the requests, and each request's `OutputBuilder` turns its new token into text and decides
whether it stops; finished requests give back their pages and slot. `LLM` is the offline API on
top: hand it all prompts, get all outputs back in order.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence

from numba_vllm.engine.config import EngineConfig
from numba_vllm.engine.kv_cache import PageAllocator, pages_for_tokens
from numba_vllm.engine.output import OutputBuilder, RequestOutput, check_prompt
from numba_vllm.engine.request import Request, RequestStatus
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import Scheduler
from numba_vllm.engine.stats import EngineStats, collect_stats
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint

HOST_CACHE_SEQUENCES = 4  # numpy / sim default: a cache that holds this many full-length sequences
DEFAULT_MAX_MODEL_LEN_CPU = 4096  # numpy / sim default length cap (the model's own may be 128k)
WARM_UP_GRAPH_TOKENS = 4096  # `warm_up` records decode graphs for sequences up to this long; longer ones on first use

_STATUS_OF_REASON = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


class LLMEngine:
    """Continuous (or, for comparison, static) batching over batch slots and a waiting queue, with
    one of three runners."""

    def __init__(self, checkpoint: Checkpoint, engine_config: EngineConfig | None = None):
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.engine_config = ec = engine_config or EngineConfig()
        self.backend = resolve_backend(ec.backend)
        max_len = min(ec.max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        if self.backend == "cuda":
            from numba_vllm.executor.kernel_runner import KernelRunner

            self.runner = KernelRunner.for_gpu(checkpoint, ec, max_len)
            num_pages = self.runner.num_pages
        else:
            if ec.max_model_len is None:
                max_len = min(max_len, DEFAULT_MAX_MODEL_LEN_CPU)
            num_pages = ec.num_pages or 1 + HOST_CACHE_SEQUENCES * pages_for_tokens(max_len)
            if self.backend == "sim":
                from numba_vllm.executor.kernel_runner import KernelRunner

                self.runner = KernelRunner.for_simulator(checkpoint, ec, num_pages)
            else:
                from numba_vllm.executor.numpy_runner import NumpyRunner

                self.runner = NumpyRunner(self.config, checkpoint.weights, num_pages)
        self.scheduler = Scheduler(
            ec.max_num_seqs, ec.max_num_batched_tokens, PageAllocator(num_pages), max_len, scheduling=ec.scheduling
        )
        self.max_model_len = self.scheduler.max_model_len  # may be below max_len when the cache is small
        self._builders: dict[str, OutputBuilder] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0  # requests that lost their pages and recomputed, over the engine's life

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> RequestOutput:
        """Queue a prompt (text, or token ids); returns its output, filled in as steps run.

        A prompt the model cannot run (empty, too long for `max_model_len` or for the whole cache,
        ids outside the vocabulary) raises ValueError for this request alone.
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
        check_prompt(ids, self.config, self.max_model_len)
        request = Request(request_id, ids, params, next(self._arrivals))
        self.scheduler.add(request)  # raises RequestTooLongError (a ValueError) if no cache could hold it
        output = RequestOutput(request_id, ids, prompt=text)
        self._builders[request_id] = OutputBuilder(output, params, self.config, self.tokenizer, self.max_model_len)
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
            warm(pages_for_tokens(min(self.max_model_len, WARM_UP_GRAPH_TOKENS)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return the outputs that got a token."""
        plan = self.scheduler.schedule()
        if self.engine_config.verbose:
            print(f"step {self.num_steps}:", *plan.describe(), sep="\n", file=sys.stderr)
        sampled = self.runner.execute(plan) if not plan.is_empty else {}
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted_request_ids)
        updated = []
        for request in self.scheduler.update(plan, sampled):
            builder = self._builders[request.request_id]
            builder.add(request.output_token_ids[-1])
            output = builder.output
            if output.finish_reason is None and request.num_tokens >= self.max_model_len:
                output.finish_reason = "length"  # the cache cannot hold another token of it
            if output.finished:
                self.scheduler.finish(request, _STATUS_OF_REASON[output.finish_reason])
                self.runner.release(request.request_id)
                del self._builders[request.request_id]
            updated.append(output)
        return updated

    # ---- state ---------------------------------------------------------------------------------
    def stats(self, requests: bool = False) -> EngineStats:
        """A snapshot of slots, pages and counters, for readers outside the engine (server metrics,
        banners, benchmarks); with ``requests``, also each running and waiting request. Call it on
        the thread that steps the engine; the snapshot itself may go to any thread."""
        return collect_stats(self.scheduler, self.num_steps, self.num_preemptions, requests)


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
                updated = self.engine.step()  # each got exactly one new token
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


def resolve_backend(backend: str) -> str:
    """`auto` -> `cuda` when a GPU is usable, else `numpy`; `sim` requires the simulator to be on."""
    if backend == "auto":
        return "cuda" if gpu_available() else "numpy"
    if backend == "sim" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise ValueError("backend 'sim' needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported (numba-vllm run does this)")
    if backend == "cuda":
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            raise ValueError("backend 'cuda' cannot run with NUMBA_ENABLE_CUDASIM=1 set; use --backend sim")
        if not gpu_available():
            raise ValueError("backend 'cuda' needs an NVIDIA GPU with a working driver; none is usable here")
    return backend


def prepare_backend(backend: str) -> None:
    """Turn the simulator on for `sim` if numba's CUDA module is not imported yet (it reads the
    variable once, at import)."""
    if backend == "sim" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        if "numba.cuda" in sys.modules:
            raise ValueError("backend 'sim' must be chosen before numba.cuda is imported; set NUMBA_ENABLE_CUDASIM=1")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def gpu_available() -> bool:
    """Whether numba can use a real CUDA GPU here (never true under the simulator)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # no driver, broken install: no GPU
        return False
