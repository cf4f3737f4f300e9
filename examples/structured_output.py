"""Structured output: the answer is JSON that matches a schema (or a regex, or one of a few choices).

    python examples/structured_output.py                  # default model (SmolLM2), GPU if usable, else NumPy
    python examples/structured_output.py --backend numpy

A `StructuredOutputsParams` in the request's SamplingParams is compiled (by llguidance) into a
grammar over the model's tokens; each step, the tokens the grammar forbids next are masked out
before sampling, so even a small model at temperature 1 writes text that parses. The server takes
the same constraint as OpenAI's `response_format` or vLLM's `structured_outputs` (docs/server.md).
"""

from __future__ import annotations

import argparse
import json

from numba_vllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"enum": ["cats", "dogs", "books", "music"]}, "maxItems": 3},
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim", "numpy"])
    args = parser.parse_args(argv)

    llm = LLM(args.model, backend=args.backend)
    print(f"backend: {llm.engine.backend}")
    question = [{"role": "user", "content": "Invent a person: their name, age and what they like."}]
    person = StructuredOutputsParams(json=SCHEMA)
    for seed in (0, 1):  # sampled at temperature 1: different people, always the schema's shape
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs=person)
        text = llm.chat(question, params, use_tqdm=False)[0].outputs[0].text
        print(f"json (seed {seed}): {text}")
        print(f"   parsed: {json.loads(text)}")

    for label, question, constraint in [
        ("choice", "Which city is in Spain?", StructuredOutputsParams(choice=["Paris", "London", "Madrid"])),
        ("regex", "When did the Berlin wall fall?", StructuredOutputsParams(regex=r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")),
    ]:
        params = SamplingParams(temperature=0, structured_outputs=constraint)
        out = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)
        print(f"{label}: {out[0].outputs[0].text}")


if __name__ == "__main__":
    main()
