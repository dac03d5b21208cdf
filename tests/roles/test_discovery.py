"""Discovery by request and answer (issue 38): a Discover on ss/discover makes every live node
publish a fresh hello, so a hub needs no retained hello to find its star (a RabbitMQ cluster
keeps retained messages per node and gives none through wildcards)."""

import torch

from edge.star.draft_node import DraftNode
from edge.star.draft_service import DraftLimits, DraftService
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import DISCOVER_TOPIC, DRAFTS_SUB, Discover, DraftHello, decode, encode
from harness.draft_services import make_engine
from harness.waiting import wait_until
from server.discovery import Discovery

torch.set_num_threads(1)
KEY = b"c" * 32


def _node(link, name, key=KEY):
    svc = DraftService(make_engine(), DraftLimits(ahead=False), name=name)
    return DraftNode(svc, link, name, "tok", ctl_key=key, hello_every=3600.0)   # no periodic hello here


def test_every_node_answers_a_discover_with_a_fresh_hello():
    bus = MemoryBus()
    hub, shared = MemoryLink(bus).connect(), MemoryLink(bus).connect()
    nodes = [_node(shared, "d1").start(), _node(shared, "d2").start(), _node(MemoryLink(bus).connect(), "d3").start()]
    heard = []
    hub.subscribe(DRAFTS_SUB, lambda t, p: heard.append(decode(p, KEY)))
    try:
        wait_until(lambda: {h.service for h in heard} == {"d1", "d2", "d3"}, 5)   # retained, on the memory bus
        heard.clear()
        asker = Discovery(hub, "hub", KEY, every=3600.0).start()          # asks once at start
        wait_until(lambda: {h.service for h in heard} == {"d1", "d2", "d3"}, 5)
        assert all(isinstance(h, DraftHello) and h.online for h in heard)
        assert asker.sent == 1                                            # two nodes on one link both answered
        asker.stop()
    finally:
        for n in nodes:
            n.stop(announce=False)


def test_a_discover_signed_with_another_key_is_dropped():
    bus = MemoryBus()
    hub, link = MemoryLink(bus).connect(), MemoryLink(bus).connect()
    node = _node(link, "d1").start()
    heard = []
    hub.subscribe(DRAFTS_SUB, lambda t, p: heard.append(t))
    try:
        wait_until(lambda: heard, 5)
        heard.clear()
        hub.publish(DISCOVER_TOPIC, encode(Discover("intruder"), b"x" * 32))
        wait_until(lambda: node.dropped.get("ctl_auth"), 5)
        assert heard == []
    finally:
        node.stop(announce=False)
