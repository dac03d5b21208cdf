"""edge/speculative/verify.py and edge/speculative/ngram.py alone: verification (greedy, stochastic),
the cost model (expected tokens, speedup, γ), the acceptance and cost trackers, prompt lookup."""
import numpy as np
import pytest

from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SparseDist
from edge.speculative.verify import (AcceptanceTracker, CostTracker, choose_gamma, expected_tokens,
                                     predicted_speedup, verify_greedy, verify_stochastic)


def one_hot_logits(ids, vocab=6):
    out = np.zeros((len(ids), vocab))
    out[np.arange(len(ids)), ids] = 5.0
    return out


# ---------------------------------------------------------------- verification

def test_verify_greedy_hand_cases():
    logits = one_hot_logits([3, 1, 4, 2])
    assert verify_greedy([3, 1, 4], logits) == (3, 2)     # all accepted + bonus
    assert verify_greedy([0, 1, 4], logits) == (0, 3)     # first rejected -> correction
    assert verify_greedy([3, 1, 5], logits) == (2, 4)
    assert verify_greedy([], logits[:1]) == (0, 3)        # gamma 0 is a plain step
    with pytest.raises(ValueError, match=r"gamma\+1"):
        verify_greedy([3, 1], logits)
    with pytest.raises(ValueError, match="outside"):
        verify_greedy([9], logits[:2])


def test_verify_stochastic_deterministic_cases():
    rng = np.random.default_rng(0)
    p = np.eye(4)[[2, 1, 3]]                 # target certain of 2, 1, then 3
    assert verify_stochastic([2, 1], [np.eye(4)[2], np.eye(4)[1]], p, rng) == (2, 3)
    # draft certain of a token the target never emits -> rejected, residual = p
    assert verify_stochastic([0, 1], [np.eye(4)[0], np.eye(4)[1]], p, rng) == (0, 2)
    assert verify_stochastic([2, 0], [SparseDist.one_hot(2), SparseDist.one_hot(0)], p, rng) == (1, 1)
    # p == q: always accepted whatever it is
    u = np.full((2, 4), 0.25)
    for _ in range(50):
        assert verify_stochastic([int(rng.integers(4))], [u[0]], u, rng)[0] == 1


def test_verify_stochastic_errors():
    rng = np.random.default_rng(0)
    p = np.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="sampled from"):   # q(x) = 0 for a sampled x
        verify_stochastic([1], [np.array([1.0, 0, 0, 0])], p, rng)
    with pytest.raises(ValueError, match="sampled from"):
        verify_stochastic([1], [SparseDist.one_hot(2)], p, rng)
    with pytest.raises(ValueError, match="one draft distribution"):
        verify_stochastic([1], [], p, rng)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_stochastic([1], [np.full(5, 0.2)], p, rng)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_stochastic([1], [SparseDist(np.array([1, 9]), np.array([0.5, 0.5]))], p, rng)


def test_verify_stochastic_first_token_follows_p():
    # Quick single-position check; tests/unit/test_lossless.py does whole sequences.
    p = np.array([[0.1, 0.6, 0.1, 0.2], [0.25] * 4])
    q = np.array([0.7, 0.0, 0.1, 0.2])      # bad draft: never proposes p's favourite
    rng = np.random.default_rng(5)
    n, counts = 20000, np.zeros(4)
    for _ in range(n):
        x = int(rng.choice(4, p=q))
        k, nxt = verify_stochastic([x], [q], p, rng)
        counts[x if k == 1 else nxt] += 1
    assert np.all(np.abs(counts / n - p[0]) <= 5 * np.sqrt(p[0] * (1 - p[0]) / n))


# ------------------------------------------------------------------ cost model

def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.7, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens(1.2, 2)


def test_predicted_speedup_and_choose_gamma():
    flat = lambda k: 1.0                    # memory-bound device: verify ~ one step
    cpu = lambda k: 1.0 + 0.3 * (k - 1)     # 2-core CPU as measured in docs/architecture.md
    assert predicted_speedup(0.8, 0, 0.1, flat) == 1.0
    assert predicted_speedup(0.8, 3, 0.1, flat) == pytest.approx(expected_tokens(0.8, 3) / 1.3)
    g = choose_gamma(0.8, 0.05, flat, 8)
    assert g >= 4
    # an expensive co-located draft on the CPU loses: no speculation
    assert choose_gamma(0.7, 0.4, cpu, 8) == 0
    # a free draft (n-gram, or a remote one) with decent alpha wins on the CPU
    assert choose_gamma(0.7, 0.0, cpu, 8) > 0
    assert choose_gamma(0.0, 0.0, flat, 8) == 0          # useless draft
    assert choose_gamma(0.9, 0.0, flat, 0) == 0
    # margin: demand a clear win
    s1 = predicted_speedup(0.5, 1, 0.0, cpu)
    assert choose_gamma(0.5, 0.0, cpu, 1, margin=0.0) == 1
    assert choose_gamma(0.5, 0.0, cpu, 1, margin=s1) == 0


def test_acceptance_tracker():
    t = AcceptanceTracker(prior=0.5, prior_weight=2.0, decay=1.0)
    assert t.alpha == 0.5
    t.update(4, 4)      # 4 successes
    t.update(4, 1)      # 1 success, 1 failure (tokens 3-4 never tested)
    assert t.alpha == pytest.approx((5 + 1) / (6 + 2))
    t.update(0, 0)      # nothing drafted: no information
    assert t.rounds == 2
    with pytest.raises(ValueError):
        t.update(2, 3)
    # with decay the prior fades: a run of rejections drives alpha to ~0
    t = AcceptanceTracker(prior=0.9, decay=0.9)
    for _ in range(60):
        t.update(1, 0)
    assert t.alpha < 0.01
    # recovers a true geometric alpha
    rng = np.random.default_rng(0)
    t = AcceptanceTracker(decay=0.999)
    for _ in range(3000):
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        t.update(4, n)
    assert t.alpha == pytest.approx(0.8, abs=0.03)


def test_cost_tracker():
    c = CostTracker(prior_slope=0.3)
    assert c.verify_cost(3) == pytest.approx(1.6) and np.isnan(c.c)
    c.add_target(1, 0.010)
    assert c.verify_cost(3) == pytest.approx(1.6)
    c.add_target(5, 0.022)
    c.add_target(5, 0.900)            # one outlier among three: the median ignores it
    c.add_target(5, 0.022)
    assert c.verify_cost(5) == pytest.approx(2.2)
    assert c.verify_cost(3) == pytest.approx(1.6)         # interpolated
    assert c.verify_cost(9) == pytest.approx(3.4)         # extrapolated with the last slope
    c.add_draft(4, 0.008)
    assert c.c == pytest.approx(0.2)


# ----------------------------------------------------------------------- n-gram

def test_ngram_propose():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2, 3]   # fewer than gamma
    assert d.propose([5, 6, 7, 9, 6, 7, 8, 6, 7], 3) == [8, 6, 7]  # most recent occurrence
    assert d.propose([1, 2, 3], 3) == []                          # no earlier occurrence
    assert d.propose([7, 7], 3) == [7]
    assert d.propose([9, 1, 2, 8, 0, 2], 2) == [8, 0]              # falls back to n=1
    assert NgramDrafter(2, 2).propose([9, 1, 2, 8, 0, 2], 2) == []
    assert d.propose([1], 3) == [] and d.propose([1, 1], 0) == []
    toks, qs = d.draft([1, 2, 1], 2)
    assert toks == [2, 1] and [q.indices.tolist() for q in qs] == [[2], [1]]
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
