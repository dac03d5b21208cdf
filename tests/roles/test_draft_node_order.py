"""A remote draft service gets a session's SessionAssign and, right behind it on the same link,
the session's first request (the target got its Joined at the same moment and is on a fast
link). The node must answer that request, not drop it as an unknown session: found by
tests/system/test_star_namespaces.py, where a target on a plain veth lost its whole first
round (its 0.5 s initial deadline) to this race in every other generation."""

import torch

from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import (DraftRequest, DraftResponse, SessionAssign, decode, down_topic, draft_ctl_topic,
                           encode, sampling, up_topic)
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.draft_node import DraftNode

from harness.draft_services import make_engine
from harness.waiting import wait_until

torch.set_num_threads(1)


def test_the_first_request_right_behind_its_assignment_is_answered():
    bus = MemoryBus()
    node_link, peer = MemoryLink(bus).connect(), MemoryLink(bus).connect()
    node = DraftNode(DraftService(make_engine(), DraftLimits(ahead=False), name="d1"), node_link, "d1", "tok")
    node.start()
    got = []
    try:
        secret = b"k" * 32
        for i in range(20):                        # the race is a matter of thread timing: try it often
            sid = f"s{i}"
            peer.subscribe(down_topic("dev", sid, "d1"), lambda t, p, s=secret: got.append(decode(p, s)))
            peer.publish(draft_ctl_topic("d1"), encode(SessionAssign("d1", "dev", sid, secret, 3, sampling())))
            peer.publish(up_topic("dev", sid, "d1"), encode(DraftRequest(sid, 1, 0, [5, 6, 7], 3, sampling()),
                                                            secret), "draft")
        wait_until(lambda: len({m.sid for m in got}) >= 20, 10)
        assert {m.sid for m in got if isinstance(m, DraftResponse)} == {f"s{i}" for i in range(20)}
        assert node.dropped.get("unknown_session", 0) == 0, node.dropped
    finally:
        node.stop(announce=False)
        node_link.close()
        peer.close()
