"""Why speculation did not pay, from what the run measured (edge/speculative/speedup_note.py:
the lines `edge-agent generate` prints under its table)."""
from edge.speculative.generate import CallTiming, GenResult
from edge.speculative.local_gamma import AdaptiveGamma
from edge.speculative.speedup_note import costs_from_timings, speedup_note

T1 = 0.05          # a target single step, seconds


def _run(gammas, verify_ks, drafted=0, accepted=0, draft_s=0.0, probe_s=0.0, decode_s=1.0):
    timings = [CallTiming("verify", k, T1 * (k if k > 1 else 1)) for k in verify_ks]
    timings += [CallTiming("draft", g, draft_s * g) for g in gammas if g]
    if probe_s:
        timings.append(CallTiming("draft_probe", 2, probe_s))
    return GenResult(tokens=[1] * len(gammas), n_verify_calls=len(verify_ks), n_drafted=drafted,
                     n_accepted=accepted, wall_s=decode_s, timings=timings, gammas=list(gammas))


def _plain(n, tps):
    return GenResult(tokens=[1] * n, n_verify_calls=n, wall_s=n / tps,
                     timings=[CallTiming("verify", 1, T1)] * n, gammas=[0] * n)


def test_gamma_auto_that_never_drafted_says_what_it_measured_and_where_it_pays():
    policy = AdaptiveGamma(8)
    for _ in range(10):
        policy.costs.add_target(1, T1)
    policy.costs.add_draft(1, 0.5 * T1)              # the draft's probe: half a target step
    spec = _run([0] * 16, [1] * 16, probe_s=0.06, decode_s=16 * T1 + 0.06)
    note = speedup_note(spec, _plain(16, 1 / T1), policy)
    lines = note.splitlines()
    assert lines[0].startswith("γ=auto drafted in 0 of 16 rounds (0.93x the target alone): the target alone "
                               "plus the draft's pricing probe (0.06 s, 7% of the decode time)"), lines[0]
    assert "a draft step costs 0.50 target steps" in lines[1] and "a prior: no round drafted" in lines[1]
    assert "(optimistic)" in lines[2] and "not above the 1.05x γ=auto asks for: drafting does not pay" in lines[2]
    assert "each draft token costs 0.50 of a target step" in lines[2]
    assert "docs/star.md" in lines[3]


def test_a_fixed_gamma_on_a_compute_bound_target_names_the_measured_verify_cost():
    spec = _run([3] * 10, [1] + [4] * 10, drafted=30, accepted=15, draft_s=0.3 * T1, decode_s=2.0)
    note = speedup_note(spec, _plain(20, 20.0), None, max_gamma=3)
    assert note.startswith("γ=3 drafted in 10 of 10 rounds (0.25x the target alone)")
    assert "a verify over 4 tokens costs 4.0 single steps" in note and "accepted 50% of 30 drafts" in note
    assert "the target is compute-bound here" in note and "drafting does not pay on this machine" in note


def test_nothing_is_said_when_speculation_paid():
    spec = _run([3] * 10, [1] + [4] * 10, drafted=30, accepted=28, draft_s=0.01 * T1, decode_s=1.0)
    assert speedup_note(spec, _plain(20, 10.0), None, max_gamma=3) is None


def test_timings_are_read_as_the_policy_reads_them():
    costs = costs_from_timings(_run([0, 2], [1, 1, 1, 3], draft_s=0.2 * T1))
    assert costs.samples(1) == 2 and costs.samples(3) == 1       # the first target call left out
    assert abs(costs.c - 0.2) < 1e-9 and abs(costs.verify_cost(3) - 3.0) < 1e-9


def test_a_short_run_where_drafting_pays_says_so_and_points_nowhere_else():
    policy = AdaptiveGamma(4)
    for _ in range(4):
        policy.costs.add_target(1, T1)
    policy.costs.add_target(4, 1.2 * T1)             # memory-bound: 4 tokens for 1.2 steps
    policy.costs.add_draft(3, 0.3 * T1)
    policy.acceptance.update(3, 3)
    spec = _run([0, 0, 3, 0, 3], [1, 1, 4, 1, 4], drafted=3, accepted=3, draft_s=0.1 * T1)
    note = speedup_note(spec, None, policy)
    assert note.splitlines()[0] == "γ=auto drafted in 2 of 5 rounds"
    assert "drafting pays here, and this run was too short" in note and "docs/star.md" not in note
