"""A request's edits to its logits before sampling, as a short list of (token, edit) entries per step.

What vLLM applies before temperature, in its order, for one row of logits z (V,):

1. `bad_words`: a bad word's last token is masked (-inf) when the output ends with the word's other
   tokens (every word is tried as tokenized alone and after a space, as vLLM does);
2. `min_tokens`: while fewer than min_tokens tokens are out, the stop ids (EOS unless `ignore_eos`,
   and `stop_token_ids`) are masked;
3. `logit_bias`: z[t] += bias[t];
4. `repetition_penalty` r over tokens of the prompt or the output: z[t] / r if z[t] > 0 else z[t] * r;
5. `frequency_penalty` f and `presence_penalty` p over output tokens: z[t] -= f * count[t] + p.

Every edit touches only a few tokens, so a row's edits are a list of entries with distinct tokens,
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
        self.prompt_tokens = set(prompt_token_ids) if params.repetition_penalty != 1 else set()
        self.stop_ids = sorted(set(stop_ids)) if params.min_tokens else []
        self.bad_words = [w for w in bad_words if w]
        self.output_counts: Counter[int] = Counter()
        self._num_counted = 0  # output tokens already in output_counts

    def row(self, output_token_ids: Sequence[int]) -> RowEdits:
        """The entries of the step that samples output token len(output_token_ids)."""
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
        penalised = p.presence_penalty or p.frequency_penalty
        tokens = set(masked) | set(p.logit_bias or ())
        if p.repetition_penalty != 1:
            tokens |= self.prompt_tokens | self.output_counts.keys()
        elif penalised:
            tokens |= self.output_counts.keys()
        ids = np.array(sorted(tokens), np.int32)  # (N,)
        bias = p.logit_bias or {}
        seen = self.prompt_tokens | self.output_counts.keys() if p.repetition_penalty != 1 else ()
        return RowEdits(
            tokens=ids,
            flags=np.array([(SEEN if t in seen else 0) | (MASKED if t in masked else 0) for t in ids.tolist()], np.int32),
            counts=np.array([self.output_counts.get(t, 0) for t in ids.tolist()], np.int32),
            bias=np.array([bias.get(t, 0.0) for t in ids.tolist()], np.float32),
            penalties=(float(p.repetition_penalty), float(p.frequency_penalty), float(p.presence_penalty)),
        )


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
