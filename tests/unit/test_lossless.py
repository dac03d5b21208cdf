"""Stochastic speculative sampling is exactly lossless: a goodness-of-fit test.

A tiny-vocabulary target (a context-hashing table model) generates short
sequences through edge.speculative.generate.generate_speculative with a deliberately bad
draft (its logits are the target's, negated and sharpened). The target's exact
distribution over whole sequences is enumerated, and a chi-square test compares
it with the empirical one — for dense q, for sparse top-k q, and for the n-gram
drafter's one-hot q. A negative control swaps in a wrong verifier and must
fail the very same test, which shows the test has power.
"""
import math

import pytest

import edge.speculative.generate as gen
from edge.speculative.generate import ModelDrafter, generate_speculative
from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SamplingParams, sample


from harness.goodness_of_fit import ALPHA, TableEngine, bad_draft_of, chi_square, critical_value, exact_distribution  # noqa: F401


PROMPT = [1, 3, 0]


def empirical(target, drafter, n, length, gamma, params, prompt):
    counts = {}
    for i in range(n):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=10_000 + i)
        r = generate_speculative(target, drafter, prompt, length, gamma, p)
        assert r.n_generated == length
        key = tuple(r.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def check_fit(target, drafter, n, length, gamma, params, prompt=PROMPT):
    want = exact_distribution(target, prompt, length, params)
    counts = empirical(target, drafter, n, length, gamma, params, prompt)
    stat, df = chi_square(counts, want, n)
    return stat, df, critical_value(df)


N = 20_000


def chi2_upper_tail(x, df):
    """Exact P(X > x) for X ~ chi-square(df): the regularised upper incomplete
    gamma Q(df/2, x/2) by its continued fraction (Lentz), valid for x > df/2 + 1."""
    a, x = df / 2.0, x / 2.0
    b = x + 1.0 - a
    c, d = 1e300, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = 1.0 / (an * d + b)
        c = b + an / c
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


@pytest.mark.parametrize("df", [10, 40, 100, 250])
def test_critical_value_is_slightly_conservative(df):
    tail = chi2_upper_tail(critical_value(df), df)
    assert 0.8 * ALPHA < tail <= ALPHA, tail


def test_dense_q_is_lossless():
    # gamma 3 over 4 tokens: rejections at every depth, and the bonus token.
    target = TableEngine(vocab=4, seed=1)
    drafter = ModelDrafter(bad_draft_of(target), SamplingParams(temperature=1.0))
    stat, df, crit = check_fit(target, drafter, N, 4, 3, SamplingParams(temperature=1.0))
    assert df >= 40, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): speculative sampling is not lossless"


def test_sparse_top_k_q_is_lossless():
    # The draft samples from its top-2 truncation (of 5 tokens) and sends
    # exactly that SparseDist; the target itself uses temperature + top-p.
    target = TableEngine(vocab=5, seed=2)
    drafter = ModelDrafter(bad_draft_of(target), SamplingParams(temperature=1.3), top_k=2)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    stat, df, crit = check_fit(target, drafter, N, 3, 2, params)
    assert df >= 40, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): top-k q is not lossless"


def test_ngram_one_hot_q_is_lossless():
    # A repetitive prompt so the n-gram drafter proposes in most rounds.
    target = TableEngine(vocab=4, seed=3)
    stat, df, crit = check_fit(target, NgramDrafter(3, 1), N // 2, 4, 3, SamplingParams(temperature=1.0),
                               prompt=[0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): n-gram drafting is not lossless"


def _accept_always(draft_tokens, q_list, p, rng):
    return len(draft_tokens), sample(p[len(draft_tokens)], rng)


def _resample_from_p(draft_tokens, q_list, p, rng):
    """A classic bug: on rejection sample from p instead of norm(max(0, p - q))."""
    for i, (x, q) in enumerate(zip(draft_tokens, q_list)):
        qx = float(q[x])
        if rng.random() * qx >= p[i, x]:
            return i, sample(p[i], rng)
    return len(draft_tokens), sample(p[len(draft_tokens)], rng)


@pytest.mark.parametrize("wrong", [_accept_always, _resample_from_p])
def test_negative_control_wrong_verifier_fails(monkeypatch, wrong):
    # The dense test's setup and threshold with a quarter of the samples: even
    # the subtle bug then gives chi2 ~ 1000 against a bound of ~170, so the
    # full-size test has ample power against it.
    monkeypatch.setattr(gen, "verify_stochastic", wrong)
    target = TableEngine(vocab=5, seed=1)
    drafter = ModelDrafter(bad_draft_of(target), SamplingParams(temperature=1.0))
    stat, df, crit = check_fit(target, drafter, N // 4, 3, 2, SamplingParams(temperature=1.0))
    assert stat > crit, f"a wrong verifier passed (chi2={stat:.1f} < {crit:.1f}): the test has no power"
