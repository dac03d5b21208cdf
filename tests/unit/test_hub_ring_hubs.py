"""Two hubs on one (in-memory) bus, in process: each announces itself on ss/hubs/{id}, sees the
other, answers only the joins that name it (or, naming no hub, whose client it owns), routes only
its own clients' SUN requests, and a device's join goes to the owner among the live hubs; a hub
killed (its will) moves the device's next join to the other."""
from __future__ import annotations

import pytest

from edge.star.hub_ring import owner
from edge.star.hub_client import HubClient
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import GREEDY_WIRE, Join, SunRequest, encode, join_topic, sun_req_topic
from harness.http_endpoints import tiny_engine
from harness.waiting import wait_until
from server.hub import Hub

HUBS = ("hub-a", "hub-b")
FP = "tiny-test-fp"


@pytest.fixture
def star():
    bus = MemoryBus()
    hubs = {h: Hub(link=MemoryLink(bus, h), draft_engine=tiny_engine(1), tokenizer_fp=FP, hub_id=h, hubs=HUBS,
                   status_every=0.2).start() for h in HUBS}
    yield bus, hubs
    for hub in hubs.values():
        if hub._live:
            hub.stop()


def clients_of(hub):
    return [c for c in (f"dev{i}" for i in range(200)) if owner(c, HUBS) == hub]


def test_each_hub_sees_the_other_and_answers_only_its_joins(star):
    bus, hubs = star
    assert wait_until(lambda: all(h.live_hubs() == list(HUBS) for h in hubs.values()), 5)
    assert wait_until(lambda: all(h.owns(clients_of(n)[0]) for n, h in hubs.items()), 5)   # past the settling
    a_client, b_client = clients_of("hub-a")[0], clients_of("hub-b")[0]
    assert hubs["hub-a"].owns(a_client) and not hubs["hub-b"].owns(a_client)
    probe = MemoryLink(bus, "probe").connect()
    try:
        # a join naming hub-b is hub-b's even for hub-a's client; one naming no hub, its owner's
        probe.publish(join_topic(a_client), encode(Join(a_client, FP, 256, 3, GREEDY_WIRE, nonce="n1", hub="hub-b")))
        assert wait_until(lambda: hubs["hub-b"].counters["joins"] == 1, 5)
        probe.publish(join_topic(b_client), encode(Join(b_client, FP, 256, 3, GREEDY_WIRE, nonce="n2")))
        assert wait_until(lambda: hubs["hub-b"].counters["joins"] == 2, 5)
        probe.publish(join_topic(a_client), encode(Join(a_client, FP, 256, 3, GREEDY_WIRE, nonce="n3")))
        assert wait_until(lambda: hubs["hub-a"].counters["joins"] == 1, 5)
        assert hubs["hub-a"].counters["joins"] == 1 and hubs["hub-b"].counters["joins"] == 2
        # a SUN request: only its client's owner routes it (here: refuses it, no worker, but counts it)
        probe.publish(sun_req_topic(a_client), encode(SunRequest(a_client, "r1", "maths", [1, 2])))
        assert wait_until(lambda: hubs["hub-b"].router.counters.get("left_to_its_hub") == 1, 5)
        assert hubs["hub-a"].router.counters.get("left_to_its_hub") is None
    finally:
        probe.close()


def test_a_devices_join_follows_the_owner_and_moves_when_it_dies(star):
    bus, hubs = star
    client = clients_of("hub-a")[0]
    dev = HubClient(MemoryLink(bus, client), client, FP, 256, hubs=HUBS).start()
    try:
        assert wait_until(lambda: dev.watch.owner(client) == "hub-a", 5)
        s = dev.join(3, GREEDY_WIRE)
        assert s.home == "hub-a" and hubs["hub-a"].registry.count() == 1
        hubs["hub-a"].kill()                                   # its will: offline
        assert wait_until(lambda: s.lost and dev.watch.owner(client) == "hub-b", 5)
        s.close()
        s2 = dev.join(3, GREEDY_WIRE)
        assert s2.home == "hub-b" and hubs["hub-b"].registry.count() == 1
        s2.close()
        assert wait_until(lambda: hubs["hub-b"].registry.count() == 0, 5)
    finally:
        dev.close()
