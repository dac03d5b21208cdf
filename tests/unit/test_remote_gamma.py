"""The star's adaptive γ (edge/speculative/remote_gamma.py), pure: a cost table stands in for the clock.

Each simulated round feeds the policy what edge/speculative/generate.py and RemoteDrafter would: the
target call's seconds from a table v(k), the wait W(γ) = o + d·γ with its compute part, and
the acceptance of drafts that agree with probability alpha_true."""
from __future__ import annotations

import numpy as np
import pytest

from edge.speculative.remote_gamma import RemoteGamma, RoundTrips, Wait, best_gamma


def simulate(policy, rounds, alpha_true, step_s=0.05, verify_slope=1.0, overhead_s=0.1, draft_s=0.01,
             seed=0):
    """γ chosen each round; verify over k tokens costs step_s·(1 + verify_slope·(k-1))."""
    rng = np.random.default_rng(seed)
    gammas = []
    for i in range(rounds):
        g = policy.next_gamma()
        gammas.append(g)
        if g > 0:
            a = alpha_true(i) if callable(alpha_true) else alpha_true
            ok = rng.random(g) < a
            n = g if ok.all() else int(np.argmin(ok))
            policy.waits.add(Wait(g, overhead_s + draft_s * g, draft_s * g, tokens=g))
            policy.acceptance.update(g, n)
        if i > 0:                      # the loop skips the first target call (warm-up)
            policy.costs.add_target(g + 1, step_s * (1 + verify_slope * g))
    return gammas


def test_low_acceptance_and_a_costly_round_trip_fall_to_zero_with_sparse_probes():
    p = RemoteGamma(8)
    gammas = simulate(p, 400, alpha_true=0.1, overhead_s=0.1)
    assert gammas[0] == 1                               # explores first, at γ=1
    tail = gammas[50:]
    assert tail.count(0) > 0.97 * len(tail)             # plain decoding ...
    assert 1 <= sum(g > 0 for g in tail) <= 8           # ... with a few probes, O(log n)


def test_high_acceptance_and_cheap_verify_reach_past_three():
    p = RemoteGamma(8)
    gammas = simulate(p, 120, alpha_true=0.97, verify_slope=0.03, overhead_s=0.005, draft_s=0.002)
    late = [g for g in gammas[40:] if g > 0]
    assert max(late) > 3 and np.median(late) > 3
    assert max(gammas) <= 8


def test_max_gamma_bounds_the_choice():
    p = RemoteGamma(5)
    gammas = simulate(p, 80, alpha_true=1.0, verify_slope=0.0, overhead_s=0.001, draft_s=0.0)
    assert max(gammas) == 5


def test_a_costly_round_trip_alone_says_zero_even_when_the_draft_agrees():
    """The wait is 4 target steps: with CPU-like verify (k tokens ~ k steps) nothing pays."""
    p = RemoteGamma(8)
    gammas = simulate(p, 200, alpha_true=0.9, verify_slope=1.0, overhead_s=0.2)
    assert gammas[100:].count(0) > 0.95 * 100


def test_it_recovers_when_the_draft_starts_agreeing():
    p = RemoteGamma(8)
    gammas = simulate(p, 500, alpha_true=lambda i: 0.05 if i < 150 else 0.98, verify_slope=0.05,
                      overhead_s=0.01, draft_s=0.003)
    assert gammas[100:150].count(0) >= 45           # off while it disagrees
    assert np.median(gammas[-50:]) >= 3             # back on, further than before, once it agrees


def test_background_probes_never_make_a_round_and_still_bring_speculation_back():
    """Greedy through the star: at γ=0 a probe is asked for in the background (next_gamma() stays
    0, `probe` says how many drafts) and its score comes back through observed()."""
    p = RemoteGamma(8, background=True)
    rng = np.random.default_rng(0)
    gammas, probes = [], []
    for i in range(400):
        g = p.next_gamma()
        gammas.append(g)
        a = 0.05 if i < 200 else 0.98
        if g > 0:
            ok = rng.random(g) < a
            p.waits.add(Wait(g, 0.01 + 0.003 * g, 0.003 * g, tokens=g))
            p.acceptance.update(g, g if ok.all() else int(np.argmin(ok)))
        elif p.probe:
            probes.append(i)
            ok = rng.random(p.probe) < a           # scored against the target's own tokens
            p.observed(p.probe, p.probe if ok.all() else int(np.argmin(ok)))
        if i > 0:
            p.costs.add_target(g + 1, 0.05 * (1 + 0.05 * g))
    off = gammas[40:200]
    assert off.count(0) == len(off)                 # no probing round while the draft disagrees ...
    assert 2 <= sum(40 <= i < 200 for i in probes) <= 8   # ... probes in the background instead
    assert np.median(gammas[-50:]) >= 3             # and speculation back once it agrees


def test_requests_rarely_answered_in_time_fall_to_zero():
    """Agreeing, cheap to verify, but 9 requests in 10 time out after a target step's wait: a round
    mostly yields the one plain token, late."""
    p = RemoteGamma(8)
    for i in range(40):
        g = p.next_gamma()
        if g > 0:
            answered = i % 10 == 0
            p.waits.add(Wait(g, 0.004 if answered else 0.05, 0.001 * g if answered else None,
                             tokens=g if answered else 0))
            if answered:
                p.acceptance.update(g, g)
        if i > 0:
            p.costs.add_target(g + 1, 0.05 * (1 + 0.05 * g))
    assert p.waits.answered < 0.3 and p.choose(p.acceptance.alpha) == 0


def test_answers_without_drafts_count_as_rounds_that_yield_the_plain_token():
    """A service unsure of its first draft (--draft-p-min) answers at once but with nothing: the
    target waited for it all the same. 9 rounds in 10 like that: speculation does not pay."""
    p = RemoteGamma(8)
    for i in range(40):
        g = p.next_gamma()
        if g > 0:
            sure = i % 10 == 0
            p.waits.add(Wait(g, 0.02, 0.015, tokens=g if sure else 0))
            if sure:
                p.acceptance.update(g, g)
        if i > 0:
            p.costs.add_target(g + 1, 0.05 * (1 + 0.05 * g))
    assert p.waits.answered <= 0.5 and p.choose(p.acceptance.alpha) == 0
    w = RoundTrips()
    w.add(Wait(2, 0.03, 0.02, tokens=2))
    w.add(Wait(2, 0.03, 0.02, tokens=0))
    assert w.answered == pytest.approx(0.5)


def test_round_trips_split_overhead_and_per_token_time():
    w = RoundTrips()
    for g in (2, 4, 4):
        w.add(Wait(g, 0.03 + 0.01 * g, 0.01 * g, tokens=g))
    w.add(Wait(3, 0.5, None))                 # no answer: it waited 0.5 s in vain
    w.add(Wait(3, 0.2, 0.19, tokens=3, short=False))   # a catch-up: its compute paid a prefill
    assert w.answered == pytest.approx(4 / 5)
    assert w.per_token_s == pytest.approx(0.01)
    assert w.overhead_s == pytest.approx(0.03)
    assert w.wait_s(0) == 0.0 and w.wait_s(6) == pytest.approx(0.09)
    with pytest.raises(ValueError, match="gamma >= 1"):
        w.add(Wait(0, 0.1, None))


def test_best_gamma_keeps_zero_unless_it_beats_plain_by_the_margin():
    flat = lambda g: 1.0 if g == 0 else 1.0 + 0.01 * g     # noqa: E731 (a cost table)
    assert best_gamma(0.0, flat, 8) == 0                    # nothing accepted: never pays
    assert best_gamma(0.99, flat, 8) == 8                   # all accepted, free rounds: as far as allowed
    assert best_gamma(0.5, lambda g: 1.0 + 0.4 * g, 8, margin=0.05) == 1
    with pytest.raises(ValueError):
        best_gamma(0.5, flat, -1)


def test_the_star_gamma_option_takes_integers_and_auto():
    import click

    from edge.cli.options import STAR_GAMMA
    assert STAR_GAMMA.convert("3", None, None) == (3, False)
    assert STAR_GAMMA.convert("auto", None, None) == (8, True)
    assert STAR_GAMMA.convert("auto:12", None, None) == (12, True)
    for bad in ("0", "auto:0", "x", "3:4"):
        with pytest.raises(click.BadParameter, match="auto"):
            STAR_GAMMA.convert(bad, None, None)


def simulate_curve(policy, rounds, alpha_true, curve, step_s=0.1, overhead_s=0.003, draft_s=0.03, seed=0):
    """As simulate(), with the verify cost over k tokens from `curve` {k: steps} (step-like)."""
    rng = np.random.default_rng(seed)
    ks = sorted(curve)
    gammas = []
    for i in range(rounds):
        g = policy.next_gamma()
        gammas.append(g)
        if g > 0:
            ok = rng.random(g) < alpha_true
            n = g if ok.all() else int(np.argmin(ok))
            policy.waits.add(Wait(g, overhead_s + draft_s * g, draft_s * g, tokens=g))
            policy.acceptance.update(g, n)
        if i > 0:
            policy.costs.add_target(g + 1, step_s * float(np.interp(g + 1, ks, [curve[k] for k in ks])))
    return gammas


# A memory-bound target (F16 weights on one core): two tokens cost 1.5 steps, four only 1.7.
STEP_CURVE = {1: 1.0, 2: 1.5, 3: 1.6, 4: 1.7, 6: 2.1, 8: 2.6, 9: 2.8}


def test_a_seeded_verify_curve_lets_a_memory_bound_target_speculate_deep():
    from edge.speculative.verify import CostTracker
    seeded = CostTracker()
    for k, v in STEP_CURVE.items():
        seeded.add_target(k, 0.1 * v)
    deep = simulate_curve(RemoteGamma(8, costs=seeded), 200, 0.95, STEP_CURVE)
    assert np.median(deep[20:]) >= 4                    # further than the fixed γ=3
    # Unseeded, a line through v(1)=1 and v(2)=1.5 prices four tokens at 2.5 steps: shallower.
    shallow = simulate_curve(RemoteGamma(8), 200, 0.95, STEP_CURVE)
    assert np.median(shallow[2:12]) < np.median(deep[2:12])


def test_a_deep_request_after_shallow_ones_gets_time_for_its_extra_drafts():
    from edge.star.target import Deadline
    d = Deadline()
    for _ in range(8):
        d.sample(0.07, gamma=1, per_token_s=0.06)       # γ=1 round trips: 7 ms + one 60 ms draft
    assert d.for_gamma(1, 0.06) < 0.07 + 3 * 0.06       # a γ=1 request: as before
    assert d.for_gamma(4, 0.06) > 0.07 + 3 * 0.06       # a γ=4 one: three more drafts' time
    d.sample(0.25, gamma=4, per_token_s=0.06)            # samples at γ=4 are normalised to one draft
    assert abs(d.srtt - 0.07) < 0.01


def test_a_misss_fixed_feed_is_priced_once_not_per_draft():
    """A miss's compute is one feed of the target's new tokens plus a step per draft: 70 ms +
    30 ms·γ (the Q4_0 0.5B on one AVX2 core). From γ=1 answers alone 100 ms a draft is all
    there is to see, and a γ=3 round looks like 300 ms; once γ=3 answers are in too, 160 ms."""
    w = RoundTrips()
    for _ in range(6):
        w.add(Wait(1, 0.102, 0.1, tokens=1))
    assert w.fixed_s == 0.0 and w.wait_s(3) == pytest.approx(0.002 + 0.3)
    for _ in range(3):
        w.add(Wait(3, 0.162, 0.16, tokens=3))
    w.add(Wait(3, 0.302, 0.3, tokens=3))                 # one slow answer does not tilt the line
    assert w.fixed_s == pytest.approx(0.07) and w.wait_s(3) == pytest.approx(0.002 + 0.16)
    assert w.per_token_s == pytest.approx(0.1)           # the deadline's share of a draft: as before
    bent = RoundTrips()                                  # a line that says the fixed part is < 0
    for g, c in ((1, 0.01), (2, 0.05), (3, 0.09)):
        bent.add(Wait(g, c + 0.002, c, tokens=g))
    assert bent.fixed_s == 0.0 and bent.wait_s(3) == pytest.approx(0.002 + 3 * 0.025)   # d: median 25 ms


def test_with_the_feed_priced_once_a_memory_bound_target_asks_deeper():
    """The two-device layout measured here (AVX2 EPYC, F16 1.5B target: a step 264 ms, a verify
    over 2 / 4 tokens 1.21 / 1.53 steps; α 0.85): from γ=1 answers alone a γ=3 round is priced
    at 2.33 steps and γ=2 looks best; with the γ=3 answers' line it is 2.02 and deeper pays (on
    a prompt where γ=auto asked 1.6 on average, the fixed γ=3 measured 1.32× against 1.12×)."""
    from edge.speculative.verify import AcceptanceTracker, CostTracker

    def policy(waits):
        costs, acc = CostTracker(), AcceptanceTracker()
        for k, v in {1: 1.0, 2: 1.21, 3: 1.24, 4: 1.53, 5: 1.70, 6: 1.80}.items():
            for _ in range(4):
                costs.add_target(k, 0.264 * v)
        for _ in range(20):
            acc.update(20, 17)
        return RemoteGamma(8, waits=waits, costs=costs, acceptance=acc)

    w = RoundTrips()
    for _ in range(6):
        w.add(Wait(1, 0.079, 0.077, tokens=1))
    assert policy(w).choose(0.85) <= 2
    for _ in range(6):
        w.add(Wait(3, 0.137, 0.135, tokens=3))
    assert policy(w).choose(0.85) >= 4
