"""SamplingParams validation and the sampler's distribution."""

import numpy as np
import pytest

from numba_vllm.engine.sampling import MIN_TEMPERATURE, SamplingParams, sample, sampling_probs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": [-5]}, "stop_token_ids must be non-negative integers"),
        ({"temperature": True}, "temperature must be a finite number"),
    ],
)
def test_invalid_values_are_rejected_with_the_field_name(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.temperature == 1.0 and p.max_tokens == 16
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-40, 9.9e-6])
def test_temperatures_below_the_epsilon_are_greedy(temperature):
    p = SamplingParams(temperature=temperature)
    assert p.greedy and p.temperature == 0.0
    logits = np.array([0.0, 1.0, 3e38, -3e38, 2.0], np.float32)
    assert sample(logits, p, np.random.default_rng(0)) == 2


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-3, 1e5])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.5)])
def test_finite_logits_never_give_nan_probabilities(temperature, top_k, top_p):
    logits = np.array([0.0, 3.4e38, -3.4e38, 1e-30, 3.3e38, -1.0], np.float32)
    probs = sampling_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0) and probs.argmax() == 1


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    assert sample(logits, SamplingParams(temperature=0), np.random.default_rng(0)) == 1


def test_top_k_and_top_p_masks():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    p = sampling_probs(logits, SamplingParams(top_k=2))
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0])
    p = sampling_probs(logits, SamplingParams(top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0])
    p = sampling_probs(logits, SamplingParams(top_p=0.5))  # the first token alone already has 0.5
    np.testing.assert_allclose(p, [1, 0, 0, 0])
    p = sampling_probs(logits, SamplingParams(temperature=2.0))
    q = np.sqrt([0.5, 0.25, 0.15, 0.1])
    np.testing.assert_allclose(p, q / q.sum())


def test_sampling_follows_the_distribution_and_seed_reproduces():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(seed=123)
    draws = [sample(logits, params, params.make_rng()) for _ in range(3)]
    assert len(set(draws)) == 1  # a fresh generator with the same seed gives the same first draw
    rng = params.make_rng()
    counts = np.bincount([sample(logits, params, rng) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.03)
