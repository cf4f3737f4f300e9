"""What structured output costs a decode step: B requests decoded with no constraint, then with a
JSON schema (and a regex), same prompts, same seeds; milliseconds per step where every request got
a token (median), and the share of it spent on the host computing the token masks. The regex run's
texts are checked against the regex (every prefix of a match is one), which checks the mask on the
backend measured.

    python benchmarks/structured_output.py --model DIR_OR_GGUF [--batch 32] [--steps 64] [--backend cuda]
    python benchmarks/structured_output.py --random-weights tests/data/llama-3.2-1b-instruct --tokenizer DIR_OR_GGUF

`--random-weights` takes a config directory (random bf16 weights, as `bench latency`); the grammar
then needs a tokenizer from elsewhere (`--tokenizer`: a directory holding tokenizer.json and a
tokenizer_config.json naming its eos_token, or a GGUF file) whose ids fit the config's vocabulary; its
EOS replaces the config's. A random model picks among the allowed tokens almost
uniformly, so inside the JSON string most tokens are allowed and requests rarely
close their object early; steps after the first request finished are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
from pathlib import Path

import numpy as np

from numba_vllm.bench.common import EngineOptions, build_engine, load_model, random_token_ids, synchronize, warm_up
from numba_vllm.engine import structured
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.structured import StructuredOutputsParams
from numba_vllm.executor import kernel_runner, numpy_runner
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint
from numba_vllm.loading.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}}, "required": ["answer"]}
CONSTRAINTS = {
    "none": None,
    "json schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[a-z ]+"),
}
PROMPT_LEN = 128


def run(engine, prompts, constraint, steps: int, mask_seconds: list[float]) -> tuple[list[tuple[float, float]], list[str]]:
    """Decode `prompts` together for up to `steps` tokens: ((step time, mask time) of the steps while
    every request runs, the texts)."""
    outs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=steps, ignore_eos=True, structured_outputs=constraint)
        outs.append(engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params))
    times = []
    while engine.has_unfinished_requests():
        mask_seconds.clear()
        t0 = time.perf_counter()
        engine.step()
        synchronize(engine.backend)
        elapsed = time.perf_counter() - t0
        if all(len(o.outputs[0].token_ids) > 1 for o in outs) and not any(o.finished for o in outs):
            times.append((elapsed, sum(mask_seconds)))
    return times, [o.outputs[0].text for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--random-weights")
    ap.add_argument("--tokenizer", help="with --random-weights: a model directory or GGUF whose tokenizer the grammar uses")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    ckpt, what, _ = load_model(args.model, args.random_weights)
    if args.tokenizer:
        path = Path(args.tokenizer)
        tokenizer = Tokenizer.from_dir(path) if path.is_dir() else load_checkpoint(path).tokenizer
        if not tokenizer.stop_token_ids:
            raise SystemExit(f"{path}: the tokenizer names no end-of-sequence token (tokenizer_config.json's eos_token)")
        # The grammar ends at the tokenizer's EOS; the config's ids belong to another vocabulary.
        config = dataclasses.replace(ckpt.config, eos_token_ids=tuple(tokenizer.stop_token_ids))
        ckpt = Checkpoint(config, ckpt.weights, tokenizer, ckpt.source)
    options = EngineOptions(backend=args.backend, max_num_seqs=max(args.batch, 8))
    engine, _ = build_engine(ckpt, options.engine_config(PROMPT_LEN + args.steps + 16))
    warm_up(engine, PROMPT_LEN)
    rng = np.random.default_rng(0)
    prompts = [random_token_ids(rng, PROMPT_LEN, ckpt.config.vocab_size) for _ in range(args.batch)]

    mask_seconds: list[float] = []  # host time in fill_token_bitmasks during the current step
    fill = structured.fill_token_bitmasks

    def timed_fill(matchers, bitmask):
        t0 = time.perf_counter()
        fill(matchers, bitmask)
        mask_seconds.append(time.perf_counter() - t0)

    for module in (kernel_runner, numpy_runner):
        module.fill_token_bitmasks = timed_fill
    print(f"{what}, backend {args.backend}, batch {args.batch}, prompts of {PROMPT_LEN} random ids, temperature 1")
    print(f"{'constraint':<12} {'steps':>5} {'ms/step':>8} {'masks ms':>9}")
    for name, constraint in CONSTRAINTS.items():
        run(engine, prompts, constraint, 4, mask_seconds)  # compiles the grammar, records graphs
        times, texts = run(engine, prompts, constraint, args.steps, mask_seconds)
        valid = ""
        if constraint is not None and constraint.regex is not None:
            valid = f"  {sum(re.fullmatch(constraint.regex, t) is not None for t in texts)}/{len(texts)} texts match"
        if not times:
            print(f"{name:<12} every run had a request finish at once{valid}")
            continue
        step_ms = statistics.median(t for t, _ in times) * 1e3
        mask_ms = statistics.median(m for _, m in times) * 1e3
        print(f"{name:<12} {len(times):>5} {step_ms:>8.3f} {mask_ms:>9.3f}{valid}")


if __name__ == "__main__":
    main()
