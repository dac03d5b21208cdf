"""The broker itself keeps clients out of each other's sessions (Mosquitto ACL,
and the same table in the embedded broker)."""
from __future__ import annotations

import threading

import pytest

from edge.wire import protocol as P
from edge.wire.link import LinkError, MqttLink
from harness.canary import canary_after, is_canary
from server.acl import Acl
from server.broker import EmbeddedBroker

# "Nothing arrived" is proven by a canary that did (harness/canary.py): sent after the forbidden
# publishes, down a path the observers may read, it arrives only after anything let through would have.


@pytest.fixture(scope="module")
def mosquitto_acl():
    """A Mosquitto of this module's own: other modules' hubs leave retained (offline) hellos and
    statuses on the shared one, and these tests count every message a topic delivers."""
    from server.broker import MosquittoBroker
    broker = MosquittoBroker(acl=True).start()
    yield broker
    broker.close()


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


def _subscribe(link, pattern, box) -> MqttLink:
    # a refused filter (SUBACK failure: amqtt) and a granted one that never delivers (Mosquitto)
    # are both fine; either way subscribe() returned after the broker's answer
    link.subscribe(pattern, box)
    return link


def test_clients_cannot_read_other_sessions(star, inbox):
    broker, connect = star
    hub, alice, bob = connect(broker.hub_user), connect("alice"), connect("bob")
    bob_down, spy_exact, spy_wild, spy_all = inbox(), inbox(), inbox(), inbox()
    assert bob.subscribe(P.down_topic("bob", "s1", "hub"), bob_down)
    spies = [_subscribe(alice, P.down_topic("bob", "s1", "hub"), spy_exact),
             _subscribe(connect("alice-2"), "ss/s/#", spy_wild), _subscribe(connect("alice-3"), "#", spy_all)]
    # amqtt refuses a filter past the ACL (a SUBACK failure); Mosquitto grants it, filters each delivery
    assert alice.wait_subscribed() == {P.down_topic("bob", "s1", "hub"): not isinstance(broker, EmbeddedBroker)}
    hub.publish(P.down_topic("bob", "s1", "hub"), b"for bob only", "draft")
    hub.publish(P.joined_topic("bob"), b"bob's secret", "control")
    assert bob_down.wait_for(1), "the legitimate path must work, or the test proves nothing"
    canary_after(hub, [hub], spies, inbox)
    # the hub's retained status is public (an earlier test's hub may have left one on a shared broker)
    leaked = [t for t, _ in spy_all.items if t != P.STATUS_TOPIC and not is_canary(t)]
    assert spy_exact.items == [] and spy_wild.items == [] and leaked == []


def test_clients_cannot_write_into_other_sessions(star, inbox):
    # Mosquitto 2 disconnects a 3.1.1 client that publishes where it may not (the
    # link reconnects by itself), so the allowed publishes go first.
    broker, connect = star
    hub, alice, bob = connect(broker.hub_user), connect("alice"), connect("bob")
    hub_up, hub_join, bob_down, status = inbox(), inbox(), inbox(), inbox()
    assert hub.subscribe(P.session_up_sub("hub"), hub_up)
    assert hub.subscribe(P.JOIN_SUB, hub_join)
    assert bob.subscribe(P.down_topic("bob", "s1", "hub"), bob_down)
    assert hub.subscribe(P.STATUS_TOPIC, status)
    alice.publish(P.up_topic("alice", "s9", "hub"), b"mine", "draft")       # her own session: allowed
    alice.publish(P.join_topic("alice"), b"join as alice", "control")
    assert hub_up.wait_for(1) and hub_join.wait_for(1)
    forgers = []
    for topic, kind in ((P.up_topic("bob", "s1", "hub"), "draft"), (P.down_topic("bob", "s1", "hub"), "draft"),
                        (P.join_topic("bob"), "control"), (P.STATUS_TOPIC, "status")):
        forgers.append(connect("alice"))
        forgers[-1].publish(topic, b"forged", kind)
    canary_after(hub, forgers, [hub, bob], inbox)
    assert hub_up.items == [(P.up_topic("alice", "s9", "hub"), b"mine")]
    assert hub_join.items == [(P.join_topic("alice"), b"join as alice")]
    assert bob_down.items == [] and status.items == []


def test_status_is_readable_not_writable(star, inbox):
    broker, connect = star
    hub, alice = connect(broker.hub_user), connect("alice")
    got, hub_got, late = inbox(), inbox(), inbox()
    alice.subscribe(P.STATUS_TOPIC, got)
    assert hub.subscribe(P.STATUS_TOPIC, hub_got)
    hub.publish(P.STATUS_TOPIC, b"online", "status")
    assert got.wait_for(1) and got.payloads() == [b"online"]
    alice.publish(P.STATUS_TOPIC, b"forged", "status")
    canary_after(hub, [alice], [alice, hub], inbox)
    assert b"forged" not in got.payloads()             # a reconnect may replay the retained b"online"
    assert b"forged" not in hub_got.payloads()
    assert connect("bob").subscribe(P.STATUS_TOPIC, late) and late.wait_for(1)
    assert late.payloads() == [b"online"]               # the broker kept the hub's retained value
    hub.publish(P.STATUS_TOPIC, b"", "status")


def test_draft_service_serves_its_sessions_but_not_other_services(star, inbox):
    broker, connect = star
    hub, svc, bob = connect(broker.hub_user), connect("jetson-1", "draft"), connect("bob")
    connect("jetson-2", "draft")
    ups, ctl, other_ctl, hello, other_ups, bob_down = inbox(), inbox(), inbox(), inbox(), inbox(), inbox()
    assert svc.subscribe(P.session_up_sub("jetson-1"), ups)
    assert svc.subscribe(P.draft_ctl_topic("jetson-1"), ctl)
    assert bob.subscribe("ss/s/bob/+/+/down", bob_down)              # as a target does (edge/star/hub_client.py)
    _subscribe(svc, P.draft_ctl_topic("jetson-2"), other_ctl)
    others = [_subscribe(connect("jetson-1", "draft"), P.session_up_sub("jetson-2"), other_ups),
              _subscribe(connect("jetson-1", "draft"), "ss/s/#", other_ups)]
    assert hub.subscribe(P.DRAFTS_SUB, hello)
    bob.publish(P.up_topic("bob", "s1", "jetson-1"), b"req", "draft")
    bob.publish(P.up_topic("bob", "s2", "jetson-2"), b"for jetson-2 only", "draft")
    svc.publish(P.down_topic("bob", "s1", "jetson-1"), b"drafts", "draft")
    hub.publish(P.draft_ctl_topic("jetson-1"), b"assign", "control")
    hub.publish(P.draft_ctl_topic("jetson-2"), b"assign elsewhere", "control")
    svc.publish(P.draft_hello_topic("jetson-1"), b"hello", "control")
    assert ups.wait_for(1) and ctl.wait_for(1) and hello.wait_for(1) and bob_down.wait_for(1)
    forgers = [connect("jetson-1"), connect("jetson-1", "draft")]
    forgers[0].publish(P.draft_hello_topic("jetson-2"), b"impostor", "control")
    forgers[1].publish(P.down_topic("bob", "s2", "jetson-2"), b"forged", "draft")
    canary_after(hub, [hub, bob, *forgers], [svc, hub, bob, *others], inbox)
    assert other_ctl.items == [] and hello.payloads() == [b"hello"]
    assert ups.payloads() == [b"req"]                               # jetson-2's session stays unseen,
    assert b"for jetson-2 only" not in other_ups.payloads()          # even through a wildcard
    assert bob_down.payloads() == [b"drafts"]


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
    assert acl.allows("bob", "ss/s/bob/s1/svc/up", "write")
    assert not acl.allows("bob", "ss/s/bob/s1/svc/up", "read")
    assert acl.allows("bob", "ss/s/bob/+/+/down", "subscribe")
    assert not acl.allows("bob", "ss/s/+/+/+/down", "subscribe")
    assert not acl.allows("bob", "ss/s/bob/#", "subscribe")
    assert acl.allows("svc", "ss/s/+/+/svc/up", "subscribe") and acl.allows("svc", "ss/s/bob/s1/svc/down", "write")
    assert not acl.allows("svc", "ss/s/+/+/+/up", "subscribe") and not acl.allows("svc", "ss/s/bob/s1/j2/up", "read")
    assert not acl.allows("svc", "ss/s/bob/s1/svc/up", "write")    # no writing as the target
    assert acl.allows("hub", "#", "subscribe") and not acl.allows("nobody", "ss/hub/status", "read")
    text = acl.mosquitto_acl()
    assert "pattern write ss/s/%u/+/+/up" in text and "user hub\ntopic readwrite #" in text
    assert "user svc\ntopic read ss/s/+/+/svc/up\ntopic write ss/s/+/+/svc/down" in text and "user bob" not in text
    acl.add("dec-1", "sun")
    may = acl.allows
    assert may("bob", "ss/sun/req/bob", "write") and not may("bob", "ss/sun/req/alice", "write")
    assert may("bob", "ss/sun/r/bob/+", "subscribe") and not may("bob", "ss/sun/r/+/+", "subscribe")
    assert may("dec-1", "ss/sun/w/dec-1/#", "subscribe") and may("dec-1", "ss/sun/w/dec-2/kv/dec-1", "write")
    assert not may("dec-1", "ss/sun/w/dec-2/ctl", "write") and not may("dec-1", "ss/sun/w/+/kv/+", "read")
    assert not may("dec-1", "ss/sun/w/dec-2/kv/prefill-1", "write")   # KV only under its own name
    assert may("dec-1", "ss/sun/r/bob/r1", "write") and not may("dec-1", "ss/sun/r/bob/r1", "read")
    assert not may("dec-1", "ss/s/bob/s1/dec-1/up", "read")    # a SUN worker is no draft service
    text = acl.mosquitto_acl()
    assert "pattern read ss/sun/r/%u/+" in text and "user dec-1\ntopic write ss/sun/workers/dec-1" in text


def test_broker_errors_are_clear(monkeypatch, mosquitto):
    import server.broker as B
    for cls in (B.MosquittoBroker, B.EmbeddedBroker):
        with pytest.raises(B.BrokerError, match="cannot listen"):
            cls(port=mosquitto.port).start(timeout=3)         # the port is taken
    import server.mosquitto as M
    monkeypatch.setattr(M.shutil, "which", lambda name: None)
    monkeypatch.setattr(M.os, "access", lambda path, mode: False)
    with pytest.raises(B.BrokerError, match="apt-get install mosquitto"):
        B.MosquittoBroker()


def test_clients_cannot_read_other_clients_sun_results(star, inbox):
    broker, connect = star
    hub, alice, bob = connect(broker.hub_user), connect("alice"), connect("bob")
    dec, pre = connect("dec-1", "sun"), connect("prefill-1", "sun")
    bob_r, spy_exact, spy_wild, spy_all = inbox(), inbox(), inbox(), inbox()
    reqs, hellos, dec_in, other_ctl = inbox(), inbox(), inbox(), inbox()
    assert bob.subscribe(P.sun_stream_sub("bob"), bob_r)
    spies = [_subscribe(alice, P.sun_stream_sub("bob"), spy_exact),
             _subscribe(connect("alice-2"), "ss/sun/r/+/+", spy_wild), _subscribe(connect("alice-3"), "ss/sun/#", spy_all)]
    assert hub.subscribe(P.SUN_REQ_SUB, reqs) and hub.subscribe(P.SUN_WORKERS_SUB, hellos)
    assert dec.subscribe("ss/sun/w/dec-1/#", dec_in)
    _subscribe(pre, P.sun_ctl_topic("dec-1"), other_ctl)           # a worker reads only its own jobs
    # the legitimate paths of one request: request, job, KV, tokens, hellos
    alice.publish(P.sun_req_topic("alice"), b"req", "control")
    hub.publish(P.sun_ctl_topic("dec-1"), b"assign", "control")
    pre.publish(P.sun_kv_topic("dec-1", "prefill-1"), b"kv", "control")
    pre.publish(P.sun_stream_topic("bob", "r1"), b"token 0", "control")
    dec.publish(P.sun_stream_topic("bob", "r1"), b"token 1", "control")
    pre.publish(P.sun_hello_topic("prefill-1"), b"hello", "control")
    assert reqs.wait_for(1) and bob_r.wait_for(2) and dec_in.wait_for(2) and hellos.wait_for(1)
    # forgeries, each on a fresh connection (Mosquitto drops a 3.1.1 client that publishes past its ACL)
    forgers = []
    for who, topic, payload in (("alice", P.sun_req_topic("bob"), b"as bob"),
                                ("alice", P.sun_stream_topic("bob", "r1"), b"forged token"),
                                ("prefill-1", P.sun_hello_topic("dec-1"), b"impostor"),
                                ("prefill-1", P.sun_ctl_topic("dec-1"), b"forged job"),
                                ("prefill-1", P.sun_kv_topic("dec-1", "prefill-2"), b"as prefill-2")):
        forgers.append(connect(who, "sun" if who == "prefill-1" else "client"))
        forgers[-1].publish(topic, payload, "control")
    canary_after(hub, [alice, hub, pre, dec, *forgers], [*spies, pre, hub, bob, dec], inbox)
    assert spy_exact.items == [] and spy_wild.items == [] and other_ctl.items == []
    assert [t for t, _ in spy_all.items if not is_canary(t)] == []
    assert reqs.payloads() == [b"req"] and hellos.payloads() == [b"hello"]
    assert sorted(bob_r.payloads()) == [b"token 0", b"token 1"]
    assert sorted(dec_in.payloads()) == [b"assign", b"kv"]
    hub.publish(P.sun_hello_topic("prefill-1"), b"", "status")      # clear the retained hello


def test_connects_overlapping_subscribes_all_complete(inbox):
    """amqtt 0.12.1 iterated its subscription table across awaits while a client
    connected: another client's SUBSCRIBE then raised "dictionary changed size
    during iteration" and left the newcomer half-connected (no SUBACKs, 5 s
    stalls). Retained messages make the connect path await inside that loop."""
    broker = EmbeddedBroker().start()
    links, failures = [], []
    try:
        pub = MqttLink(broker.url).connect(5)
        links.append(pub)
        pub.publish("race/status", b"retained", "status")
        got = inbox()
        assert pub.subscribe("race/status", got) and got.wait_for(1)

        def client(i: int) -> None:
            link = MqttLink(broker.url, client_id=f"race-{i}")
            links.append(link)
            try:
                link.connect(5)
                ok = [link.subscribe(f"race/{i}/{k}", lambda t, p: None) for k in range(3)]
                ok.append(link.subscribe("race/status", lambda t, p: None))
                if not all(ok):
                    failures.append((i, "a SUBSCRIBE was not acknowledged"))
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append((i, repr(e)))
        for rnd in range(3):
            threads = [threading.Thread(target=client, args=(rnd * 10 + i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert failures == []
        # a newcomer gets no retained messages for other clients' subscriptions (amqtt replayed them
        # on connect, before reading the newcomer's packets: its SUBACK below comes after them)
        quiet = MqttLink(broker.url).connect(5)
        links.append(quiet)
        canary = inbox()
        assert quiet.subscribe("race/quiet", canary)
        pub.publish("race/quiet", b"canary", "control")
        assert canary.wait_for(1) and quiet.stats["received"] == 1
    finally:
        for link in links:
            link.close()
        broker.stop()
