"""The broker itself keeps clients out of each other's sessions (Mosquitto ACL,
and the same table in the embedded broker)."""
from __future__ import annotations

import time

import pytest

from edge import protocol as P
from edge.link import LinkError, MqttLink
from server.broker import Acl, EmbeddedBroker

QUIET = 0.4     # how long "nothing arrives" is watched; deliveries here take ~1 ms


@pytest.fixture(scope="module")
def embedded_acl():
    broker = EmbeddedBroker(acl=True).start()
    yield broker
    broker.stop()


@pytest.fixture(params=["mosquitto", "embedded"])
def star(request):
    """(broker, connect(user) -> link) with a hub and clients alice, bob, and a draft service."""
    broker = request.getfixturevalue("mosquitto_acl" if request.param == "mosquitto" else "embedded_acl")
    links = []

    def connect(user: str, role: str = "client") -> MqttLink:
        if user not in broker.acl.users:
            broker.add_user(user, role)
        link = MqttLink(broker.url, username=user, password=broker.password(user)).connect(5)
        links.append(link)
        return link
    yield broker, connect
    for link in links:
        link.close()


def _subscribe(link, pattern, box) -> None:
    # a refused filter (SUBACK failure) and a granted one that never delivers are both fine
    link.subscribe(pattern, box)


def test_clients_cannot_read_other_sessions(star, inbox):
    broker, connect = star
    hub, alice, bob = connect(broker.hub_user), connect("alice"), connect("bob")
    bob_down, spy_exact, spy_wild, spy_all = inbox(), inbox(), inbox(), inbox()
    assert bob.subscribe(P.down_topic("bob", "s1"), bob_down)
    _subscribe(alice, P.down_topic("bob", "s1"), spy_exact)
    _subscribe(connect("alice-2"), "ss/s/#", spy_wild)
    _subscribe(connect("alice-3"), "#", spy_all)
    time.sleep(0.1)
    hub.publish(P.down_topic("bob", "s1"), b"for bob only", "draft")
    hub.publish(P.joined_topic("bob"), b"bob's secret", "control")
    assert bob_down.wait_for(1), "the legitimate path must work, or the test proves nothing"
    time.sleep(QUIET)
    assert spy_exact.items == [] and spy_wild.items == [] and spy_all.items == []


def test_clients_cannot_write_into_other_sessions(star, inbox):
    # Mosquitto 2 disconnects a 3.1.1 client that publishes where it may not (the
    # link reconnects by itself), so the allowed publishes go first.
    broker, connect = star
    hub, alice, bob = connect(broker.hub_user), connect("alice"), connect("bob")
    hub_up, hub_join, bob_down, status = inbox(), inbox(), inbox(), inbox()
    assert hub.subscribe(P.SESSION_UP_SUB, hub_up)
    assert hub.subscribe(P.JOIN_SUB, hub_join)
    assert bob.subscribe(P.down_topic("bob", "s1"), bob_down)
    assert hub.subscribe(P.STATUS_TOPIC, status)
    alice.publish(P.up_topic("alice", "s9"), b"mine", "draft")       # her own session: allowed
    alice.publish(P.join_topic("alice"), b"join as alice", "control")
    assert hub_up.wait_for(1) and hub_join.wait_for(1)
    for topic, kind in ((P.up_topic("bob", "s1"), "draft"), (P.down_topic("bob", "s1"), "draft"),
                        (P.join_topic("bob"), "control"), (P.STATUS_TOPIC, "status")):
        forger = connect("alice")
        forger.publish(topic, b"forged", kind)
    time.sleep(QUIET)
    assert hub_up.items == [(P.up_topic("alice", "s9"), b"mine")]
    assert hub_join.items == [(P.join_topic("alice"), b"join as alice")]
    assert bob_down.items == [] and status.items == []


def test_status_is_readable_not_writable(star, inbox):
    broker, connect = star
    hub, alice = connect(broker.hub_user), connect("alice")
    got = inbox()
    alice.subscribe(P.STATUS_TOPIC, got)
    hub.publish(P.STATUS_TOPIC, b"online", "status")
    assert got.wait_for(1) and got.payloads() == [b"online"]
    alice.publish(P.STATUS_TOPIC, b"forged", "status")
    time.sleep(QUIET)
    assert b"forged" not in got.payloads()             # a reconnect may replay the retained b"online"
    hub.publish(P.STATUS_TOPIC, b"", "status")


def test_draft_service_serves_sessions_but_not_other_services(star, inbox):
    broker, connect = star
    hub, svc, bob = connect(broker.hub_user), connect("jetson-1", "draft"), connect("bob")
    ups, ctl, other_ctl, hello = inbox(), inbox(), inbox(), inbox()
    assert svc.subscribe(P.SESSION_UP_SUB, ups)
    assert svc.subscribe(P.draft_ctl_topic("jetson-1"), ctl)
    _subscribe(svc, P.draft_ctl_topic("jetson-2"), other_ctl)
    hub.subscribe(P.DRAFTS_SUB, hello)
    time.sleep(0.1)
    bob.publish(P.up_topic("bob", "s1"), b"req", "draft")
    hub.publish(P.draft_ctl_topic("jetson-1"), b"assign", "control")
    hub.publish(P.draft_ctl_topic("jetson-2"), b"assign elsewhere", "control")
    svc.publish(P.draft_hello_topic("jetson-1"), b"hello", "control")
    assert ups.wait_for(1) and ctl.wait_for(1) and hello.wait_for(1)
    connect("jetson-1").publish(P.draft_hello_topic("jetson-2"), b"impostor", "control")
    time.sleep(QUIET)
    assert other_ctl.items == [] and hello.payloads() == [b"hello"]


def test_bad_credentials_are_refused(star):
    broker, connect = star
    connect("alice")
    with pytest.raises(LinkError, match="refused|no MQTT broker"):
        MqttLink(broker.url, username="alice", password="wrong").connect(2)
    with pytest.raises(LinkError, match="refused|no MQTT broker"):
        MqttLink(broker.url).connect(2)                               # anonymous


def test_acl_table_and_file():
    acl = Acl()
    acl.add("hub", "hub")
    acl.add("svc", "draft")
    acl.add("bob")
    assert acl.allows("bob", "ss/s/bob/s1/up", "write")
    assert not acl.allows("bob", "ss/s/bob/s1/up", "read")
    assert acl.allows("bob", "ss/s/bob/+/down", "subscribe")
    assert not acl.allows("bob", "ss/s/+/+/down", "subscribe")
    assert not acl.allows("bob", "ss/s/bob/#", "subscribe")
    assert acl.allows("svc", "ss/s/+/+/up", "subscribe")
    assert acl.allows("hub", "#", "subscribe") and not acl.allows("nobody", "ss/hub/status", "read")
    text = acl.mosquitto_acl()
    assert "pattern write ss/s/%u/+/up" in text and "user hub\ntopic readwrite #" in text
    assert "user svc\ntopic readwrite ss/s/#" in text and "user bob" not in text


def test_broker_errors_are_clear(monkeypatch, mosquitto):
    import server.broker as B
    for cls in (B.MosquittoBroker, B.EmbeddedBroker):
        with pytest.raises(B.BrokerError, match="cannot listen"):
            cls(port=mosquitto.port).start(timeout=3)         # the port is taken
    monkeypatch.setattr(B.shutil, "which", lambda name: None)
    monkeypatch.setattr(B.os, "access", lambda path, mode: False)
    with pytest.raises(B.BrokerError, match="apt-get install mosquitto"):
        B.MosquittoBroker()
