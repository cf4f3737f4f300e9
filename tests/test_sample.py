"""Greedy argmax and Gumbel-max sampling (numba_vllm.kernels.sample).

- argmax (and sample_gumbel at temperature 0) must equal numpy.argmax exactly, ties and NaNs included.
- sample_gumbel must pick exactly argmax(logits / T + gumbel_noise(seed, step)) computed on the host
  (the hash is integer arithmetic, identical everywhere; the two logs may differ by an ulp between
  expf-style device math and NumPy, so a mismatch is accepted only at a near tie, < 1e-5 apart).
- The draws must follow softmax(logits / T): a chi-square test of a histogram of many draws (each
  draw a different step), with a threshold at p ~ 1e-6; the kernel is deterministic, so a given
  seed passes or fails every time.
- Determinism: the same (seed, step, logits) gives the same token, in any row of any batch.
- Split rows (grid (B, parts), then a second kernel over the part winners) must give the same
  tokens as one block per row: forced here with small parts on small rows (the simulator runs each
  thread as a Python thread), with ties, NaNs and -inf rows across part boundaries.
"""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.engine.sampling import MIN_TEMPERATURE
from numba_vllm.kernels import sample as sample_module
from numba_vllm.kernels._launch import KernelError
from numba_vllm.kernels.sample import argmax, gumbel_noise, sample_gumbel
from numba_vllm.sim.warp import simulator_enabled

pytestmark = pytest.mark.gpu_too  # `make test-gpu` runs these on the GPU as well

gpu = pytest.mark.gpu
slow = pytest.mark.slow  # the larger simulated launches: `make test` runs them, `make test-fast` does not
VOCAB = 128256


def _rng():
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"random seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _argmax(logits):
    token_ids = cuda.to_device(np.full(len(logits), -7, np.int32))  # poisoned: -7 is no token
    argmax(cuda.to_device(logits), token_ids)
    return token_ids.copy_to_host()


def _sample(logits, temperatures, seeds, steps):
    token_ids = cuda.to_device(np.full(len(logits), -7, np.int32))
    sample_gumbel(
        cuda.to_device(logits),
        cuda.to_device(np.ascontiguousarray(temperatures, np.float32)),
        cuda.to_device(np.ascontiguousarray(seeds, np.uint32)),
        cuda.to_device(np.ascontiguousarray(steps, np.int32)),
        token_ids,
    )
    return token_ids.copy_to_host()


def _greedy_sample(logits):
    rows = len(logits)
    return _sample(logits, np.zeros(rows), np.arange(rows), np.arange(rows))


GREEDY = [pytest.param(_argmax, id="argmax"), pytest.param(_greedy_sample, id="sample_gumbel_T0")]


# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pick", GREEDY)
@pytest.mark.parametrize(
    "num_rows, vocab_size",
    [
        (1, 37),
        (5, 100),
        (2, 1000),  # 8 warps
        pytest.param(1, 5000, marks=slow),  # 32 warps, two tiles
        pytest.param(1, VOCAB, marks=gpu),
        pytest.param(3, VOCAB, marks=gpu),
        pytest.param(64, VOCAB, marks=gpu),
        pytest.param(256, VOCAB, marks=gpu),
    ],
)
def test_greedy_matches_numpy_argmax(pick, num_rows, vocab_size):
    logits = _rng().standard_normal((num_rows, vocab_size), dtype=np.float32) * np.float32(5.0)
    np.testing.assert_array_equal(pick(logits), np.argmax(logits, axis=1))


def _tie_rows(vocab_size):
    """(rows, V) float32 rows whose argmax needs the tie and NaN rules."""
    rows = np.random.default_rng(0).standard_normal((8, vocab_size), dtype=np.float32)
    rows[0, [90, 40, 5]] = 50.0  # equal maxima in three threads: the lowest index wins
    rows[1, [vocab_size - 1, 67, min(130, vocab_size - 2)]] = 50.0
    rows[2] = 1.0  # all equal: index 0
    rows[3] = -np.inf  # all -inf: index 0
    rows[4, [50, 7]] = np.nan  # NaN beats numbers; the first NaN wins
    rows[5, 3], rows[5, 20] = np.inf, np.nan
    rows[6, -1] = 1e30  # the maximum at the very end
    rows[7, [11, 12]] = [0.0, -0.0]  # +0 == -0: the lower index
    rows[7, 11:13] += 60.0
    return rows


@pytest.mark.parametrize("pick", GREEDY)
@pytest.mark.parametrize("vocab_size", [100, pytest.param(1000, marks=slow)])  # 1000: ties across warps
def test_ties_go_to_the_lowest_index_and_nan_wins(pick, vocab_size):
    rows = _tie_rows(vocab_size)
    np.testing.assert_array_equal(pick(rows), np.argmax(rows, axis=1))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 3e38 / 1e-5 is inf in float32, as on the GPU
def test_the_smallest_sampling_temperature_with_extreme_logits_picks_the_maximum():
    """At MIN_TEMPERATURE (below it SamplingParams makes a request greedy) logits of any finite size
    divide to values the Gumbel noise (|G| <= 16.7) cannot reorder, and never to NaN."""
    logits = np.array([[5.0, 0.0, 3e38, -3e38, 1e-30], [0.0, -2.0, 1.0, 0.5, -1e38]], np.float32)
    rows = len(logits)
    tokens = _sample(logits, np.full(rows, MIN_TEMPERATURE), np.arange(rows), np.zeros(rows))
    assert tokens.tolist() == [2, 2]


@pytest.mark.parametrize("pick", GREEDY)
def test_rows_longer_than_the_block_loop(pick, monkeypatch):
    monkeypatch.setattr(sample_module, "SAMPLE_MAX_THREADS", 32)  # 1000 columns: 8 tiles of 32 x 4
    rows = _tie_rows(1000)  # row 1: ties at 67 (thread 3), 130 (thread 2) and 999 (second tile)
    np.testing.assert_array_equal(pick(rows), np.argmax(rows, axis=1))


# ---- sampling ----------------------------------------------------------------------------------
def _host_sample(logits_row, temperature, seed, step):
    """What sample_gumbel must pick for one row, and the perturbed values it compares."""
    if temperature == 0:
        return int(np.argmax(logits_row)), logits_row
    values = logits_row / np.float32(temperature) + gumbel_noise(seed, step, len(logits_row))
    return int(np.argmax(values)), values


def test_sample_matches_the_host_mirror_of_the_noise():
    rng = _rng()
    temperatures = np.array([0.0, 0.3, 0.7, 1.0, 1.5, 2.0, 0.0, 1e-3, 1.0, 0.9], np.float32)
    rows = len(temperatures)
    logits = rng.standard_normal((rows, 37), dtype=np.float32) * np.float32(3.0)
    seeds = rng.integers(0, 2**32, rows, dtype=np.uint32)
    steps = rng.integers(0, 5000, rows, dtype=np.int32)
    seeds[-1], steps[-1] = 2**32 - 1, 2**31 - 1  # the largest seed and step
    tokens = _sample(logits, temperatures, seeds, steps)
    for b in range(rows):
        expected, values = _host_sample(logits[b], temperatures[b], int(seeds[b]), int(steps[b]))
        if tokens[b] != expected:  # only acceptable at a near tie (the logs may differ by an ulp)
            assert abs(values[tokens[b]] - values[expected]) < 1e-5 * max(1.0, abs(values[expected])), b


def test_sample_is_deterministic_and_independent_of_the_batch():
    rng = _rng()
    logits = np.tile(rng.standard_normal(50, dtype=np.float32) * np.float32(0.1), (12, 1))  # nearly flat
    seeds = np.array([7] * 6 + [8] * 6, np.uint32)
    steps = np.array([0, 1, 2, 0, 1, 2] * 2, np.int32)  # rows 0-2 repeat as rows 3-5 (and 6-8 as 9-11)
    first = _sample(logits, np.ones(12), seeds, steps)
    np.testing.assert_array_equal(first, _sample(logits, np.ones(12), seeds, steps))
    np.testing.assert_array_equal(first[:3], first[3:6])
    np.testing.assert_array_equal(first[6:9], first[9:])
    swapped = _sample(logits[:3], np.ones(3), seeds[:3][::-1], steps[:3][::-1])  # another batch
    np.testing.assert_array_equal(swapped, first[:3][::-1])
    assert len(set(first[:3])) > 1 or len(set(first[6:9])) > 1  # steps and seeds change the draw


def _chi_square_z(counts, probs):
    """Wilson-Hilferty z-score of Pearson's chi-square statistic (about N(0, 1) under the null)."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / np.sqrt(2 / (9 * dof))


LOGITS_6 = np.array([1.0, 0.5, -0.3, 2.0, 0.0, -1.5], np.float32)
TEMPERATURE = 0.8
Z_LIMIT = 4.75  # upper tail p ~ 1e-6


def _softmax(z):
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("num_draws", [pytest.param(400, marks=slow), pytest.param(200_000, marks=gpu)])
def test_kernel_draws_follow_softmax(num_draws):
    """num_draws rows of the same logits and seed, steps 0..N-1: one draw each."""
    seed = int(_rng().integers(0, 2**32))
    logits = np.tile(LOGITS_6, (num_draws, 1))
    tokens = _sample(logits, np.full(num_draws, TEMPERATURE), np.full(num_draws, seed), np.arange(num_draws))
    counts = np.bincount(tokens, minlength=len(LOGITS_6))
    probs = _softmax(LOGITS_6.astype(np.float64) / TEMPERATURE)
    assert _chi_square_z(counts, probs) < Z_LIMIT, (counts, probs * num_draws)


def test_host_mirror_draws_follow_softmax():
    """The noise itself, in bulk on the host (the kernel equals it, see above): 20 000 draws."""
    seed = int(_rng().integers(0, 2**32))
    draws = [_host_sample(LOGITS_6, TEMPERATURE, seed, step)[0] for step in range(20_000)]
    counts = np.bincount(draws, minlength=len(LOGITS_6))
    probs = _softmax(LOGITS_6.astype(np.float64) / TEMPERATURE)
    assert _chi_square_z(counts, probs) < Z_LIMIT, (counts, probs * 20_000)


def test_uniforms_stay_inside_the_open_interval():
    bits = np.array([0, 1, 511, 512, 2**32 - 513, 2**32 - 1], np.uint64)
    u = sample_module.bits_to_uniform(bits)
    assert u.dtype == np.float32 and (u > 0).all() and (u < 1).all()
    assert u[0] == u[2] == np.float32(2.0**-24) and u[-1] == np.float32(1 - 2.0**-24)
    assert np.isfinite(gumbel_noise(123, 4, 1000)).all()


def test_bad_arguments_are_named():
    logits = cuda.to_device(np.zeros((2, 10), np.float32))
    temperatures = cuda.to_device(np.ones(2, np.float32))
    steps = cuda.to_device(np.zeros(2, np.int32))
    token_ids = cuda.to_device(np.zeros(2, np.int32))
    with pytest.raises(KernelError, match="seeds: dtype int32"):
        sample_gumbel(logits, temperatures, cuda.to_device(np.zeros(2, np.int32)), steps, token_ids)
    with pytest.raises(KernelError, match="token_ids: shape"):
        argmax(logits, cuda.to_device(np.zeros(3, np.int32)))
    with pytest.raises(KernelError, match="logits: dtype float64"):
        argmax(cuda.to_device(np.zeros((2, 10))), token_ids)
    with pytest.raises(KernelError, match="argmax: logits have no columns"):
        argmax(cuda.to_device(np.zeros((2, 0), np.float32)), token_ids)


# ---- split rows --------------------------------------------------------------------------------
def test_parts_rule_on_an_h200():
    """132 SMs, the Llama 3 vocabulary: about 2 blocks per SM, parts of at least 2048 columns."""
    assert [sample_module.pick_parts(b, VOCAB, 132) for b in (1, 3, 8, 64, 132, 133, 256)] == [62, 62, 33, 4, 2, 1, 1]
    assert sample_module.pick_parts(1, 4095, 132) == 1  # too short to split
    for b in range(1, 300):  # a split grid never exceeds 2 blocks per SM
        parts = sample_module.pick_parts(b, VOCAB, 132)
        assert parts == 1 or b * parts <= 264, b


def _force_parts(monkeypatch, parts):
    """Make the launchers cut every row into `parts` parts; returns the (kernel, grid) of each launch."""
    monkeypatch.setattr(sample_module, "pick_parts", lambda num_rows, vocab_size, num_sms: parts)
    launches = []
    real_launch = sample_module.launch

    def spy(kernel_, grid, block, *args):
        launches.append((kernel_, grid))
        real_launch(kernel_, grid, block, *args)

    monkeypatch.setattr(sample_module, "launch", spy)
    return launches


@pytest.mark.parametrize("pick", GREEDY)
@pytest.mark.parametrize(
    "num_rows, vocab_size, parts",
    [
        (2, 1000, 3),  # 352 columns a part (rounded up to 32): the last part has 296
        pytest.param(1, 3000, 7, marks=slow),  # 448 columns a part, the last 312
        (1, 1300, 41),  # 32 columns a part: 41 winners, two for some lanes of the second pass
    ],
)
def test_split_rows_match_numpy_argmax(pick, monkeypatch, num_rows, vocab_size, parts):
    launches = _force_parts(monkeypatch, parts)
    logits = _rng().standard_normal((num_rows, vocab_size), dtype=np.float32) * np.float32(5.0)
    np.testing.assert_array_equal(pick(logits), np.argmax(logits, axis=1))
    assert [grid for _, grid in launches] == [(num_rows, parts), num_rows]
    assert launches[1][0] is sample_module.reduce_parts_kernel


def _split_tie_rows():
    """(10, 1000) float32 rows whose argmax needs the tie and NaN rules across 3 parts of 352 columns
    (0-351, 352-703, 704-999)."""
    rows = np.random.default_rng(1).standard_normal((10, 1000), dtype=np.float32)
    rows[0, [900, 400, 10]] = 50.0  # equal maxima in the three parts: the lowest index wins
    rows[1, [720, 360]] = 50.0  # in parts 2 and 1
    rows[2] = -np.inf  # all -inf: index 0
    rows[3, 5], rows[3, 800] = np.inf, np.nan  # a NaN in the last part beats +inf in the first
    rows[4, [750, 400]] = np.nan  # NaNs in parts 2 and 1: the first NaN wins
    rows[5] = np.nan  # all NaN: index 0
    rows[6, -1] = 1e30  # the maximum at the very end of the short last part
    rows[7] = -5.0
    rows[7, 351], rows[7, 352] = 0.0, -0.0  # +0 == -0 on both sides of a part boundary: the lower index
    rows[8] = 1.0  # all equal: index 0
    rows[9] = -np.inf
    rows[9, 703] = -1e30  # the only finite value, at the end of part 1: beats the -inf winners of parts 0 and 2
    return rows


@slow
@pytest.mark.parametrize("pick", GREEDY)
def test_split_ties_go_to_the_lowest_index_and_nan_wins(pick, monkeypatch):
    _force_parts(monkeypatch, 3)
    rows = _split_tie_rows()
    expected = np.argmax(rows, axis=1)
    assert list(expected[[0, 1, 2, 3, 4, 5, 7, 8, 9]]) == [10, 360, 0, 800, 400, 0, 351, 0, 703]
    np.testing.assert_array_equal(pick(rows), expected)


def _mixed_batch(vocab_size):
    """(logits, temperatures, seeds, steps) of 6 rows: greedy rows (T = 0) between sampled ones."""
    rng = _rng()
    logits = rng.standard_normal((6, vocab_size), dtype=np.float32) * np.float32(3.0)
    logits[2, [vocab_size - 1, vocab_size // 2]] = np.nan  # a greedy row with NaNs in two parts
    temperatures = np.array([0.0, 0.8, 0.0, 1.5, 0.3, 0.0], np.float32)
    seeds = rng.integers(0, 2**32, 6, dtype=np.uint32)
    steps = rng.integers(0, 5000, 6, dtype=np.int32)
    return logits, temperatures, seeds, steps


def _check_mirror(tokens, logits, temperatures, seeds, steps):
    """tokens equal the host mirror's picks (sampled rows: up to a near tie) and numpy.argmax (greedy rows)."""
    for b in range(len(logits)):
        expected, values = _host_sample(logits[b], temperatures[b], int(seeds[b]), int(steps[b]))
        if temperatures[b] == 0:
            assert tokens[b] == expected, b
        elif tokens[b] != expected:  # only acceptable at a near tie (the logs may differ by an ulp)
            assert abs(values[tokens[b]] - values[expected]) < 1e-5 * max(1.0, abs(values[expected])), b


@slow
def test_split_sampling_of_a_mixed_batch(monkeypatch):
    """Greedy and sampled rows in one launch: the same tokens split or not, and as the host mirror."""
    batch = _mixed_batch(1000)
    whole = _sample(*batch)
    launches = _force_parts(monkeypatch, 3)
    split = _sample(*batch)
    assert [grid for _, grid in launches] == [(6, 3), 6]
    np.testing.assert_array_equal(split, whole)
    _check_mirror(split, *batch)


@slow
@pytest.mark.skipif(not simulator_enabled(), reason="replaces a device function, which only the simulator looks up at run time")
def test_greedy_rows_compute_no_noise(monkeypatch):
    def no_noise(*args):
        raise AssertionError("noise computed for a greedy row")

    monkeypatch.setattr(sample_module, "_noise_key", no_noise)
    monkeypatch.setattr(sample_module, "_noise_uniform", no_noise)
    rows = _split_tie_rows()
    np.testing.assert_array_equal(_greedy_sample(rows), np.argmax(rows, axis=1))
    with pytest.raises(KernelError, match="noise computed for a greedy row"):  # the trap does fire
        _sample(rows[:1], np.ones(1), np.zeros(1), np.zeros(1))


def test_per_row_inputs_may_be_views_of_an_int32_buffer():
    """temperatures and seeds as float32 / uint32 views of slices of one int32 device buffer."""
    logits, temperatures, seeds, steps = _mixed_batch(300)
    seeds[1] = 2**32 - 5  # negative as int32: the view must keep the bits
    packed = np.zeros(20, np.int32)  # 2 unused words, then 6 temperatures, 6 seeds, 6 steps
    packed[2:8], packed[8:14], packed[14:20] = temperatures.view(np.int32), seeds.view(np.int32), steps
    buffer = cuda.to_device(packed)
    token_ids = cuda.to_device(np.full(6, -7, np.int32))
    sample_gumbel(cuda.to_device(logits), buffer[2:8].view(np.float32), buffer[8:14].view(np.uint32), buffer[14:20], token_ids)
    np.testing.assert_array_equal(token_ids.copy_to_host(), _sample(logits, temperatures, seeds, steps))


def test_split_launches_must_fit_the_workspace(monkeypatch):
    workspace = sample_module.allocate_part_winners()
    assert workspace.values.dtype == np.float32 and workspace.indices.dtype == np.int32
    assert workspace.values.shape == workspace.indices.shape == (sample_module.SAMPLE_WORKSPACE_SLOTS,)
    _force_parts(monkeypatch, 3)
    monkeypatch.setattr(sample_module, "SAMPLE_WORKSPACE_SLOTS", 5)
    with pytest.raises(KernelError, match="argmax: 2 rows in 3 parts exceed the 5-slot workspace"):
        argmax(cuda.to_device(np.zeros((2, 1000), np.float32)), cuda.to_device(np.zeros(2, np.int32)))


@gpu
@pytest.mark.parametrize("num_rows", [1, 3, 256])
def test_sample_full_vocabulary_matches_the_host_mirror(num_rows):
    """The default parts (62 parts for 1 and 3 rows on an H200, one block per row for 256)."""
    rng = _rng()
    logits = rng.standard_normal((num_rows, VOCAB), dtype=np.float32) * np.float32(3.0)
    temperatures = np.where(np.arange(num_rows) % 3 == 1, 0.0, rng.uniform(0.2, 1.5, num_rows)).astype(np.float32)
    seeds = rng.integers(0, 2**32, num_rows, dtype=np.uint32)
    steps = rng.integers(0, 5000, num_rows, dtype=np.int32)
    _check_mirror(_sample(logits, temperatures, seeds, steps), logits, temperatures, seeds, steps)
