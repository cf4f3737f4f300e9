"""Continuous batching, step by step: requests arrive, wait, get slots and pages, and are preempted.

    python examples/continuous_batching.py                  # the default model (SmolLM2), NumPy unless a GPU is usable
    python examples/continuous_batching.py --tiny           # a tiny random Llama: no model needed, about a second
    python examples/continuous_batching.py --tiny --backend sim  # the same steps through the CUDA kernels, simulated: minutes
    python examples/continuous_batching.py --num-pages 20   # a bigger cache: no preemption
    python examples/continuous_batching.py --tiny --timeline steps.html    # the steps as a picture (or .png: matplotlib)
    python examples/continuous_batching.py --tiny --scheduling static --timeline static.png  # the same requests, static batching
    python examples/continuous_batching.py --tiny --prefix-caching  # prompts share their common first pages

The engine is driven by hand: `LLMEngine.add_request` when a request arrives, `LLMEngine.step` once
per forward pass. With `verbose`, each step prints the scheduler's plan (`StepPlan.describe`): one
line per batch slot (which request, prefill or decode, how many new tokens, their positions, how
many pages the request holds; "(chunk)" when a prompt is only partly prefilled), then the step's
token count, the free pages, the waiting queue's length and any request preempted this step. After
each step the example reads `LLMEngine.stats(requests=True)`, the engine's state as plain values, for
the waiting queue and each request's preemption count.

The settings are small on purpose: 3 slots, a budget of 16 tokens per step and 8 usable pages of
16 tokens (page 0 is the reserved null page). What to look for:
- waiting: a request that arrives while the slots or the step's token budget are taken stays in the
  queue (`queue:` below the plan) until a slot and enough budget and pages are free;
- chunked prefill: a 40-token prompt does not fit a 16-token budget, so it is prefilled 16 (or
  fewer) tokens a step, and only the step that reaches its last token samples;
- admission into freed slots: when a request finishes, its slot and pages go back, and the head of
  the queue takes them as soon as the step's token budget allows;
- preemption by recompute: when a running request needs a new page and none is free, the newest
  running request loses its pages and slot, goes back to the front of the queue with its generated
  tokens kept, and later prefills prompt + generated tokens again. Its output is unchanged.
Every request ignores EOS, so each one runs to its `max_tokens` and the schedule is the same for any
model.

With `--timeline FILE` the same steps are also drawn (`numba_vllm.viz.timeline`): a row per slot
and a column per step, colored by request, hatched while prefilling; below, the pages each request
holds and the queue's length. `--scheduling static` runs the same arrivals under static batching,
for the picture beside it: slots freed by early finishers stay empty until the whole batch is done.

model. Prefix caching (on by default in the engine) is off here unless `--prefix-caching`: every
prompt is the beginning of the same passage, so with it later requests take the earlier ones' full
pages instead of prefilling them ("pages 3 (2 shared)"), and pages are no longer scarce enough for
the preemption this example sets out to show.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from numba_vllm import LLMEngine, SamplingParams
from numba_vllm.engine.config import EngineConfig
from numba_vllm.executor.backend import prepare_backend
from numba_vllm.loading.checkpoint import Checkpoint, load_checkpoint, random_checkpoint
from numba_vllm.model.config import PAGE_SIZE
from numba_vllm.viz.timeline import Timeline, check_timeline_path

# (step it arrives at, request id, prompt tokens, max new tokens)
ARRIVALS = [
    (0, "A", 12, 28),
    (0, "B", 40, 16),
    (1, "C", 20, 24),
    (2, "D", 8, 12),
    (6, "E", 30, 12),
]

# Prompts are the first tokens of this text (a real model) or of random ids (the tiny model).
PASSAGE = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who could "
    "mend anything that ticked. Travellers came from far away with broken watches, silent music boxes and tired "
    "hearts, and each of them left with something that worked again."
)

# A tiny Llama (2 layers, 4 query heads sharing 2 kv heads): random weights, so its tokens are noise.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def tiny_checkpoint() -> Checkpoint:
    """A random-weight checkpoint of TINY_CONFIG (built in memory; no tokenizer)."""
    with tempfile.TemporaryDirectory() as config_dir:
        (Path(config_dir) / "config.json").write_text(json.dumps(TINY_CONFIG))
        return random_checkpoint(config_dir, seed=0)


def passage_ids(checkpoint: Checkpoint, num_tokens: int) -> list[int]:
    """At least `num_tokens` prompt ids: PASSAGE tokenized, or random ids for a model without a tokenizer."""
    if checkpoint.tokenizer is None:
        return np.random.default_rng(0).integers(3, checkpoint.config.vocab_size, num_tokens).tolist()
    ids = checkpoint.tokenizer.encode(PASSAGE)
    return (ids * (1 + num_tokens // len(ids)))[:num_tokens]  # repeated if a tokenizer packs it tighter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of a real model")
    parser.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim", "numpy"])
    parser.add_argument("--max-num-seqs", type=int, default=3, help="batch slots")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16, help="token budget of one step")
    parser.add_argument("--num-pages", type=int, default=9, help="KV-cache pages of 16 tokens, the null page included")
    parser.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    parser.add_argument("--timeline", metavar="FILE", help="also draw the steps to FILE: .html, or .png (matplotlib)")
    parser.add_argument("--prefix-caching", action="store_true", help="let prompts share the pages of their common beginning")
    args = parser.parse_args(argv)
    if args.tiny and args.model:
        parser.error("--tiny and --model exclude each other")
    if args.timeline:
        try:
            check_timeline_path(args.timeline)
        except ValueError as e:
            parser.error(str(e))

    prepare_backend(args.backend)  # `sim` turns the simulator on before numba.cuda is first imported
    checkpoint = tiny_checkpoint() if args.tiny else load_checkpoint(args.model)
    engine_config = EngineConfig(
        backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_pages=args.num_pages,
        scheduling=args.scheduling,
        enable_prefix_caching=args.prefix_caching,
        verbose=True,  # engine.step() prints its StepPlan
    )
    engine = LLMEngine(checkpoint, engine_config)
    num_usable_pages = engine.stats().num_pages
    model_name = "a tiny random Llama" if args.tiny else checkpoint.source.name
    timeline = Timeline(f"{args.scheduling} batching: {model_name}, {args.max_num_seqs} slots, "
                        f"{args.max_num_batched_tokens} tokens per step, {num_usable_pages} pages")  # fmt: skip
    print(f"{model_name}, backend {engine.backend}: {args.max_num_seqs} slots, "
          f"{args.max_num_batched_tokens} tokens per step, {num_usable_pages} pages of {PAGE_SIZE} tokens "
          f"(KV room for {num_usable_pages * PAGE_SIZE} tokens)")  # fmt: skip

    prompt_source = passage_ids(checkpoint, max(num_prompt for _, _, num_prompt, _ in ARRIVALS))
    arrivals = sorted(ARRIVALS)
    preemptions = {}  # request id -> times it was preempted, as last seen in the engine's stats
    outputs = {}  # request id -> RequestOutput, filled in as steps run
    # The verbose plan goes to stderr; send it to stdout so it interleaves with the lines printed here.
    with contextlib.redirect_stderr(sys.stdout):
        while arrivals or engine.has_unfinished_requests():
            print()
            while arrivals and arrivals[0][0] <= engine.num_steps:
                _, request_id, num_prompt, max_tokens = arrivals.pop(0)
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                try:
                    outputs[request_id] = engine.add_request(request_id, prompt_source[:num_prompt], params)
                except ValueError as e:  # e.g. a prompt longer than the whole cache: rejected alone
                    print(f"+ {request_id} rejected: {e}")
                    continue
                print(f"+ {request_id} arrives: {num_prompt}-token prompt, up to {max_tokens} new tokens")
            for out in engine.step():  # prints "step N:" and the plan, runs the model, samples
                if out.finished:
                    c = out.outputs[0]
                    print(f"- {out.request_id} finished ({c.finish_reason}) with {len(c.token_ids)} new tokens: "
                          "its pages and slot are free for the next step")  # fmt: skip
            timeline.record(engine)
            stats = engine.stats(requests=True)
            # A preempted request is still queued when the step that preempted it ends: no preemption is missed.
            preemptions.update((r.request_id, r.num_preemptions) for r in stats.running + stats.waiting)
            if stats.waiting:
                print(f"  queue: {' '.join(r.request_id for r in stats.waiting)}")

    print(f"\nsteps: {engine.num_steps}, preemptions: {engine.num_preemptions}")
    for request_id, out in outputs.items():
        c = out.outputs[0]
        shown = repr(c.text) if checkpoint.tokenizer is not None else f"ids {c.token_ids}"
        print(f"{request_id}: {len(out.prompt_token_ids)} prompt + {len(c.token_ids)} new tokens, "
              f"finish_reason={c.finish_reason}, preemptions={preemptions.get(request_id, 0)}: {shown}")  # fmt: skip
    if args.timeline:
        print(f"timeline: {timeline.write(args.timeline)}")


if __name__ == "__main__":
    main()
