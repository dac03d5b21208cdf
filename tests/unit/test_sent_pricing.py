"""The star's adaptive γ prices a round by the drafts the service sends (edge/speculative/remote_gamma.py).

A draft service with a confidence stop (--draft-p-min) ends an answer before a draft it is
unsure of, so on uncertain text asking for γ costs a verify over fewer than γ+1 tokens. Pure:
a simulated service and a cost table stand in for the clock."""
from __future__ import annotations

import numpy as np
import pytest

from edge.speculative.remote_gamma import RemoteGamma, RoundTrips, Wait
from edge.speculative.verify import AcceptanceTracker, CostTracker

# a memory-bound target (the AVX2 EPYC two-device layout): a verify over k tokens in steps
VERIFY = {1: 1.0, 2: 1.25, 3: 1.40, 4: 1.56, 5: 1.72, 6: 1.88, 7: 2.04, 8: 2.20, 9: 2.36}
STEP_S = 0.23


def test_a_service_that_sends_all_it_is_asked_for_has_no_stop():
    w = RoundTrips()
    assert w.sent_shares(3) == [(3, 1.0)] and w.continue_share == 1.0
    for g in (1, 3, 4):
        w.add(Wait(g, 0.1, 0.09, tokens=g))
    w.add(Wait(2, 0.1, 0.09, tokens=5))          # a draft-ahead answer past the γ asked: no stop
    w.add(Wait(3, 0.2, None))                   # unanswered: says nothing of the stop
    assert w.sent_shares(4) == [(4, 1.0)]


def test_the_stop_is_a_geometric_run_censored_at_the_gamma_asked():
    w = RoundTrips()
    for sent in (1, 2, 4, 4):
        w.add(Wait(4, 0.1, 0.05, tokens=sent))
    w.add(Wait(4, 0.1, 0.05, tokens=0))         # nothing sent: RoundTrips.answered's to count
    assert w.continue_share == pytest.approx((7 + 1) / (7 + 2 + 1))     # continues 0+1+3+3, stops 2
    shares = dict(w.sent_shares(3))
    assert shares == pytest.approx({1: 0.2, 2: 0.16, 3: 0.64})
    assert sum(shares.values()) == pytest.approx(1.0)
    assert w.sent_shares(0) == []


def test_the_wait_prices_the_drafts_expected_to_be_sent():
    """compute = 50 ms + 30 ms a sent draft; the service mostly sends one of the four asked."""
    w = RoundTrips()
    for sent in (1, 1, 1, 2, 1, 2, 1, 1):
        w.add(Wait(4, 0.01 + 0.05 + 0.03 * sent, 0.05 + 0.03 * sent, tokens=sent))
    mean_sent = sum(s * p for s, p in w.sent_shares(8))
    assert 1.0 < mean_sent < 1.6
    assert w.wait_s(8) == pytest.approx(0.01 + 0.05 + 0.03 * mean_sent)
    assert w.wait_s(8, sent=False) == pytest.approx(0.01 + 0.05 + 0.03 * 8)


def _policy(stop_aware: bool) -> RemoteGamma:
    costs = CostTracker()
    for k, v in VERIFY.items():
        for _ in range(4):
            costs.add_target(k, STEP_S * v)
    return RemoteGamma(8, costs=costs, acceptance=AcceptanceTracker(), stop_aware=stop_aware, explore=2)


def _serve(policy: RemoteGamma, rounds: int, q_true: float, a_true: float, seed: int = 0) -> float:
    """Target steps per token: each round the service sends min(γ, S) drafts (S >= 1 geometric,
    continue share q_true), each kept with probability a_true; the wait is 2 ms + a 30 ms feed +
    20 ms a sent draft (the Q4_0 0.5B service on its own core); the target's verify over k tokens
    costs VERIFY[k] steps."""
    rng = np.random.default_rng(seed)
    steps = tokens = 0.0
    for _ in range(rounds):
        g = policy.next_gamma()
        if g == 0:
            steps, tokens = steps + 1.0, tokens + 1
            continue
        s = 1
        while s < g and rng.random() < q_true:
            s += 1
        ok = rng.random(s) < a_true
        n = s if ok.all() else int(np.argmin(ok))
        compute = 0.03 + 0.02 * s
        policy.waits.add(Wait(g, 0.002 + compute, compute, tokens=s))
        policy.acceptance.update(g, n)
        steps += VERIFY[s + 1] + (0.002 + compute) / STEP_S
        tokens += n + 1
    return steps / tokens


def test_pricing_the_sent_drafts_asks_deeper_where_the_service_stops_early():
    """Uncertain text (MT-bench first turns, two-device star: the service sends 1–2 of what it is
    asked for and the target keeps ~90% of those). Priced as asked, a γ=3 round looks like a verify
    over 4 tokens and the policy stays shallow (γ 0–1); priced by what is sent, asking deep costs
    about what asking 2 does, and the target spends fewer steps a token (1.18 against 1.39 tokens
    a step in this simulation, seed 0; 4–5% fewer steps a token with seeds 1, 2)."""
    for seed in range(3):
        asked, sent = _policy(False), _policy(True)
        cost_asked = _serve(asked, 300, q_true=0.35, a_true=0.9, seed=seed)
        cost_sent = _serve(sent, 300, q_true=0.35, a_true=0.9, seed=seed)
        g_asked, g_sent = asked.choose(asked.acceptance.alpha), sent.choose(sent.acceptance.alpha)
        assert g_sent > g_asked
        assert cost_sent < 0.97 * cost_asked       # 0.85, 0.95, 0.96 of it


def test_where_the_service_sends_everything_both_pricings_agree():
    """No stop seen: sent = asked, so the choice is the older model's, round for round."""
    asked, sent = _policy(False), _policy(True)
    assert _serve(asked, 200, q_true=1.0, a_true=0.8) == pytest.approx(_serve(sent, 200, q_true=1.0, a_true=0.8))
    assert asked.choose(0.8) == sent.choose(0.8) > 0


def _seeded(curve, stop_aware=True) -> RemoteGamma:
    costs = CostTracker()
    for k, v in curve.items():
        for _ in range(4):
            costs.add_target(k, STEP_S * v)
    pol = RemoteGamma(8, costs=costs, acceptance=AcceptanceTracker(prior=0.7), stop_aware=stop_aware)
    for _ in range(6):
        pol.waits.add(Wait(3, 0.002 + 0.03 + 0.02 * 3, 0.03 + 0.02 * 3, tokens=3))
        pol.acceptance.update(3, 2)
    return pol


def test_the_targets_stop_follows_its_verify_cost():
    """p_min = R·(Δv + b/t1): a memory-bound target (the Xeon two-device layout: a verify over
    2..9 tokens ~0.92–1.1 steps) takes drafts the 0.5B is unsure of; one where a verify over k
    tokens costs k steps wants only the near-certain; none before the curve is measured."""
    flat = _seeded({k: 0.92 + 0.025 * (k - 2) if k > 1 else 1.0 for k in range(1, 10)})
    steep = _seeded({k: float(k) for k in range(1, 10)})
    assert 0.05 < flat.p_min() < 0.35                           # Δv 0.025, b/t1 0.09, R ~1.5-2
    assert steep.p_min() == RemoteGamma.MAX_P_MIN
    assert _seeded({1: 1.0, 2: 1.2}, stop_aware=False).p_min() is None
    assert RemoteGamma(8).p_min() is None
