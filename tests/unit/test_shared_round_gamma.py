"""γ=auto when several generations share the target's rounds (edge/speculative/remote_gamma.py, `sharing`;
edge/engines/batched_calls.py batches their forwards into one call a round). Pure: a cost table stands in for
the clock, and GammaRounds is fed what generate.py feeds it on a shared engine.

The round a generation joins serves N generations: the others put R rows in it (at least N-1) and
commit N-1 tokens, so its γ drafts cost v(R+γ+1) against v(R+1) for the whole round. On a CPU a
row costs a good share of a step (compute-bound batches), so drafts that pay alone stop paying at
N = 4; where rows are nearly free (a memory-bound target) they still pay."""
from __future__ import annotations

import pytest

from edge.speculative.gamma_rounds import GammaRounds
from edge.speculative.remote_gamma import GammaPricing, RemoteGamma, RoundTrips, Wait
from edge.speculative.verify import CostTracker

STEP_S = 0.04                         # a one-row call


def cpu_rows(k: int) -> float:
    """Seconds of a call over k rows: a fixed part and a row share (0.5B Q4_K_M on one core: 4 rows ~1.6-2x
    one)."""
    return STEP_S * (0.7 + 0.3 * k)


def flat_rows(k: int) -> float:
    """A memory-bound target: extra rows nearly free."""
    return STEP_S * (1.0 + 0.002 * (k - 1))


def policy(rows, n: int) -> RemoteGamma:
    """A target's policy with a cost curve measured over 1..40 rows and a fast draft service
    (2 ms fixed, 4 ms a draft), `n` generations sharing the rounds."""
    costs = GammaPricing({k: rows(k) for k in range(1, 41)}).cost_tracker()
    waits = RoundTrips()
    for g in (1, 2, 3, 1, 2, 3):
        waits.add(Wait(g, 0.002 + 0.004 * g, 0.004 * g, tokens=g))
    return RemoteGamma(8, waits, costs=costs, sharing=lambda: n)


@pytest.mark.parametrize("alpha", [0.6, 0.7, 0.75])
def test_drafts_that_pay_alone_do_not_pay_in_a_compute_bound_round_of_four(alpha):
    assert policy(cpu_rows, 1).choose(alpha) >= 1
    assert policy(cpu_rows, 4).choose(alpha) == 0


def test_a_memory_bound_round_of_four_still_speculates():
    assert policy(flat_rows, 4).choose(0.7) >= 2


def test_a_plain_round_costs_its_n_rows_and_one_alone():
    assert policy(cpu_rows, 1).round_cost(0) == pytest.approx(1.0)
    assert policy(cpu_rows, 4).round_cost(0) == pytest.approx(cpu_rows(4) / cpu_rows(1))
    # a γ round: the verify over the others' N-1 rows and this one's γ+1, the wait on top
    p = policy(cpu_rows, 4)
    wait = p.waits.wait_s(2) / STEP_S
    assert p.round_cost(2) == pytest.approx(cpu_rows(3 + 3) / cpu_rows(1) + wait)
    assert p.others() == (3, 3)


def test_the_others_rows_come_from_the_rounds_that_served_this_generation():
    p = policy(cpu_rows, 4)
    for _ in range(8):
        p.shared_round(1, 21)            # the others verify 20 rows a round (γ=4 each)
    assert p.others() == (20, 3)
    assert p.round_cost(0) == pytest.approx(cpu_rows(21) / cpu_rows(1))
    p.shared_round(1, 400)               # a round that held another's prompt: no sample
    assert p.others() == (20, 3)
    p.sharing = lambda: 1                # alone again: no others whatever was seen
    assert p.others() == (0, 0) and p.round_cost(0) == pytest.approx(1.0)


def test_sharing_read_at_each_choice():
    n = [1]
    p = policy(cpu_rows, 1)
    p.sharing = lambda: n[0]
    assert p.choose(0.7) >= 1
    n[0] = 4                          # three more generations joined the rounds
    assert p.choose(0.7) == 0
    n[0] = 1                          # they left
    assert p.choose(0.7) >= 1


def test_shared_rounds_feed_the_whole_rounds_cost_not_the_calls_wait():
    """On a shared engine a generation's call time counts its wait for the round; the policy is fed
    the round's own rows and seconds instead (a policy that does not price shared rounds keeps its
    own call's)."""
    p = RemoteGamma(8, costs=CostTracker(), sharing=lambda: 2)
    rounds = GammaRounds(p, 8)
    rounds.verified(3, 0.9, n_verify_calls=2, served=(12, 0.2))
    assert p.costs.samples(12) == 1 and p.costs.samples(3) == 0
    assert p.costs.target_seconds(12) == pytest.approx(0.2)
    assert list(p._other_rows) == [9]                            # the others' rows in that round
    rounds.verified(3, 0.05, n_verify_calls=3)                   # an engine not shared: the call itself
    assert p.costs.samples(3) == 1

    class Local:                                                 # e.g. a co-located draft's policy
        costs = CostTracker()
    local = GammaRounds(Local(), 8)
    local.verified(3, 0.9, n_verify_calls=2, served=(12, 0.2))
    assert Local.costs.samples(3) == 1 and Local.costs.samples(12) == 0


def test_shared_greedy_rounds_explore_in_the_background_not_in_rounds():
    """Sharing the round, a greedy generation primes nothing and explores no round (either would hold
    the others' rounds on the draft); its first probes go in the background. Alone, as before."""
    alone = policy(cpu_rows, 1)
    alone.background = True
    assert alone.first_gamma >= 1
    p = RemoteGamma(8, RoundTrips(), costs=GammaPricing({k: cpu_rows(k) for k in range(1, 41)}).cost_tracker(),
                    sharing=lambda: 4, background=True, probe_start=4)
    assert p.first_gamma == 0
    gammas, probes = [], []
    for _ in range(12):
        gammas.append(p.next_gamma())
        probes.append(p.probe)
    assert gammas == [0] * 12 and probes.count(p.probe_gamma) >= 1
    sampled = RemoteGamma(8, RoundTrips(), costs=GammaPricing({k: cpu_rows(k) for k in range(1, 41)}).cost_tracker(),
                          sharing=lambda: 4)
    assert sampled.first_gamma >= 1 and sampled.next_gamma() >= 1    # sampling: no background probes
