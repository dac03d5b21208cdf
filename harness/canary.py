"""Proving that a message did NOT arrive, with a message that DID: a canary sent after it.

"Nothing arrived within 0.4 s" passes on a slow machine without proving anything. Instead,
after the publishes that must not reach a link, `canary_after` sends a canary down a path that
must reach it, ordered after them:

  1. each sender (the clients that published the forbidden messages) publishes a canary on its
     own telemetry topic (every role may write ss/dev/{me}/telemetry; a hub reads it). MQTT keeps
     one client's messages in order, so the broker has routed (or refused) the forbidden ones
     before it routes this -- also when Mosquitto dropped the sender for a publish past its ACL:
     paho sends the QoS 1 canary again on the new connection, which comes later;
  2. once a hub-role link got every sender's canary, it publishes one on ss/hubs/canary-{tag},
     which every role may read;
  3. each observer receives it. A forbidden message that the broker let through was queued to
     the observer before step 1 ended, so it would have arrived before this canary.

The caller then asserts that the forbidden messages are absent (`is_canary` tells the canary's
copies apart, for a spy filter such as "#" that also matches the canary topic).
"""
from __future__ import annotations

import uuid
from typing import Iterable

from edge.wire.link import Link
from edge.wire.protocol import TELEMETRY_SUB, hub_hello_topic, telemetry_topic
from harness.waiting import wait_until

PREFIX = "canary-"


def is_canary(topic: str) -> bool:
    return topic.startswith(hub_hello_topic(PREFIX))


def canary_after(hub: Link, senders: Iterable[Link], observers: Iterable[Link], inbox,
                 timeout: float = 15.0) -> None:
    """Return once every observer received a canary ordered after every sender's earlier
    publishes (see the module doc); AssertionError naming what did not arrive.

    hub: a link with the hub role (it may read every telemetry topic and write ss/hubs/+).
    senders: links whose username names their telemetry topic, or (link, name) where it does not
    (a TLS link: its certificate's CN). inbox: the tests' Inbox class."""
    senders = [s if isinstance(s, tuple) else (s, s.username) for s in senders]
    observers = list(observers)
    tag = PREFIX + uuid.uuid4().hex[:10]
    want = {f"{tag}-{i}".encode() for i in range(len(senders))}
    got = inbox()
    assert hub.subscribe(TELEMETRY_SUB, lambda t, p: p in want and got(t, p)), "the hub may read telemetry"
    try:
        for i, (link, name) in enumerate(senders):
            link.publish(telemetry_topic(name), f"{tag}-{i}".encode(), "control")   # QoS 1: sent again after a drop
        assert wait_until(lambda: set(got.payloads()) >= want, timeout), \
            f"the hub got canaries {sorted(set(got.payloads()))} of {sorted(want)}"
    finally:
        hub.unsubscribe(TELEMETRY_SUB)
    topic = hub_hello_topic(tag)
    boxes = [inbox() for _ in observers]
    for link, box in zip(observers, boxes):
        link.subscribe(topic, box)
        # (a link Mosquitto dropped for a forbidden publish may be reconnecting: wait for its SUBACKs)
        assert link.wait_subscribed(timeout).get(topic), f"{link.client_id} may read {topic}"
    try:
        hub.publish(topic, b"canary", "control")
        missing = [link.client_id for link, box in zip(observers, boxes) if not box.wait_for(1, timeout)]
        assert not missing, f"the canary never reached {missing}: the path it proves nothing about is broken"
    finally:
        for link in observers:
            link.unsubscribe(topic)
