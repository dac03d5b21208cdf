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


def test_failover_to_the_next_broker_resubscribes(inbox, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="edge.wire.link")
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
        assert a.wait_subscribed(10) == {"fo/x": True}, "the subscription was not restored on the second broker"
        b = MqttLink(second.url).connect(5)
        links.append(b)
        b.publish("fo/x", b"after")
        assert got.wait_for(1) and got.payloads() == [b"after"]
        moved = [r.getMessage() for r in caplog.records if "moved to broker" in r.getMessage()]
        assert len(moved) == 1 and f"moved to broker {second.url} (2 of 2 in its list)" in moved[0], moved
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


def test_a_broker_that_closes_a_stable_connection_is_tried_again_first():
    """A live broker that drops us (RabbitMQ does so on healthy nodes when another node goes) is
    tried once more before the list moves on; a killed one refuses that try and is left."""
    import paho.mqtt.client as mqtt

    from edge.wire.link import STABLE_S
    first, second = MosquittoBroker().start(), MosquittoBroker().start()
    intruder = None
    try:
        a = MqttLink(f"{first.url},{second.url}").connect(5)
        states = []
        a.on_connection(states.append)
        time.sleep(STABLE_S + 0.3)
        intruder = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=a.client_id,
                               protocol=mqtt.MQTTv311)
        intruder.connect(first.host, first.port)        # same client id: the broker drops `a`
        intruder.loop(1.0)
        assert _wait(lambda: states[:2] == [False, True], 10), f"no reconnect: {states}"
        assert (a.host, a.port) == (first.host, first.port) and a.brokers.failovers == 0, \
            "a live broker that closed the connection was left for the next one"
        time.sleep(STABLE_S + 0.3)
        first.proc.kill()                                  # kill -9: the retry is refused, then on
        assert _wait(lambda: states[2:4] == [False, True], 15), f"no failover: {states}"
        assert (a.host, a.port) == (second.host, second.port) and a.brokers.failovers == 1
        a.close()
    finally:
        if intruder is not None:
            intruder.socket() and intruder.socket().close()
        first.close()
        second.close()
