"""The reverse star with generations (server/reverse_schedule.py): the hub's prefill of each prompt
stalls the other devices' rounds; checked where it has a closed form, and through `edge-hub plan`."""
import pytest
from click.testing import CliRunner

from edge.speculative.verify import expected_tokens
from server.reverse_planner import ReverseInputs, simulate_reverse
from server.reverse_schedule import Job, simulate_schedule, steady_jobs

TABLE = {1: 100.0, 5: 110.0, 10: 130.0, 20: 160.0, 100: 1000.0}


def test_one_device_without_a_prompt_is_the_closed_form():
    inp = ReverseInputs(TABLE, draft_step_ms=20.0, rtt_ms=5.0, alpha=1.0)
    p = simulate_schedule(inp, [[Job(1, 25)]], 4)          # 5 tokens a round: 5 rounds, the first not timed
    round_ms = 4 * 20.0 + 5.0 + 110.0
    assert p.hub_tps == pytest.approx(1e3 * 20 / (4 * round_ms))
    assert p.prefill_s == 0.0
    # many generations: the steady loop's rate (it is the same model, rounds only)
    long = simulate_schedule(ReverseInputs(TABLE, 20.0, 5.0, 0.7), [[Job(1, 4000)]], 4)
    loop = simulate_reverse(ReverseInputs(TABLE, 20.0, 5.0, 0.7), 1, 4)
    assert long.hub_tps == pytest.approx(loop.hub_tps, rel=0.01)


def test_a_prompt_prefill_stalls_the_other_devices():
    inp = ReverseInputs(TABLE, draft_step_ms=20.0, rtt_ms=5.0, alpha=0.8)
    # first prompts arrive together and join one step (verify_join.py): both prefilled before either
    # device's first answer, so neither decodes through the other's prefill
    first = simulate_schedule(inp, [[Job(2, 40)], [Job(101, 40)]], 4)
    assert first.prefill_s == pytest.approx(1.0 + 0.1, rel=0.01) and first.mean_batch == pytest.approx(2.0)
    # a device's NEXT prompt is prefilled while the other decodes: that one decodes through it
    short = simulate_schedule(inp, [[Job(2, 40), Job(2, 40)], [Job(2, 60)]], 4)
    long = simulate_schedule(inp, [[Job(2, 40), Job(101, 40)], [Job(2, 60)]], 4)
    assert long.prefill_s == pytest.approx(0.1 + 1.0 + 0.1, rel=0.01) and long.hub_tps < 0.95 * short.hub_tps
    rounds = -(-40 // expected_tokens(0.8, 4))
    assert long.busy_s > long.prefill_s + rounds * 0.110
    # run together (job k starts once every device finished job k - 1), windows from the group's last
    # first answer: no generation's window holds a prefill, the long prompt costs no decode rate
    t_short = simulate_schedule(inp, [[Job(2, 40), Job(2, 40)], [Job(2, 40), Job(2, 40)]], 4, together=True)
    t_long = simulate_schedule(inp, [[Job(2, 40), Job(101, 40)], [Job(2, 40), Job(2, 40)]], 4, together=True)
    assert t_long.hub_tps == pytest.approx(t_short.hub_tps, rel=0.02) and t_long.wall_s > t_short.wall_s + 0.85


def test_devices_answered_together_stay_together():
    """The service's join rule in the model: a return (drafting + round trip) shorter than one call is
    waited for, so every call verifies all N devices; a return far longer than the call is not."""
    inp = ReverseInputs(TABLE, draft_step_ms=20.0, rtt_ms=5.0, alpha=0.7)
    assert simulate_reverse(inp, 4, 4).mean_batch == pytest.approx(4.0, rel=0.02)
    slow = simulate_reverse(ReverseInputs(TABLE, draft_step_ms=200.0, rtt_ms=5.0, alpha=0.7), 4, 4)
    assert slow.mean_batch == pytest.approx(4.0, rel=0.02)   # a return of 805 ms > the call: still together


def test_each_job_has_its_own_acceptance():
    inp = ReverseInputs(TABLE, draft_step_ms=20.0, rtt_ms=5.0, alpha=0.5)
    low = simulate_schedule(inp, [[Job(2, 60)]], 4)
    high = simulate_schedule(inp, [[Job(2, 60, alpha=0.95)]], 4)
    assert high.hub_tps > 1.5 * low.hub_tps
    with pytest.raises(ValueError):
        simulate_schedule(inp, [[Job(2, 60)]], 0)


def test_plan_prints_the_prediction_with_prompts():
    from server.hub_cli import main
    r = CliRunner().invoke(main, ["plan", "--hub-call-ms", "1=150,5=160,20=190,40=250,200=2500", "--device-draft-ms",
                                  "25", "--alpha", "0.7", "--ns", "1,4", "--gamma", "4", "--prompt-tokens", "200",
                                  "--new-tokens", "64"])
    assert r.exit_code == 0, r.output
    assert "with prompts of 200 tokens" in r.output and "hub prefilling" in r.output
    rows = [line for line in r.output.splitlines() if line.startswith("| 4 | 4 |")]
    assert len(rows) == 2                               # rounds only, then with prompts
    assert float(rows[1].split("|")[3]) < float(rows[0].split("|")[3])
    assert len(steady_jobs(3, 10, 5)) == 3
