"""Generating one sequence on the NumPy reference model: prefill the prompt, then decode token by token.

This is the plain loop every engine starts from (one request, a contiguous KV cache); stop rules
and streaming text come from `output.OutputBuilder`, which the batched engine uses too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .output import OutputBuilder, RequestOutput, check_prompt
from .reference import KVCache, ReferenceModel
from .sampling import SamplingParams, sample
from .tokenizer import Tokenizer


def generate_stream(
    model: ReferenceModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> Iterator[tuple[str, RequestOutput]]:
    """Yield (new text, output so far) after every token; the last yield is finished.

    `max_model_len` caps prompt plus output (default: the model's max_position_embeddings).
    """
    config = model.config
    max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    out = RequestOutput("0", [int(t) for t in prompt_ids])
    check_prompt(out.prompt_token_ids, config, max_model_len)
    builder = OutputBuilder(out, params, config, tokenizer, max_model_len)
    rng = params.make_rng()
    cache = KVCache(config, len(out.prompt_token_ids) + builder.max_new_tokens)

    logits = model.forward(np.asarray(out.prompt_token_ids), 0, cache)  # prefill: (V,)
    while True:
        token = sample(logits, params, rng)
        delta = builder.add(token)
        yield delta, out
        if out.finished:
            return
        logits = model.forward(np.asarray([token]), len(out.prompt_token_ids) + len(out.token_ids) - 1, cache)


def generate(
    model: ReferenceModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> RequestOutput:
    """Run one request to completion and return it."""
    out = None
    for _, out in generate_stream(model, prompt_ids, params, tokenizer, max_model_len):
        pass
    return out
