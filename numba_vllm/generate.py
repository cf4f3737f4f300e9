"""Generating one sequence: prefill the prompt, then decode token by token until a stop condition.

This is the plain loop every engine starts from (one request, a contiguous KV cache); the batched,
paged engine runs the same stop rules for many requests at once. Text is streamed as it becomes
final: an incremental detokenizer never yields half a UTF-8 character, and text that could still
turn out to be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .reference import KVCache, ReferenceModel
from .sampling import SamplingParams, sample
from .tokenizer import IncrementalDetokenizer, Tokenizer


class PromptError(ValueError):
    """A prompt cannot be run (empty, too long, or holding ids outside the vocabulary)."""


@dataclass
class Generation:
    """One finished request: what went in, what came out, and why it stopped."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS, stop id or stop string) or "length"


def check_prompt(prompt_ids: Sequence[int], config: ModelConfig, max_model_len: int) -> None:
    """Reject prompts the model cannot run, with one line saying why."""
    if len(prompt_ids) == 0:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise PromptError(
            f"the prompt has {len(prompt_ids)} tokens; the model's limit is {max_model_len} (prompt plus at least one new token)"
        )
    bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")


def stop_token_ids(config: ModelConfig, tokenizer: Tokenizer | None, params: SamplingParams) -> set[int]:
    """Every id that ends this request: the model's EOS ids (unless ignored) and the request's own."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
    return ids


def generate_stream(
    model: ReferenceModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> Iterator[tuple[str, Generation]]:
    """Yield (new text, generation so far) after every token; the last yield is finished.

    `max_model_len` caps prompt plus output (default: the model's max_position_embeddings).
    """
    config = model.config
    max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    prompt_ids = [int(t) for t in prompt_ids]
    check_prompt(prompt_ids, config, max_model_len)
    budget = max_model_len - len(prompt_ids)
    max_new = budget if params.max_tokens is None else min(params.max_tokens, budget)
    stops = stop_token_ids(config, tokenizer, params)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
    held = _StopStringFilter(params.stop)
    rng = params.make_rng()
    cache = KVCache(config, len(prompt_ids) + max_new)
    out = Generation(prompt_token_ids=prompt_ids)

    logits = model.forward(np.asarray(prompt_ids), 0, cache)  # prefill: (V,)
    while True:
        token = sample(logits, params, rng)
        out.token_ids.append(token)  # a stop token is kept in the ids, never in the text
        delta = ""
        if token in stops:
            out.finish_reason = "stop"
        elif detok is not None:
            delta, hit = held.push(detok.add(token))
            if hit:
                out.finish_reason = "stop"
        if out.finish_reason is None and len(out.token_ids) >= max_new:
            out.finish_reason = "length"
        if out.finish_reason is not None and detok is not None and not held.hit:
            tail, hit = held.push(detok.flush())  # bytes still waiting for their UTF-8 sequence
            delta += tail + held.flush()
            if hit:
                out.finish_reason = "stop"
        out.text += delta
        yield delta, out
        if out.finish_reason is not None:
            return
        logits = model.forward(np.asarray([token]), len(prompt_ids) + len(out.token_ids) - 1, cache)


def generate(
    model: ReferenceModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> Generation:
    """Run one request to completion and return it."""
    out = None
    for _, out in generate_stream(model, prompt_ids, params, tokenizer, max_model_len):
        pass
    assert out is not None  # generate_stream always yields at least once
    return out


class _StopStringFilter:
    """Holds back streamed text that might be the start of a stop string; cuts at a full match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.hit = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text now safe to emit, whether a stop string was found)."""
        if self.hit:
            return "", True
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = max(len(s) for s in self.stops) - 1  # the longest tail that could begin a stop string
        safe = len(self.pending) - keep
        if safe <= 0:
            return "", False
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
