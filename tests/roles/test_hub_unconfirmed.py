"""The hub releases sessions its draft service does not hold (server/registry.py `_confirm`):
the leak the real partition test found -- a SessionAssign or a SessionRelease lost on the way
left the session in the hub's count for good. A real Hub, a remote DraftNode and a device's
HubClient on the in-process bus; the losses are played by links that drop those messages, and
the hub's registry runs on a clock the test drives (no sleeps, no timing asserts)."""
from __future__ import annotations

import torch

from edge.star.draft_node import DraftNode
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import GREEDY_WIRE, SessionAssign, SessionRelease, decode
from harness.draft_services import make_engine
from harness.waiting import wait_until
from server.hub import Hub

torch.set_num_threads(1)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Lossy(MemoryLink):
    """A link that drops the next `drop[cls]` messages of a type (a partition ate them)."""

    def __init__(self, bus, name):
        super().__init__(bus, name)
        self.drop = {}

    def publish(self, topic, payload, kind="control"):
        try:
            cls = type(decode(payload))
        except Exception:              # noqa: BLE001 -- signed with a key we do not pass: not ours to drop
            cls = None
        if self.drop.get(cls, 0) > 0:
            self.drop[cls] -= 1
            return True
        return super().publish(topic, payload, kind)


def _star():
    bus, clock = MemoryBus(), Clock()
    hub_link, node_link = Lossy(bus, "hub"), Lossy(bus, "d1")
    hub = Hub(link=hub_link, sun=False, status_every=3600.0)
    hub.registry.liveness.clock = clock
    hub.start()
    svc = DraftService(make_engine(), DraftLimits(ahead=False, evict_after_s=3600.0), name="d1")
    node = DraftNode(svc, node_link.connect(), "d1", "tiny-0", hello_every=3600.0).start()
    assert wait_until(lambda: hub.registry.online_services() == ["d1"], 10)   # probed and answered
    dev = HubClient(MemoryLink(bus, "dev1"), "dev1", "tiny-0", svc.vocab_size).start()
    assert wait_until(lambda: dev.status is not None and dev.hub_online, 10)
    return hub, node, dev, clock, hub_link, node_link


def _settle(hub, node):
    """The service says hello; wait until the hub has taken it (a newer stamp)."""
    before = hub.registry.services["d1"].stamp
    node.hello()
    assert wait_until(lambda: hub.registry.services["d1"].stamp > before, 10)


def test_a_lost_assignment_and_a_lost_release_are_released_by_the_services_hellos():
    hub, node, dev, clock, hub_link, node_link = _star()
    try:
        hub_link.drop[SessionAssign] = 1                 # the first assignment never reaches the service
        lost = dev.join(3, GREEDY_WIRE)
        kept = dev.join(3, GREEDY_WIRE)
        assert wait_until(lambda: kept.sid in node.service.sessions(), 10)
        assert lost.sid not in node.service.sessions() and hub.registry.count() == 2
        _settle(hub, node)                               # a newer hello, within the grace: nothing yet
        assert hub.registry.count() == 2
        clock.t += hub.registry.liveness.answer_within   # the grace is over
        _settle(hub, node)
        assert wait_until(lambda: set(hub.registry.sessions) == {kept.sid}, 10)

        node_link.drop[SessionRelease] = 1               # the bye's release never reaches the hub
        kept.close()
        assert wait_until(lambda: node.service.sessions() == [], 10)
        assert hub.registry.count() == 1
        _settle(hub, node)
        assert wait_until(lambda: hub.registry.count() == 0, 10)
        assert hub.status().sessions == 0 and hub.registry.unconfirmed == 2
    finally:
        dev.close()
        node.stop(announce=False)
        hub.stop()
