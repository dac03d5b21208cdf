"""The probe / refresh schedule both adaptive γ policies use (edge/speculative/gamma_probes.py)."""
from edge.speculative.gamma_probes import ProbeSchedule
from edge.speculative.local_gamma import AdaptiveGamma
from edge.speculative.remote_gamma import RemoteGamma


def _probes(s: ProbeSchedule, rounds: int, pays: bool) -> list:
    """The plain-step counts at which a probe came due."""
    return [n for n in range(1, rounds + 1) if s.plain(lambda: pays) is not None]


def test_probes_come_after_doubling_runs_of_plain_steps():
    assert _probes(ProbeSchedule(8), 120, pays=True) == [8, 24, 56, 120]


def test_where_not_even_an_optimistic_alpha_pays_the_interval_grows_faster():
    assert _probes(ProbeSchedule(4, quiet_growth=4), 90, pays=False) == [4, 20, 84]


def test_the_interval_is_capped_while_speculation_could_pay():
    assert _probes(ProbeSchedule(16, max_interval=32), 150, pays=True) == [16, 48, 80, 112, 144]


def test_pays_is_asked_only_when_a_probe_is_due():
    asked = []
    s = ProbeSchedule(3)
    got = [s.plain(lambda: asked.append(1) or False) for _ in range(3)]
    assert got == [None, None, False] and asked == [1]


def test_a_refresh_plain_step_every_so_many_speculating_rounds_and_speculation_restarts_the_probe_count():
    s = ProbeSchedule(2)
    assert [s.speculating(3, every=2) for _ in range(7)] == [3, 3, 0, 3, 3, 0, 3]
    assert s.plain(lambda: True) is None and s.plain(lambda: True) is True     # probe_start again
    assert s.plain(lambda: True) is None
    s.speculating(3, every=2)
    assert s.plain(lambda: True) is None and s.plain(lambda: True) is True     # the interval reset too


def test_both_policies_probe_where_drafting_does_not_pay():
    local = AdaptiveGamma(max_gamma=3, probe_start=4)
    for _ in range(2):
        local.costs.add_target(1, 0.01)
    local.costs.add_target(4, 0.04)       # verify over k tokens costs k steps: no γ pays
    local.costs.add_draft(1, 0.005)
    local.acceptance.update(3, 1)
    remote = RemoteGamma(max_gamma=3, probe_start=4, background=True)
    remote.costs.add_target(1, 0.01)
    remote.costs.add_target(4, 0.04)
    from edge.speculative.remote_gamma import Wait
    for _ in range(2):
        remote.waits.add(Wait(1, 0.02, 0.01, 1))
        remote.acceptance.update(1, 0)
    assert [local.next_gamma() for _ in range(12)] == [0] * 12      # not even α=0.8 pays: no probe
    seen = []
    for _ in range(12):
        g = remote.next_gamma()
        seen.append((g, remote.probe))
    assert all(g == 0 for g, _ in seen)
    assert [i for i, (_, p) in enumerate(seen) if p] == [3]           # a background probe after 4 plain steps
