"""The Link interface over the in-memory bus, a real Mosquitto and the embedded broker."""
from __future__ import annotations

import threading
import time

import pytest

from edge.wire.link import KINDS, LinkError, MqttLink, parse_url
from edge.wire.memory_link import MemoryLink
from server.broker import EmbeddedBroker, MosquittoBroker, find_free_port


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(params=["memory", "mosquitto", "embedded"])
def make_link(request, memory_bus):
    """make_link(client_id) -> a connected link on the chosen transport."""
    links = []
    if request.param == "memory":
        factory = lambda cid=None: MemoryLink(memory_bus, cid)          # noqa: E731
    else:
        fixture = "mosquitto" if request.param == "mosquitto" else "embedded_broker"
        url = request.getfixturevalue(fixture).url
        factory = lambda cid=None: MqttLink(url, cid)                   # noqa: E731

    def make(cid=None, will=None):
        link = factory(cid)
        if will:
            link.set_will(*will)
        links.append(link.connect(timeout=5))
        return link
    yield make
    for link in links:
        link.close()


def test_pub_sub_round_trip(make_link, inbox):
    # one filter per link: MQTT 3.1.1 lets a broker send one copy per matching
    # subscription of a client (amqtt does), so links should not overlap filters
    pub, exact, plus, hash_ = make_link(), make_link(), make_link(), make_link()
    got_exact, got_plus, got_hash = inbox(), inbox(), inbox()
    assert exact.subscribe("t/x/1/up", got_exact)
    assert plus.subscribe("t/+/1/up", got_plus)
    assert hash_.subscribe("t/#", got_hash)
    payload = bytes(range(256)) * 4                     # 1 KB of binary, incl. zeros
    for kind in KINDS:
        assert pub.publish("t/x/1/up", payload, kind)
    pub.publish("t/y/2/down", b"other", "draft")
    pub.publish("t/x/1/up", b"canary", "control")       # after them all: a duplicate would come first
    assert got_exact.wait_for(4) and got_plus.wait_for(4) and got_hash.wait_for(5)
    assert got_exact.payloads()[-1] == got_plus.payloads()[-1] == b"canary"
    assert got_exact.payloads() == [payload] * 3 + [b"canary"] and got_plus.payloads() == [payload] * 3 + [b"canary"]
    assert sorted(got_hash.payloads()) == sorted([payload] * 3 + [b"other", b"canary"])
    pub.publish("t/x/1/up", b"", "status")              # clear the retained message


def test_unsubscribe_and_retained(make_link, inbox):
    a, b = make_link(), make_link()
    first = inbox()
    a.subscribe("r/topic", first)
    b.publish("r/topic", b"v1", "status")               # retained
    assert first.wait_for(1)
    a.unsubscribe("r/topic")
    canary = inbox()
    assert a.subscribe("rc/a", canary)                  # its SUBACK: the UNSUBSCRIBE before it is done
    watch, seen = make_link(), inbox()
    watch.subscribe("r/topic", seen)
    b.publish("r/topic", b"v2", "status")
    assert seen.wait_for(2)
    # amqtt stores the retained copy after delivering it: a probe subscribes until it reads v2
    assert _retained(make_link(), "r/topic", inbox) == b"v2"
    late = inbox()
    c = make_link()
    c.subscribe("r/+", late)                            # a late subscriber gets the retained value
    assert late.wait_for(1) and late.payloads() == [b"v2"]
    b.publish("rc/a", b"after v2", "control")           # b's v2 went out before: `a` would have had it
    assert canary.wait_for(1)
    assert first.payloads() == [b"v1"]
    b.publish("r/topic", b"", "status")


def _retained(probe, topic, inbox, want=b"v2", timeout=10.0) -> bytes:
    """The retained value a fresh SUBSCRIBE gets, once it is `want` (subscribing again until then)."""
    end = time.monotonic() + timeout
    while True:
        box = inbox()
        assert probe.subscribe(topic, box) and box.wait_for(1), f"nothing retained on {topic}"
        probe.unsubscribe(topic)
        if box.payloads()[0] == want or time.monotonic() > end:
            return box.payloads()[0]


def test_will_on_crash(make_link, inbox):
    watcher = make_link()
    got = inbox()
    watcher.subscribe("w/status", got)
    dying = make_link(will=("w/status", b"offline", False))
    dying.crash()
    assert got.wait_for(1) and got.payloads() == [b"offline"]
    clean = make_link(will=("w/status", b"offline-2", False))
    clean.close()                                       # a clean close sends no will
    # canary: a will that is due, of a link that connected after `clean` had left
    make_link(will=("w/status", b"offline-3", False)).crash()
    assert got.wait_for(2) and got.payloads() == [b"offline", b"offline-3"]


def test_callback_errors_do_not_kill_delivery(make_link, inbox):
    a, b = make_link(), make_link()
    got = inbox()

    def bad(topic, payload):
        raise RuntimeError("boom")
    a.subscribe("e/bad", bad)
    a.subscribe("e/good", got)
    b.publish("e/bad", b"1")
    b.publish("e/good", b"2")
    assert got.wait_for(1)
    assert a.stats["callback_errors"] == 1


def test_subscribe_inside_a_callback(make_link, inbox):
    a, b = make_link(), make_link()
    got, called = inbox(), threading.Event()

    def first(topic, payload):
        a.subscribe("c/second", got)                    # cannot wait for its SUBACK on this thread
        called.set()
    a.subscribe("c/first", first)
    b.publish("c/first", b"x")
    assert called.wait(5)
    assert a.wait_subscribed(5) == {"c/first": True, "c/second": True}
    b.publish("c/second", b"y")
    assert got.wait_for(1)


def test_memory_bus_outage_resubscribes(memory_bus, inbox):
    a, b = MemoryLink(memory_bus).connect(), MemoryLink(memory_bus).connect()
    got, states = inbox(), []
    a.on_connection(states.append)
    a.subscribe("o/x", got)
    memory_bus.go_down()
    assert not a.is_connected() and not b.publish("o/x", b"lost")
    memory_bus.come_up()
    assert b.publish("o/x", b"after")
    assert got.wait_for(1) and got.payloads() == [b"after"]
    assert states == [False, True]
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
def test_reconnect_after_broker_restart(kind, inbox):
    port = find_free_port()
    broker = (MosquittoBroker if kind == "mosquitto" else EmbeddedBroker)(port=port).start()
    a = b = None
    try:
        a, b = MqttLink(broker.url).connect(5), MqttLink(broker.url).connect(5)
        got, states = inbox(), []
        a.on_connection(states.append)
        a.subscribe("rs/x", got)
        b.publish("rs/x", b"before")
        assert got.wait_for(1)
        broker.stop()
        assert _wait(lambda: not a.is_connected() and not b.is_connected(), 10)
        broker.start()
        assert _wait(lambda: b.is_connected(), 15), "links did not reconnect"
        assert a.wait_subscribed(15) == {"rs/x": True}, "the re-subscription was not acknowledged"
        b.publish("rs/x", b"after")
        assert got.wait_for(2), "subscription was not restored after the restart"
        assert got.payloads() == [b"before", b"after"]
        assert states[:2] == [False, True]
    finally:
        for link in (a, b):
            if link:
                link.close()
        broker.stop()
        if hasattr(broker, "close"):
            broker.close()


def test_connect_errors_are_clear():
    with pytest.raises(LinkError, match="no MQTT broker answered"):
        MqttLink(f"mqtt://127.0.0.1:{find_free_port()}").connect(timeout=0.5)
    with pytest.raises(LinkError, match="mqtt://host:port"):
        MqttLink("http://example.org")
    with pytest.raises(LinkError, match="bad topic"):
        MqttLink("mqtt://127.0.0.1:1").publish("a/+/b", b"")
    assert parse_url("mqtt://dev-1:p%40ss@10.0.0.2:1884") == ("10.0.0.2", 1884, "dev-1", "p@ss")
    assert parse_url("mqtt://localhost")[:2] == ("localhost", 1883)


def test_wait_subscribed_reports_and_times_out_clearly(mosquitto, inbox):
    a = MqttLink(mosquitto.url).connect(5)
    try:
        assert a.wait_subscribed(5) == {}
        assert a.subscribe("ws/x", inbox()) and a.subscribe("ws/+/y", inbox())
        assert a.wait_subscribed(5) == {"ws/x": True, "ws/+/y": True}
    finally:
        a.close()
    with pytest.raises(LinkError, match=r"not connected\) did not acknowledge \['ws/z'\] within 0.2 s"):
        never = MqttLink(f"mqtt://127.0.0.1:{find_free_port()}")
        never.subscribe("ws/z", inbox())
        never.wait_subscribed(0.2)
