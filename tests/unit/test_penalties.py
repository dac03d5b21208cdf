"""Penalties and logit_bias (SamplingParams, adjust_logits) keep speculation lossless.

The target's rows are adjusted before they are argmaxed, sampled or verified, each
row counting the drafts before its position. Greedy speculative output equals plain
decoding with the same penalties; sampled output passes the chi-square test against
the enumerated penalised distribution -- and a verifier whose rows forget the drafts
before them (the bug this guards against) fails the same test.
"""
import itertools

import numpy as np
import pytest

import edge.speculative.generate as gen
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.sampling import SamplingParams, adjust_logits, to_probs, top_logprobs
from harness.goodness_of_fit import TableEngine, bad_draft_of, chi_square, critical_value

PROMPT = [1, 3, 0]
PENALISED = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=1.5, repetition_penalty=1.3,
                           logit_bias=((2, 0.8),))


def test_each_row_counts_the_tokens_before_it():
    rows = np.zeros((3, 5))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = adjust_logits(rows, params, context=[4, 4, 1, 1], n_prompt=2, drafts=[1, 3])
    # generated so far: 1, 1; row 1 also sees draft 1; row 2 sees drafts 1 and 3
    assert out[0].tolist() == [0, -2.5, 0, 0, 0]
    assert out[1].tolist() == [0, -3.5, 0, 0, 0]
    assert out[2].tolist() == [0, -3.5, 0, -1.5, 0]
    assert rows.sum() == 0                       # the engine's rows are not written to


def test_repetition_penalty_and_bias_and_no_op():
    rows = np.array([[2.0, -2.0, 1.0, 0.5]])
    out = adjust_logits(rows, SamplingParams(repetition_penalty=2.0, logit_bias=((3, 10.0),)), [0, 1], 2)
    assert out[0].tolist() == [1.0, -4.0, 1.0, 10.5]     # the prompt counts for repetition
    assert adjust_logits(rows, SamplingParams(), [0, 1], 2) is rows


@pytest.mark.parametrize("params", [SamplingParams(frequency_penalty=2.0),
                                    SamplingParams(presence_penalty=-1.0, logit_bias=((1, 3.0),)),
                                    SamplingParams(repetition_penalty=3.0)])
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculative_equals_plain_with_penalties(params, gamma):
    target = TableEngine(vocab=6, seed=4)
    plain = generate_plain(target, PROMPT, 12, params).tokens
    assert plain != generate_plain(target, PROMPT, 12).tokens      # the penalty changes the answer
    # a draft that is the target itself: it proposes unpenalised, so rejections hit the penalised rows
    spec = generate_speculative(target, ModelDrafter(TableEngine(vocab=6, seed=4)), PROMPT, 12, gamma, params)
    assert spec.tokens == plain and spec.n_drafted > 0


def test_logits_rows_are_the_same_drafted_or_not():
    target = TableEngine(vocab=6, seed=5)
    params = SamplingParams(frequency_penalty=1.0)
    plain, spec = [], []
    generate_plain(target, PROMPT, 10, params, on_logits=lambda t, r: plain.append(top_logprobs(r, t, 3)))
    res = generate_speculative(target, ModelDrafter(TableEngine(vocab=6, seed=5)), PROMPT, 10, 3, params,
                               on_logits=lambda t, r: spec.append(top_logprobs(r, t, 3)))
    assert res.n_accepted > 0 and len(spec) == len(plain) == 10
    assert np.allclose([lp for lp, _ in spec], [lp for lp, _ in plain], atol=1e-12)
    assert [[t for t, _ in alts] for _, alts in spec] == [[t for t, _ in alts] for _, alts in plain]


def exact_penalised(target, length, params):
    out = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        prob, ctx = 1.0, list(PROMPT)
        for t in seq:
            prob *= to_probs(adjust_logits(target.row(ctx)[None], params, ctx, len(PROMPT))[0], params)[t]
            ctx.append(t)
        out[seq] = prob
    return out


def chi2_of_speculation(n=8000, length=3):
    target = TableEngine(vocab=4, seed=6)
    drafter = ModelDrafter(bad_draft_of(target), SamplingParams(temperature=1.0))
    counts = {}
    for i in range(n):
        p = SamplingParams(**{**PENALISED.__dict__, "seed": 50_000 + i})
        key = tuple(generate_speculative(target, drafter, PROMPT, length, 3, p).tokens)
        counts[key] = counts.get(key, 0) + 1
    stat, df = chi_square(counts, exact_penalised(target, length, PENALISED), n)
    return stat, critical_value(df)


def test_sampled_speculation_with_penalties_is_lossless():
    stat, crit = chi2_of_speculation()
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f}: penalised speculative sampling is not lossless"


def test_negative_control_rows_that_forget_the_drafts_fail(monkeypatch):
    real = gen.adjust_logits
    monkeypatch.setattr(gen, "adjust_logits", lambda rows, params, ctx, n_prompt, drafts=(): np.stack(
        [real(row[None], params, ctx, n_prompt)[0] for row in rows]))   # every row as if it were the first
    stat, crit = chi2_of_speculation()
    assert stat > crit, f"a verifier blind to the drafts passed (chi2={stat:.1f} < {crit:.1f}): no power"
