"""server/registry.py: a session the hub assigned is released once a newer hello of its service
stops listing it -- an assignment or a release lost on the way (a partition, a link moving between
broker nodes) no longer leaves it in the hub's count forever. The clock is driven by hand."""
from __future__ import annotations

from edge.wire.protocol import DraftHello, Join, decode, encode
from server.liveness import Liveness
from server.registry import Registry


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _hello(held, stamp, name="svc"):
    return DraftHello(name, "tok", 256, True, 8, 8, len(held or ()), held=held, stamp=stamp)


def _registry():
    clock = Clock()
    reg = Registry(liveness=Liveness(stale_after=1e9, answer_within=5, clock=clock), client_share=1.0)
    reg.update_service(_hello([], 1.0))          # probed ...
    reg.update_service(_hello([], 2.0))          # ... and answered: alive
    return reg, clock


def test_an_assignment_the_service_never_lists_is_released_after_the_grace():
    reg, clock = _registry()
    _, lost, _ = reg.admit(Join("dev1", "tok", 256))
    _, kept, _ = reg.admit(Join("dev2", "tok", 256))
    clock.t += 1
    reg.update_service(_hello([kept], 3.0))      # a newer hello, but the assignment is 1 s old: kept
    assert set(reg.sessions) == {lost, kept}
    clock.t += 4                                 # 5 s: past answer_within
    reg.update_service(_hello([kept], 4.0))
    assert set(reg.sessions) == {kept} and reg.unconfirmed == 1
    assert reg.snapshot()["unconfirmed"] == 1


def test_a_lost_release_is_caught_by_the_next_hello():
    reg, clock = _registry()
    _, sid, _ = reg.admit(Join("dev1", "tok", 256))
    clock.t += 6
    reg.update_service(_hello([sid], 3.0))       # the service confirms it
    assert reg.count() == 1
    clock.t += 60                                # its target left (bye, or eviction); the release was lost
    reg.update_service(_hello([], 4.0))
    assert reg.count() == 0


def test_a_stale_or_unlisting_hello_releases_nothing():
    reg, clock = _registry()
    _, sid, _ = reg.admit(Join("dev1", "tok", 256))
    clock.t += 60
    reg.update_service(_hello([], 1.5))          # a retained copy older than the assignment (RabbitMQ: per node)
    reg.update_service(_hello([], 2.0))          # the very hello the assignment followed
    reg.update_service(_hello(None, 9.0))        # a service with too many sessions to list them
    assert list(reg.sessions) == [sid]
    reg.update_service(_hello([], 10.0))         # news that does not list it
    assert reg.count() == 0


def test_only_the_named_services_sessions_are_released():
    reg, clock = _registry()
    reg.update_service(_hello([], 1.0, "other"))
    reg.update_service(_hello([], 2.0, "other"))
    got = {reg.admit(Join(f"dev{i}", "tok", 256))[0].name for i in range(4)}
    assert got == {"svc", "other"}
    clock.t += 6
    reg.update_service(_hello([], 5.0, "other"))
    assert {v.service for v in reg.sessions.values()} == {"svc"}


def test_held_travels_on_the_wire():
    h = _hello(["0123456789abcdef", "fedcba9876543210"], 1733450000.25)
    back = decode(encode(h))
    assert back.held == h.held and back.stamp == h.stamp
    assert decode(encode(_hello(None, 1.0))).held is None
