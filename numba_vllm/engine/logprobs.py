"""Logprobs in vLLM's shapes: for each position, a dict token id -> Logprob(logprob, rank, decoded_token).

What is computed (vLLM's default, "raw logprobs"): the log-softmax of the model's raw logits, before
penalties, logit_bias, masks and temperature. For a position with its token t (the sampled one, or
the prompt's next token) and k requested: t's logprob and rank (1 + the number of tokens with a
larger logit, counting equal ones as ahead, as vLLM counts), and the top k tokens (ranks 1..k, ties
to the lower id). The dict holds the top k and t (t once, if it is among them).

Runners hand the engine `PositionLogprobs` (arrays, k + 1 values a position); the engine turns them
into dicts with decoded tokens (`to_dict`). `raw_logprobs` is the NumPy computation (the numpy
backend's); the device one is `kernels/logprobs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank in the vocabulary, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class PositionLogprobs:
    """The logprobs of P positions, as a runner computes them."""

    token_ids: np.ndarray  # (P,) int32 the token of each position (sampled, or the prompt's next)
    logprobs: np.ndarray  # (P,) float32 its logprob
    ranks: np.ndarray  # (P,) int32 its rank, 1-based
    top_ids: np.ndarray  # (P, k) int32 the top k tokens, most likely first
    top_logprobs: np.ndarray  # (P, k) float32 their logprobs


def raw_logprobs(logits: np.ndarray, token_ids: np.ndarray, k: int) -> PositionLogprobs:
    """Logprobs of rows of raw logits (P, V) float32 for tokens (P,), with the top k (NumPy)."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)  # (P, 1)
    lse = m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))  # (P, 1)
    rows = np.arange(len(z))
    chosen = z[rows, token_ids]  # (P,)
    order = np.lexsort((np.broadcast_to(np.arange(z.shape[1]), z.shape), -z), axis=1)[:, :k]  # (P, k) by value, then id
    return PositionLogprobs(
        token_ids=np.asarray(token_ids, np.int32),
        logprobs=(chosen - lse[:, 0]).astype(np.float32),
        ranks=(z >= chosen[:, None]).sum(axis=1).astype(np.int32),
        top_ids=order.astype(np.int32),
        top_logprobs=(np.take_along_axis(z, order, axis=1) - lse).astype(np.float32),
    )


def to_dicts(pos: PositionLogprobs, decode) -> list[dict[int, Logprob]]:
    """One dict per position: the top k, then the position's own token if not among them.
    `decode(token_id) -> str` gives decoded_token (None for no tokenizer)."""
    out = []
    for p in range(len(pos.token_ids)):
        d = {}
        for rank, (t, lp) in enumerate(zip(pos.top_ids[p].tolist(), pos.top_logprobs[p].tolist(), strict=True), 1):
            d[t] = Logprob(lp, rank, decode(t))
        t = int(pos.token_ids[p])
        if t not in d:
            d[t] = Logprob(float(pos.logprobs[p]), int(pos.ranks[p]), decode(t))
        out.append(d)
    return out


class LogprobsCollector:
    """One request's logprobs as steps deliver them, in vLLM's shapes: `logprobs` (one dict per
    output token, None when not asked), `cumulative_logprob` (the sum of the sampled tokens'
    logprobs), `prompt_logprobs` (None for the first prompt token, then one dict per prompt token).
    A preempted request recomputes its prompt: positions already collected are kept, not added twice."""

    def __init__(self, num_prompt_tokens: int, want_logprobs: bool, want_prompt_logprobs: bool, decode):
        self.num_prompt_tokens = num_prompt_tokens
        self.decode = decode
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if want_prompt_logprobs else None

    def add_sampled(self, pos: PositionLogprobs) -> None:
        """The logprobs of one sampled token (a one-position `pos`)."""
        self.logprobs.extend(to_dicts(pos, self.decode))
        self.cumulative_logprob += float(pos.logprobs[0])

    def add_prompt(self, first: int, pos: PositionLogprobs) -> None:
        """Logprobs of prompt tokens first, first + 1, ... (those not collected yet)."""
        have = len(self.prompt_logprobs)
        if first + len(pos.token_ids) <= have:
            return
        skip = max(0, have - first)
        if first + skip != have:
            raise RuntimeError(f"prompt logprobs from token {first} arrived with only {have} collected")
        rest = PositionLogprobs(*(a[skip:] for a in (pos.token_ids, pos.logprobs, pos.ranks, pos.top_ids, pos.top_logprobs)))
        self.prompt_logprobs.extend(to_dicts(rest, self.decode))
