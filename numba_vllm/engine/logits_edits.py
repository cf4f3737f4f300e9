"""A request's edits to its logits before sampling, as a short list of (token, edit) entries per step.

What vLLM applies before temperature, in its order, for one row of logits z (V,):

1. `bad_words`: a bad word's last token is masked (-inf) when the output ends with the word's other
   tokens (every word is tried as tokenized alone and after a space, as vLLM does);
2. `min_tokens`: while fewer than min_tokens tokens are out, the stop ids (EOS unless `ignore_eos`,
   and `stop_token_ids`) are masked;
3. `logit_bias`: z[t] += bias[t];
4. `repetition_penalty` r over tokens of the prompt or the output: z[t] / r if z[t] > 0 else z[t] * r;
5. `frequency_penalty` f and `presence_penalty` p over output tokens: z[t] -= f * count[t] + p.

Every edit touches only a few tokens (repetition_penalty: the prompt's distinct tokens too), so a
row's edits are a list of entries with distinct tokens,
each entry carrying everything done to its token: (token, flags, output count, bias), flags
`SEEN` (in the prompt or output: repetition applies) and `MASKED`. The device kernel
(`kernels/logits_edits.py`) and `apply_edits` below (the NumPy backend) apply the same entries, so
the host decides once per step what each row needs; a row without edits has no entries and its
logits are never touched. Per-request state (the output token counts, updated as tokens come) lives
in `LogitsEdits`, made when the request is added.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from numba_vllm.engine.sampling import SamplingParams

SEEN = 1  # entry flag: the token is in the prompt or the output (repetition_penalty applies)
MASKED = 2  # entry flag: the token is masked (-inf), nothing else applies


@dataclass
class RowEdits:
    """One row's entries (N distinct tokens) and its penalties."""

    tokens: np.ndarray  # (N,) int32 token ids, distinct
    flags: np.ndarray  # (N,) int32 SEEN | MASKED bits
    counts: np.ndarray  # (N,) int32 occurrences in the output
    bias: np.ndarray  # (N,) float32 logit_bias (0 where none)
    penalties: tuple[float, float, float]  # (repetition, frequency, presence)


class LogitsEdits:
    """One request's edit state: its prompt's tokens, its output's token counts, its masks."""

    def __init__(
        self, params: SamplingParams, prompt_token_ids: Sequence[int], stop_ids: Iterable[int], bad_words: list[list[int]]
    ):
        """`stop_ids`: the ids min_tokens masks (EOS unless ignore_eos, and stop_token_ids);
        `bad_words`: each bad word's token ids (every tokenization to try)."""
        self.params = params
        self.repetition = params.repetition_penalty != 1
        self.penalised = bool(params.presence_penalty or params.frequency_penalty)
        self.prompt_tokens = np.unique(np.asarray(prompt_token_ids, np.int32)) if self.repetition else _NONE  # (P,) sorted
        self.stop_ids = sorted(set(stop_ids)) if params.min_tokens else []
        self.bad_words = [w for w in bad_words if w]
        bias = params.logit_bias or {}
        self.bias_tokens = np.array(sorted(bias), np.int32)  # (Nb,) sorted
        self.bias_values = np.array([bias[t] for t in sorted(bias)], np.float32)  # (Nb,)
        self.output_counts: Counter[int] = Counter()
        self._num_counted = 0  # output tokens already in output_counts

    def row(self, output_token_ids: Sequence[int]) -> RowEdits:
        """The entries of the step that samples output token len(output_token_ids).

        The few tokens the output, the masks and the bias name are worked out here; under
        repetition_penalty the prompt's other distinct tokens (thousands, for a long prompt) follow
        as plain SEEN entries, copied from the sorted array made once (~0.1 ms for 70k of them)."""
        p = self.params
        for t in output_token_ids[self._num_counted :]:
            self.output_counts[t] += 1
        self._num_counted = len(output_token_ids)
        masked = set()
        if len(output_token_ids) < p.min_tokens:
            masked.update(self.stop_ids)
        for word in self.bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(output_token_ids) and list(output_token_ids[len(output_token_ids) - len(prefix) :]) == prefix:
                masked.add(word[-1])
        masked_ids = np.array(sorted(masked), np.int32)  # (M,)
        out_ids = np.fromiter(self.output_counts.keys(), np.int32, len(self.output_counts))  # (O,)
        out_counts = np.fromiter(self.output_counts.values(), np.int32, len(self.output_counts))
        parts = [masked_ids, self.bias_tokens] + ([out_ids] if self.repetition or self.penalised else [])
        ids = np.unique(np.concatenate(parts)).astype(np.int32)  # (N,) sorted, distinct: the named tokens
        flags = np.where(np.isin(ids, masked_ids), MASKED, 0).astype(np.int32)
        counts = _scatter(ids, out_ids, out_counts, np.int32)
        bias = _scatter(ids, self.bias_tokens, self.bias_values, np.float32)
        if self.repetition:
            in_prompt = _positions_in(self.prompt_tokens, ids)  # (N,) index into prompt_tokens, or -1
            flags |= np.where((in_prompt >= 0) | np.isin(ids, out_ids), SEEN, 0).astype(np.int32)
            rest = np.ones(len(self.prompt_tokens), bool)
            rest[in_prompt[in_prompt >= 0]] = False
            rest_ids = self.prompt_tokens[rest]  # (P',) the prompt's tokens not named above
            ids = np.concatenate([ids, rest_ids])
            flags = np.concatenate([flags, np.full(len(rest_ids), SEEN, np.int32)])
            counts = np.concatenate([counts, np.zeros(len(rest_ids), np.int32)])
            bias = np.concatenate([bias, np.zeros(len(rest_ids), np.float32)])
        return RowEdits(
            tokens=ids, flags=flags, counts=counts, bias=bias,
            penalties=(float(p.repetition_penalty), float(p.frequency_penalty), float(p.presence_penalty)),
        )  # fmt: skip


def _positions_in(sorted_ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each key, its index in `sorted_ids`, or -1 where it is absent."""
    if not len(sorted_ids):
        return np.full(len(keys), -1, np.int64)
    at = np.minimum(np.searchsorted(sorted_ids, keys), len(sorted_ids) - 1)
    return np.where(sorted_ids[at] == keys, at, -1)


_NONE = np.zeros(0, np.int32)


def _scatter(ids: np.ndarray, keys: np.ndarray, values: np.ndarray, dtype) -> np.ndarray:
    """values placed at the positions of `keys` in the sorted `ids` (0 elsewhere; keys not in ids dropped)."""
    out = np.zeros(len(ids), dtype)
    at = _positions_in(ids, keys)
    out[at[at >= 0]] = values[at >= 0]
    return out


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as tokenized alone and after a space (no special tokens), as vLLM tries both."""
    out = []
    for word in words:
        for text in (word, " " + word):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def apply_edits(logits: np.ndarray, edits: RowEdits) -> np.ndarray:
    """The edited copy of one row of logits (V,) float32 (the NumPy backend's version of the kernel)."""
    out = logits.astype(np.float32, copy=True)
    repetition, frequency, presence = (np.float32(x) for x in edits.penalties)
    z = out[edits.tokens] + edits.bias  # (N,)
    seen = (edits.flags & SEEN) != 0
    z = np.where(seen & (z > 0), z / repetition, np.where(seen, z * repetition, z))
    z = z - frequency * edits.counts.astype(np.float32) - np.where(edits.counts > 0, presence, np.float32(0))
    out[edits.tokens] = np.where((edits.flags & MASKED) != 0, np.float32(-np.inf), z)
    return out
