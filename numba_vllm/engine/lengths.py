"""The length policy: what a prompt may hold and how long a request may grow, decided in one place.

`max_model_len` (prompt + output, in tokens) is fixed once, by capacity planning
(`executor/capacity.py`), before the engine accepts a request; every caller (the engine's
`add_request`, each request's output budget, the HTTP server's 400s, the scheduler's invariants)
asks this object instead of re-deriving it. The rules:

- a prompt must be non-empty, hold only ids inside the vocabulary, and leave room for at least one
  new token: ``len(prompt) < max_model_len``;
- a request generates at most ``min(max_tokens, max_model_len - len(prompt))`` tokens; without
  `max_tokens`, until it reaches `max_model_len` (finish reason "length");
- `check_max_tokens` is the strict form for callers whose user asked for a number explicitly (the
  OpenAI API answers 400, as vLLM does, rather than returning fewer tokens than were asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PromptError(ValueError):
    """A prompt cannot be run (empty, too long, or holding ids outside the vocabulary)."""


class MaxTokensError(ValueError):
    """An explicit max_tokens does not fit beside the prompt within max_model_len."""


@dataclass(frozen=True)
class LengthPolicy:
    """Prompt and output length limits of one engine."""

    max_model_len: int  # prompt + output tokens of one request, at most
    vocab_size: int  # valid token ids are 0 .. vocab_size - 1

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one new token), got {self.max_model_len}")

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Reject prompts the model cannot run, with one line saying why (`PromptError`)."""
        if len(prompt_ids) == 0:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length is {self.max_model_len} "
                "tokens (prompt plus at least one new token)"
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int, name: str = "max_tokens") -> None:
        """Reject an explicitly requested output length that does not fit (`MaxTokensError`)."""
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise MaxTokensError(
                f"{name} is too large: {max_tokens}; this model's maximum context length is {self.max_model_len} tokens "
                f"and the prompt has {num_prompt_tokens} ({num_prompt_tokens} + {max_tokens} > {self.max_model_len})"
            )

    def max_new_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """How many tokens a request may generate: its `max_tokens`, within the room left."""
        room = self.max_model_len - num_prompt_tokens
        return room if max_tokens is None else min(max_tokens, room)
