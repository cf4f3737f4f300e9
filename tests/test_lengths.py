"""The length policy: prompt checks and output budgets, the one place they are decided."""

import pytest

from numba_vllm.engine.lengths import LengthPolicy, MaxTokensError, PromptError

POLICY = LengthPolicy(max_model_len=10, vocab_size=128)


def test_prompt_checks():
    with pytest.raises(PromptError, match="empty"):
        POLICY.check_prompt([])
    with pytest.raises(PromptError, match="the prompt has 10 tokens; this model's maximum context length is 10"):
        POLICY.check_prompt([1] * 10)
    with pytest.raises(PromptError, match="token id 128 is outside the vocabulary"):
        POLICY.check_prompt([1, 128])
    with pytest.raises(PromptError, match="token id -1"):
        POLICY.check_prompt([-1])
    POLICY.check_prompt([0, 127] * 4 + [5])  # 9 tokens: room for one more


def test_output_budget_is_max_tokens_within_the_room_left():
    assert POLICY.max_new_tokens(4, None) == 6
    assert POLICY.max_new_tokens(4, 3) == 3
    assert POLICY.max_new_tokens(4, 50) == 6
    assert POLICY.max_new_tokens(9, 1) == 1


def test_an_explicit_max_tokens_that_does_not_fit_is_refused():
    POLICY.check_max_tokens(4, 6)
    with pytest.raises(MaxTokensError, match=r"max_completion_tokens is too large: 7; .* \(4 \+ 7 > 10\)"):
        POLICY.check_max_tokens(4, 7, "max_completion_tokens")
    assert issubclass(MaxTokensError, ValueError) and issubclass(PromptError, ValueError)
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        LengthPolicy(1, 10)
