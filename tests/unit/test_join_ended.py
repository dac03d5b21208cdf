"""A join names the sessions its client ended (Join.ended, #44): the hub releases those of that client
before it counts them (server/join_ended.py), never another client's; the client names each until a
join that named it is answered, the newest MAX_ENDED at most, each only to the hub that assigned it
(edge/star/ended_sessions.py)."""
from __future__ import annotations

import pytest

from edge.star.ended_sessions import EndedSessions
from edge.wire.protocol import MAX_ENDED, DraftHello, Join, ProtocolError, decode, encode
from server.join_ended import release_ended
from server.liveness import Liveness
from server.registry import Refusal, Registry

TOK = "tok:abc"


class LocalService:
    def __init__(self):
        self.released = []

    def release(self, sid, reason="released"):
        self.released.append((sid, reason))


def _registry(svc) -> Registry:
    reg = Registry(liveness=Liveness())
    reg.update_service(DraftHello("svc0", TOK, 256, max_sessions=8), local=svc)
    return reg


def _full(reg: Registry, client: str) -> list:
    """Join until the client's share (4 of 8) is taken: its sids."""
    return [reg.admit(Join(client, TOK, 256))[1] for _ in range(4)]


def test_a_join_that_names_its_ended_sessions_is_admitted_at_the_limit():
    svc = LocalService()
    reg = _registry(svc)
    mine = _full(reg, "dev0")
    with pytest.raises(Refusal, match="already holds 4"):
        reg.admit(Join("dev0", TOK, 256))
    join = Join("dev0", TOK, 256, ended=mine[:2] + ["unknown"])
    assert release_ended(reg, join, link=None) == 2
    assert svc.released == [(mine[0], "bye"), (mine[1], "bye")]     # the service closes them too
    reg.admit(join)
    assert reg.count() == 3 and reg.snapshot()["ended_by_join"] == 2


def test_another_clients_sessions_are_not_released():
    svc = LocalService()
    reg = _registry(svc)
    victim = _full(reg, "victim")
    assert release_ended(reg, Join("dev0", TOK, 256, ended=victim), link=None) == 0
    assert reg.count() == 4 and not svc.released


def test_a_remote_service_is_told_on_its_ctl_topic():
    sent = []

    class Link:
        def publish(self, topic, payload, kind="control"):
            sent.append((topic, decode(payload)))

    reg = Registry(liveness=Liveness())
    reg.update_service(DraftHello("d1", TOK, 256, max_sessions=8))
    reg.liveness.heard("d1", True, local=True)          # as if it had answered a probe
    sid = reg.admit(Join("dev0", TOK, 256))[1]
    assert release_ended(reg, Join("dev0", TOK, 256, ended=[sid]), Link()) == 1
    (topic, msg), = sent
    assert topic == "ss/d/d1/ctl" and (msg.service, msg.sid, msg.reason) == ("d1", sid, "bye")


def test_the_client_names_each_ended_session_until_a_join_naming_it_is_answered():
    ended = EndedSessions(limit=3)
    ended.ended("x", home="hub2")
    for sid in ("a", "b", "c", "d"):
        ended.ended(sid)
    assert ended.for_join() == ["b", "c", "d"] and ended.for_join("hub2") == []    # the newest 3 in all
    ended.ended("x", home="hub2")
    assert ended.for_join() == ["c", "d"] and ended.for_join("hub2") == ["x"]
    ended.answered(["b", "c"])
    ended.ended("e")
    assert ended.for_join() == ["d", "e"]


def test_the_wire_carries_at_most_max_ended():
    many = [f"s{i}" for i in range(MAX_ENDED)]
    assert decode(encode(Join("dev0", TOK, 256, ended=many))).ended == many
    assert decode(encode(Join("dev0", TOK, 256))).ended == []
    with pytest.raises(ProtocolError, match="at most 64"):
        encode(Join("dev0", TOK, 256, ended=many + ["one-more"]))
