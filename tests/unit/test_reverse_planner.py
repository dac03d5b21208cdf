"""The reverse star's model (server/reverse_planner.py): which way a device joins, and the closed
loop of N drafting devices around the hub's batched verify, checked where it has a closed form."""
import pytest

from edge.speculative.verify import expected_tokens
from server.reverse_planner import (DRAFTER, NONE, TARGET, ReverseInputs, choose_direction, plain_batched_tps,
                                    simulate_reverse, sweep_reverse)

GB = 1e9


def test_a_device_joins_by_what_it_holds():
    assert choose_direction(22.5 * GB, 8.9 * GB, 0.4 * GB, 0.5 * GB)[0] == TARGET
    way, why = choose_direction(5.2 * GB, 8.9 * GB, 0.4 * GB, 0.5 * GB)
    assert way == DRAFTER and "9.4 GB > 5.2 GB" in why
    assert choose_direction(0.5 * GB, 8.9 * GB, 0.4 * GB, 0.5 * GB)[0] == NONE


def test_one_device_is_the_closed_form():
    inp = ReverseInputs({1: 100.0, 5: 110.0, 10: 130.0}, draft_step_ms=20.0, rtt_ms=5.0, alpha=0.7)
    p = simulate_reverse(inp, 1, 4)
    want = 1e3 * expected_tokens(0.7, 4) / (4 * 20.0 + 5.0 + 110.0)
    assert p.hub_tps == pytest.approx(want, rel=0.01) and p.per_device_tps == pytest.approx(want, rel=0.01)
    assert plain_batched_tps(inp, 1) == pytest.approx(10.0)
    assert p.vs_plain == pytest.approx(want / 10.0, rel=0.01)


def test_a_saturated_hub_batches_more_devices():
    inp = ReverseInputs({1: 100.0, 8: 105.0, 40: 160.0, 80: 240.0}, draft_step_ms=5.0, rtt_ms=2.0, alpha=0.7)
    small, big = simulate_reverse(inp, 2, 4), simulate_reverse(inp, 16, 4)
    assert big.mean_batch > small.mean_batch and big.hub_tps > small.hub_tps
    assert big.per_device_tps < small.per_device_tps            # each device waits on the shared hub
    best = sweep_reverse(inp, [4], [1, 2, 4, 8])[0]
    assert best.hub_tps >= simulate_reverse(inp, 4, 1).hub_tps
    with pytest.raises(ValueError):
        simulate_reverse(inp, 4, 0)
