"""A RemoteDrafter's round state (edge/star/remote_round.py): its counters, backoffs and what the
draft holds of the target's context."""
import json

from edge.speculative.remote_gamma import GammaPricing
from edge.star.remote_round import Backoff, DraftHeld, DrafterStats

KEYS = {"rounds", "answered", "late_used", "timeouts", "alone", "probes", "probe_answers", "errors",
        "overloaded", "joins", "rejoins", "refused", "answered_since_join", "rtt_s", "overhead_s"}


def test_stats_serialise_with_the_keys_they_always_had():
    st = DrafterStats()
    st.answered += 2
    st.rtt_s.append(0.01)
    d = st.as_dict()
    assert set(d) == KEYS and d["answered"] == 2 and d["rtt_s"] == [0.01]
    json.dumps(d)
    assert st.rtt_s.maxlen == 4096 and DrafterStats().rtt_s is not DrafterStats().rtt_s


def test_a_backoff_doubles_up_to_its_cap_and_starts_over():
    b = Backoff(0.05, 0.3)
    assert [b.failed() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    b.reset()
    assert b.failed() == 0.05


def test_what_the_draft_holds_after_an_answer_follows_what_the_target_committed():
    assert DraftHeld().keep_for([1, 2, 3]) == 0
    assert DraftHeld(2).keep_for([1, 2, 3]) == 2
    held = DraftHeld(2, 3, (7, 8, 9))            # context[:3] + drafts[:-1] = ... 7, 8
    assert held.keep_for([1, 2, 3, 7, 8, 5]) == 5
    assert held.keep_for([1, 2, 3, 7, 4]) == 4
    assert held.keep_for([1, 2, 3, 6]) == 3


def test_pricing_seeds_the_cost_model_with_the_measured_verify_costs():
    costs = GammaPricing({1: 0.01, 2: 0.012}).cost_tracker()
    assert costs.samples(1) == 1 and costs.samples(2) == 1 and costs.samples(3) == 0
    assert GammaPricing().stop_aware and GammaPricing().cost_tracker().samples(1) == 0
