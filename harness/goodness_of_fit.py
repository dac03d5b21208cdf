"""Goodness-of-fit tools for the lossless tests: a small enumerable model, the exact
distribution of its sequences, Pearson's chi-square and its critical value."""
import itertools
import math
import statistics

from edge.speculative.sampling import to_probs

from harness.table_engine import TableEngine as _Table

ALPHA = 1e-4   # significance: a correct implementation fails for ~1 seed in 10^4


class TableEngine(_Table):
    """harness/table_engine.py's model, small: every sequence can be enumerated."""

    def __init__(self, vocab=5, rows=4099, seed=0, max_len=64):
        super().__init__(vocab, rows, seed, window=None, max_len=max_len)


def bad_draft_of(target: TableEngine) -> TableEngine:
    """Same contexts, logits negated and sharpened: q puts its mass where p has least."""
    # one row drawn, not len(target.table): the table is replaced at once, and the lossless
    # tests make a draft per generation (drawing the whole table was a quarter of their time)
    d = TableEngine(target.vocab_size, 1, seed=0, max_len=target.max_len)
    d.table = -2.0 * target.table
    return d


def exact_distribution(target, prompt, length, params):
    """P(sequence) for every sequence of `length` tokens, by enumeration."""
    out = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob, ctx = 1.0, list(prompt)
        for t in seq:
            prob *= to_probs(target.row(ctx), params)[t]
            ctx.append(t)
        out[seq] = prob
    assert abs(sum(out.values()) - 1.0) < 1e-9
    return out


def chi_square(counts, expected_probs, n):
    """Pearson's statistic, pooling outcomes with expected count < 5 into one
    bin (the usual validity condition for the chi-square approximation)."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for seq, p in expected_probs.items():
        e, o = n * p, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    # Outcomes with zero target probability must never appear.
    assert all(seq in expected_probs for seq in counts)
    return stat, bins - 1


def critical_value(df, alpha=ALPHA):
    """Upper alpha-quantile of chi-square(df), Wilson–Hilferty approximation:
    (X/df)^(1/3) is nearly normal with mean 1 - 2/(9df), variance 2/(9df).
    Checked against the exact quantile (regularised incomplete gamma): for
    df in 10..250 the true tail beyond this value is 0.85e-4..0.99e-4, i.e.
    the approximation is slightly conservative and never lets the false-alarm
    rate exceed the nominal 1e-4."""
    z = statistics.NormalDist().inv_cdf(1.0 - alpha)
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3
