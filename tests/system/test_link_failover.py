"""A link given several brokers: the first is killed (kill -9), the link moves to the next,
re-subscribes and tells its listeners; a first broker that is down at start is skipped."""
from __future__ import annotations

import time

from edge.wire.link import MqttLink
from server.broker import MosquittoBroker, find_free_port


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_failover_to_the_next_broker_resubscribes(inbox):
    first, second = MosquittoBroker().start(), MosquittoBroker().start()
    links = []
    try:
        a = MqttLink(f"{first.url},{second.url}").connect(5)
        links.append(a)
        assert (a.host, a.port) == (first.host, first.port)
        got, states = inbox(), []
        a.on_connection(states.append)
        a.subscribe("fo/x", got)
        first.proc.kill()                                  # kill -9: no goodbye from the broker
        assert _wait(lambda: states[:2] == [False, True], 15), f"no failover: {states}"
        assert (a.host, a.port) == (second.host, second.port) and a.brokers.failovers >= 1
        b = MqttLink(second.url).connect(5)
        links.append(b)
        assert _wait(lambda: (b.publish("fo/x", b"after"), got.wait_for(1, timeout=0.3))[1], 5), \
            "the subscription was not restored on the second broker"
        assert set(got.payloads()) == {b"after"}
    finally:
        for link in links:
            link.close()
        first.close()
        second.close()


def test_a_dead_first_broker_is_skipped_at_start():
    live = MosquittoBroker().start()
    try:
        link = MqttLink(f"mqtt://127.0.0.1:{find_free_port()},{live.url}").connect(10)
        assert link.port == live.port
        link.close()
    finally:
        live.close()
