"""The fleet simulator's invariants (benchmarks/lib/fleet_des.py): with nothing in the way it is
the planner; more targets per draft service never help a target; it charges the broker for the
messages a real round sends."""
import pytest

from benchmarks.lib.fleet_des import FleetInputs, simulate
from benchmarks.lib.fleet_round_count import ROUND_KINDS, ROUND_MESSAGES, count_star, mqtt_publish_bytes
from edge.speculative.sampling import GREEDY
from edge.speculative.verify import expected_tokens
from edge.wire.memory_link import MemoryBus, MemoryLink
from harness.goodness_of_fit import TableEngine
from server.hub import Hub
from server.planner import SystemInputs, simulate as planner_simulate

ORIN = {"target_step_ms": 29.4, "verify_cost": {1: 1.0, 3: 1.02, 5: 1.05, 6: 1.07}}


def system(draft_step_ms, rtt_ms=0.0, alpha=0.68):
    return SystemInputs(draft_step_ms=draft_step_ms, draft_feed_ms=0.0, rtt_ms=rtt_ms, alpha=alpha, **ORIN)


@pytest.mark.parametrize("n,gamma", [(1, 4), (8, 4), (3, 2)])
def test_free_draft_and_free_broker_give_the_planners_speedup(n, gamma):
    sysi = system({1: 0.0})
    planned = planner_simulate(sysi, n, gamma)
    analytic = expected_tokens(0.68, gamma) / ORIN["verify_cost"][gamma + 1]
    for join in (True, False):
        fleet = simulate(FleetInputs(sysi, gamma), n, deterministic=True, window_ms=4000, join=join)
        assert fleet.speedup == pytest.approx(analytic, rel=1e-9)
        # the planner counts its staggered start in its horizon: a fraction of a percent off E / v
        assert fleet.speedup == pytest.approx(planned.per_target_tps / planned.standalone_tps, rel=5e-3)
    assert fleet.draft_busy == 0.0 and fleet.broker_load == 0.0     # nothing was charged


def test_the_planners_loop_with_a_real_draft_cost():
    """Whole batches (join=False) are the planner's model: the same rounds, the same tok/s."""
    sysi = system({1: 12.0, 4: 20.0, 16: 45.0}, rtt_ms=2.0)
    for n in (1, 2, 5):
        fleet = simulate(FleetInputs(sysi, 4), n, deterministic=True, window_ms=20000, join=False)
        planned = planner_simulate(sysi, n, 4)
        assert fleet.per_target_tps == pytest.approx(planned.per_target_tps, rel=5e-3)
        assert fleet.round_ms == pytest.approx(planned.iteration_ms, rel=5e-3)
        if n == 1:          # under-loaded: draft, then verify, then the round trip
            assert fleet.round_ms == pytest.approx(4 * 12.0 + sysi.return_ms(4), rel=1e-9)


def test_more_targets_per_draft_service_never_raise_per_target_speedup():
    sysi = system({1: 6.0, 2: 6.5, 4: 7.5, 8: 9.5, 16: 13.5, 32: 21.5, 64: 37.5})
    inp = FleetInputs(sysi, 4, net_ms=1.0, broker_msg_ms=0.005)
    speedups = [simulate(inp, n, 1, 1, deterministic=True, window_ms=3000).speedup for n in (1, 2, 4, 8, 16, 32, 64)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(speedups, speedups[1:])), speedups
    assert speedups[-1] < 0.8 * speedups[0]         # the draft does saturate in this range
    # the same targets over twice the draft services: each service has half of them
    one = simulate(inp, 64, 1, 1, deterministic=True, window_ms=3000)
    two = simulate(inp, 64, 1, 2, deterministic=True, window_ms=3000)
    assert two.speedup >= one.speedup and two.sessions_per_service == 32


def test_a_slow_broker_node_is_the_bottleneck_and_its_load_is_counted():
    sysi = system({1: 0.0})
    fast = simulate(FleetInputs(sysi, 4, broker_msg_ms=0.001), 200, 1, 1, deterministic=True, window_ms=2000)
    rounds_per_s = fast.rounds / 2.0
    assert fast.broker_msgs_per_s == pytest.approx(len(ROUND_MESSAGES) * rounds_per_s, rel=0.02)
    assert fast.broker_load == pytest.approx(fast.broker_msgs_per_s * 0.001 / 1e3)
    slow = simulate(FleetInputs(sysi, 4, broker_msg_ms=0.5), 200, 1, 1, deterministic=True, window_ms=2000)
    assert slow.broker_load > 0.95 and slow.speedup < 0.5 * fast.speedup
    # two hubs: each node carries half the targets, at the same speedup as one hub with the fast broker
    two = simulate(FleetInputs(sysi, 4, broker_msg_ms=0.5), 200, 2, 2, deterministic=True, window_ms=2000)
    assert two.speedup > slow.speedup


def test_the_simulator_charges_the_broker_the_protocols_round():
    inp = FleetInputs(system({1: 5.0, 8: 9.0}), 4, net_ms=1.0, broker_msg_ms=0.01)
    p = simulate(inp, 16, 2, 4, window_ms=2000)
    assert p.rounds > 0 and p.messages_per_round == len(ROUND_MESSAGES)


def test_a_real_round_sends_the_protocols_messages():
    """A real hub, draft service and target on the in-memory bus, counted from a `#` subscriber."""
    bus = MemoryBus()
    res = count_star(lambda name: MemoryLink(bus, name),
                     lambda: Hub(link=MemoryLink(bus, "hub"), draft_engine=TableEngine(vocab=8, seed=7),
                                 tokenizer_fp="tok", status_every=60.0).start(),
                     TableEngine(vocab=8, seed=1), "tok", [[1, 2, 3], [2, 3, 4]], 16, GREEDY, gamma=3,
                     settle_s=0.2)
    assert res["rounds"] > 4 and res["answered"] == res["rounds"]
    assert set(res["per_round"]) == set(ROUND_KINDS)
    for kind in ROUND_KINDS:
        assert res["per_round"][kind]["messages"] == 1.0
    assert res["round_messages"] == len(ROUND_MESSAGES)
    assert "up:bye" in res["other_kinds"] and "join:join" in res["other_kinds"]


def test_mqtt_publish_bytes():
    assert mqtt_publish_bytes("a/b", 10, 0) == 1 + 1 + 2 + 3 + 10
    assert mqtt_publish_bytes("a/b", 10, 1) == 1 + 1 + 2 + 3 + 2 + 10 + 4      # packet id and its PUBACK
    assert mqtt_publish_bytes("a/b", 200, 0) == 1 + 2 + 2 + 3 + 200            # two length bytes past 127
