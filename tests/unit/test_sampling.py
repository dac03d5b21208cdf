"""edge/speculative/sampling.py: temperature, top-k, top-p, sampling and sparse distributions."""
import numpy as np
import pytest

from edge.speculative.sampling import SamplingParams, SparseDist, sample, to_probs, truncate_top_k


def softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


LOGITS = np.log(np.array([0.1, 0.5, 0.05, 0.3, 0.05]))   # probs at temperature 1


def test_greedy_is_one_hot_at_argmax_first_on_ties():
    p = to_probs([1.0, 3.0, 3.0, 0.0], SamplingParams())
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert p.dtype == np.float64


def test_temperature_one_is_softmax_and_temperature_scales():
    np.testing.assert_allclose(to_probs(LOGITS, SamplingParams(1.0)), [0.1, 0.5, 0.05, 0.3, 0.05], atol=1e-15)
    np.testing.assert_allclose(to_probs(LOGITS, SamplingParams(0.5)), softmax(LOGITS / 0.5), atol=1e-15)
    hot = to_probs(LOGITS, SamplingParams(100.0))
    assert hot.max() - hot.min() < 0.02     # high temperature -> nearly uniform


def test_top_k_keeps_k_largest_renormalised():
    p = to_probs(LOGITS, SamplingParams(1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 0.5 / 0.8, 0, 0.3 / 0.8, 0], atol=1e-15)
    # ties at the boundary: exactly k survive, the lower token id wins
    p = to_probs([0.0, 1.0, 1.0, 1.0], SamplingParams(1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 0.5, 0.5, 0], atol=1e-15)
    # top_k >= vocab is a no-op
    np.testing.assert_allclose(to_probs(LOGITS, SamplingParams(1.0, top_k=9)), softmax(LOGITS), atol=1e-15)


@pytest.mark.parametrize("top_p, kept", [(0.4, [1]), (0.7, [1, 3]), (0.85, [1, 3, 0]), (0.97, [1, 3, 0, 2, 4])])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    # sorted mass: 0.5, 0.8, 0.9, 0.95, 1.0 (ties 2/4 at 0.05: lower id first)
    p = to_probs(LOGITS, SamplingParams(1.0, top_p=top_p))
    base = np.array([0.1, 0.5, 0.05, 0.3, 0.05])
    want = np.zeros(5)
    want[kept] = base[kept] / base[kept].sum()
    np.testing.assert_allclose(p, want, atol=1e-12)


def test_top_p_tie_is_broken_by_token_id():
    p = to_probs(LOGITS, SamplingParams(1.0, top_p=0.92))   # needs 0.9 + one of the two 0.05s
    assert p[2] > 0 and p[4] == 0


def test_temperature_then_top_k_then_top_p():
    params = SamplingParams(2.0, top_k=3, top_p=0.6)
    s = softmax(LOGITS / 2.0)
    top3 = [1, 3, 0]
    r = np.zeros(5)
    r[top3] = s[top3] / s[top3].sum()
    order = np.argsort(-r, kind="stable")
    before = np.cumsum(r[order]) - r[order]
    r[order[before >= 0.6]] = 0
    np.testing.assert_allclose(to_probs(LOGITS, params), r / r.sum(), atol=1e-14)


def test_rows_are_independent():
    rows = np.stack([LOGITS, LOGITS[::-1], np.zeros(5)])
    params = SamplingParams(0.7, top_k=3, top_p=0.9)
    got = to_probs(rows, params)
    for i in range(3):
        np.testing.assert_allclose(got[i], to_probs(rows[i], params), atol=0)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)


def test_tiny_temperature_does_not_overflow():
    p = to_probs([1.0, 3.0, 2.0], SamplingParams(1e-310))
    np.testing.assert_array_equal(p, [0, 1, 0])


def test_minus_inf_logits_are_masked():
    p = to_probs([-np.inf, 0.0, 0.0], SamplingParams(1.0))
    np.testing.assert_allclose(p, [0, 0.5, 0.5])


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed="x"), "seed"),
])
def test_bad_params_raise_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("logits, msg", [
    ([0.0, np.nan], "NaN"), ([np.inf, 0.0], "inf"), ([-np.inf, -np.inf], "no token"), ([], "vocab"),
    (np.zeros((2, 2, 2)), "shape"),
])
def test_bad_logits_raise_clear_errors(logits, msg):
    with pytest.raises(ValueError, match=msg):
        to_probs(logits, SamplingParams(1.0))


def test_sample_matches_distribution_and_skips_zero_mass():
    p = np.array([0.2, 0.0, 0.5, 0.3, 0.0])
    rng = np.random.default_rng(0)
    n = 20000
    counts = np.bincount([sample(p, rng) for _ in range(n)], minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    # within 5 standard deviations
    assert np.all(np.abs(counts / n - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_sample_is_reproducible_and_validates():
    p = softmax(LOGITS)
    a = [sample(p, np.random.default_rng(3)) for _ in range(5)]
    b = [sample(p, np.random.default_rng(3)) for _ in range(5)]
    assert a == b
    with pytest.raises(ValueError):
        sample(np.array([0.5, -0.1, 0.6]), np.random.default_rng(0))
    with pytest.raises(ValueError):
        sample(np.zeros(3), np.random.default_rng(0))
    with pytest.raises(ValueError):
        sample(np.ones((2, 2)) / 4, np.random.default_rng(0))


def test_sparse_dist_dense_prob_of_and_sample():
    d = SparseDist(np.array([7, 2]), np.array([0.25, 0.75]))
    assert d.indices.dtype == np.int64 and len(d) == 2
    np.testing.assert_array_equal(d.dense(8), [0, 0, 0.75, 0, 0, 0, 0, 0.25])
    assert d.prob_of(7) == 0.25 and d.prob_of(3) == 0.0
    rng = np.random.default_rng(1)
    assert {sample(d, rng) for _ in range(200)} == {2, 7}
    assert sample(SparseDist.one_hot(5), rng) == 5
    with pytest.raises(ValueError, match="outside"):
        d.dense(5)


@pytest.mark.parametrize("idx, probs", [
    ([1, 1], [0.5, 0.5]), ([-1, 2], [0.5, 0.5]), ([1, 2], [0.5, 0.6]), ([1, 2], [1.5, -0.5]),
    ([1, 2, 3], [0.5, 0.5]), ([], []), ([0.5, 1.0], [0.5, 0.5]),
])
def test_sparse_dist_validates(idx, probs):
    with pytest.raises(ValueError):
        SparseDist(np.array(idx), np.array(probs))


def test_truncate_top_k():
    p = np.array([0.1, 0.5, 0.05, 0.3, 0.05])
    d = truncate_top_k(p, 2)
    assert d.indices.tolist() == [1, 3]
    np.testing.assert_allclose(d.probs, [0.5 / 0.8, 0.3 / 0.8], atol=1e-15)
    assert abs(d.probs.sum() - 1.0) < 1e-15
    # zero-probability tokens are never included; k > vocab is fine
    d = truncate_top_k(np.array([0.0, 0.6, 0.4]), 10)
    assert d.indices.tolist() == [1, 2]
    # ties: lower id first, deterministic
    assert truncate_top_k(np.array([0.25] * 4), 2).indices.tolist() == [0, 1]
    with pytest.raises(ValueError, match="top-k"):
        truncate_top_k(p, 0)


def test_truncate_top_k_large_vocab_path_agrees_with_sort():
    rng = np.random.default_rng(0)
    p = softmax(rng.normal(size=50_000) * 3)
    d = truncate_top_k(p, 40)
    want = np.argsort(-p, kind="stable")[:40]
    assert d.indices.tolist() == want.tolist()
    np.testing.assert_allclose(d.probs, p[want] / p[want].sum(), rtol=1e-12)
