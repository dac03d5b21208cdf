"""server/liveness.py: a service is trusted once it answers a probe, and dead on its will, silence
or unacknowledged work; the registry and the router follow it."""
from __future__ import annotations

import pytest

from edge.wire.protocol import DraftHello, Join
from server.liveness import Liveness
from server.registry import Refusal, Registry


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_retained_hello_is_trusted_only_after_the_probe_is_answered():
    c = Clock()
    lv = Liveness(stale_after=10, answer_within=5, clock=c)
    assert lv.heard("a", True) is True and not lv.alive("a")      # first hello: probe it
    c.t += 1
    assert lv.heard("a", True) is False and lv.alive("a")         # a hello after the probe: alive
    assert lv.heard("ghost", True) is True                         # a dead one never answers
    c.t += 6
    assert not lv.alive("ghost") and lv.sweep() == []
    lv.forget_probes()                              # we reconnected: the ghost's retained hello again
    assert lv.heard("ghost", True) is True and not lv.alive("ghost")   # probed again, not trusted
    assert lv.alive("a")


def test_will_silence_and_unacknowledged_work_end_a_service():
    c = Clock()
    lv = Liveness(stale_after=10, answer_within=5, clock=c)
    for n in ("willed", "silent", "deaf", "busy"):
        lv.heard(n, True)
        lv.heard(n, True)
        assert lv.alive(n)
    lv.heard("willed", False)
    assert not lv.alive("willed") and lv.deaths["will"] == 1
    lv.owe("deaf")
    lv.owe("busy")
    c.t += 4
    lv.heard("busy", True)                       # acknowledged in time
    c.t += 2
    assert lv.sweep() == ["deaf"] and lv.deaths["unanswered"] == 1
    c.t += 5                                     # "silent" last spoke 11 s ago, "busy" 7 s ago
    assert lv.sweep() == ["silent"] and lv.alive("busy") and not lv.alive("silent")
    assert lv.heard("silent", True) is True and not lv.alive("silent")   # back: prove it again
    assert lv.heard("silent", True) is False and lv.alive("silent")
    with pytest.raises(ValueError):
        Liveness(stale_after=0)


def _hello(name, online=True, sessions=0):
    return DraftHello(name, "tok", 256, online, 8, 8, sessions)


def test_registry_assigns_only_to_proven_services_and_releases_a_dead_ones_sessions():
    c = Clock()
    reg = Registry(liveness=Liveness(stale_after=10, answer_within=5, clock=c))
    join = Join("dev", "tok", 256, 4)
    assert reg.update_service(_hello("ghost")) is True            # a stale retained hello: probed
    with pytest.raises(Refusal, match="no draft service is online"):
        reg.admit(join)
    assert reg.update_service(_hello("live")) is True
    assert reg.update_service(_hello("live")) is False             # its answer
    assert reg.online_services() == ["live"]
    svc, sid, _ = reg.admit(join)
    assert svc.name == "live" and reg.count() == 1
    c.t += 6                                                       # it never acknowledged the session
    assert reg.sweep() == ["live"] and reg.count() == 0 and reg.online_services() == []
    assert reg.snapshot()["services"]["live"]["online"] is False
