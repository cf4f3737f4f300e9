"""Offline batch inference: hand the engine every prompt at once, get every output back in order.

    python examples/offline_batch.py                     # default model (SmolLM2), GPU if usable, else NumPy
    python examples/offline_batch.py --backend numpy     # the NumPy reference model, anywhere
    python examples/offline_batch.py --backend sim       # the CUDA kernels in the Numba simulator (slow)
    python examples/offline_batch.py --model path/to/Llama-3.2-1B-Instruct --max-tokens 64

`LLM.generate` and `LLM.chat` queue all requests and run them with continuous batching; each request
keeps its own SamplingParams (greedy or sampled, its own seed). `examples/continuous_batching.py`
shows the steps in between.
"""

from __future__ import annotations

import argparse

from numba_vllm import LLM, SamplingParams


def show(labels: list[str], outputs) -> None:
    """Print each output: what it answers, its text, why it stopped, and its token counts."""
    for label, out in zip(labels, outputs, strict=True):
        print(f"-- {label}")
        c = out.outputs[0]
        print(f"   {c.text!r}")
        print(f"   finish_reason={c.finish_reason}, {len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim", "numpy"])
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per request at most")
    args = parser.parse_args(argv)

    llm = LLM(args.model, backend=args.backend)  # loads the model; "auto": the GPU if usable, else NumPy
    print(f"backend: {llm.engine.backend}")
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)

    # Plain text completion: one batch, each prompt with its own sampling parameters.
    requests = [("The capital of France is", greedy), ("The capital of France is", sampled), ("Once upon a time,", greedy)]
    outputs = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests])
    show([f"generate, {'greedy' if params.greedy else 'sampled'}: {prompt!r}" for prompt, params in requests], outputs)

    # Chat: the model's chat template turns each conversation into a prompt.
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": "Name a planet."}],
    ]
    outputs = llm.chat(conversations, greedy)
    show([f"chat, greedy: {c[-1]['content']!r}" for c in conversations], outputs)


if __name__ == "__main__":
    main()
