"""A join nobody waits for any more must not hold a draft slot (edge/star/hub_client.py HubClient,
edge/star/target.py RemoteDrafter): the load test's churn filled a 256-session draft with
accepted joins whose targets had given up on them, until eviction 60 s later.

The hub here answers joins only when the test releases them (a slow hub); eviction is an hour
away, so a session count back to 0 can only come from the target's bye."""
from __future__ import annotations

import threading

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import sampling
from edge.star.draft_service import DraftLimits
from edge.star.hub_client import HubClient, JoinRefused
from edge.star.target import RemoteDrafter
from server.hub import Hub
from harness.tiny_models import tiny_model
from harness.waiting import wait_until

torch.set_num_threads(1)
TOK = "tok"


class SlowHub:
    """A hub (draft service of `max_sessions`) whose join answers wait for `release()`."""

    def __init__(self, max_sessions: int):
        self.bus = MemoryBus()
        self.hub = Hub(link=MemoryLink(self.bus, "hub"), draft_engine=TorchEngine(tiny_model(1), "draft"),
                       tokenizer_fp=TOK, limits=DraftLimits(max_sessions=max_sessions, evict_after_s=3600.0),
                       sun=False, status_every=60.0).start()
        self.held, self._lock, self.hold = [], threading.Lock(), True
        reply = self.hub._reply

        def held_reply(client, joined):
            with self._lock:
                if self.hold:
                    self.held.append((client, joined))
                    return
            reply(client, joined)
        self.hub._reply, self._send = held_reply, reply

    def release(self, hold: bool = True) -> None:
        with self._lock:
            out, self.held, self.hold = self.held, [], hold
        for client, joined in out:
            self._send(client, joined)

    def waiting(self, n: int) -> bool:
        return wait_until(lambda: len(self.held) == n, 10)

    def sessions(self) -> int:
        return len(self.hub.service.sessions()) + self.hub.registry.count()

    def client(self, name: str, **kw) -> HubClient:
        hc = HubClient(MemoryLink(self.bus, name), name, TOK, 256, **kw).start()
        assert wait_until(lambda: hc.status is not None and hc.hub_online, 10)
        return hc

    def stop(self) -> None:
        self.hub.stop()


@pytest.fixture
def slow(request):
    """A SlowHub of 8 slots (one client may hold half of them), or of the slots parametrized."""
    h = SlowHub(getattr(request, "param", 8))
    yield h
    h.stop()


@pytest.mark.parametrize("slow", [2], indirect=True)
def test_a_drafter_closed_with_its_join_pending_leaves_no_session(slow):
    """Four generations close before their join is answered; the hub accepts each anyway. With
    max_sessions=2 the orphans would fill the draft: a fifth join would be refused."""
    for i in range(4):
        hc = slow.client(f"t{i}")
        d = RemoteDrafter(hc, sampling())
        assert d._ready() is None and slow.waiting(1)        # the join is out, its answer held
        d.close()                                            # the generation ends first
        slow.release()
        assert wait_until(lambda: slow.sessions() == 0, 10), slow.sessions()
        assert hc.join_counts["orphans_closed"] == 1 and not hc._joins
    slow.release(hold=False)
    s = slow.client("last").join(3, sampling(), timeout=10)   # room: nothing was left behind
    assert len(slow.hub.service.sessions()) == 1
    s.close()
    assert wait_until(lambda: slow.sessions() == 0, 10)


def test_a_join_given_up_after_its_backoff_is_closed_and_the_retry_is_used(slow):
    hc = slow.client("t")
    d = RemoteDrafter(hc, sampling(), rejoin_s=(0.0, 0.0))
    d._ready()                                               # join 1
    assert slow.waiting(1)
    d._ready()                                               # its backoff (0 s) passed: given up
    d._ready()                                               # join 2
    assert slow.waiting(2)
    d._next_join = float("inf")                              # now wait for join 2's answer
    slow.release(hold=False)
    assert wait_until(lambda: d._ready() is not None, 10)
    assert wait_until(lambda: len(slow.hub.service.sessions()) == 1, 10)
    assert wait_until(lambda: hc.join_counts["orphans_closed"] == 1, 10)
    assert slow.hub.registry.count() == 1 and d.session.sid in slow.hub.service.sessions()
    d.close()
    assert wait_until(lambda: slow.sessions() == 0, 10)


def test_unanswered_joins_are_forgotten_after_their_ttl_and_a_late_acceptance_is_closed(slow):
    hc = slow.client("t", join_ttl_s=0.0)                    # every join expires at once
    for _ in range(3):
        hc.join_async(3, sampling())
    assert len(hc._joins) == 1 and hc.join_counts["expired"] == 2   # the table does not grow
    assert slow.waiting(3)
    slow.release(hold=False)
    assert wait_until(lambda: hc.join_counts["orphans_closed"] == 3, 10)
    assert wait_until(lambda: slow.sessions() == 0, 10) and not hc._joins and not hc.sessions


def test_a_blocking_join_that_timed_out_closes_its_late_session(slow):
    hc = slow.client("t")
    with pytest.raises(TimeoutError):
        hc.join(3, sampling(), timeout=0.05)
    assert slow.waiting(1)
    slow.release(hold=False)
    assert wait_until(lambda: hc.join_counts["orphans_closed"] == 1, 10)
    assert wait_until(lambda: slow.sessions() == 0, 10)


@pytest.mark.parametrize("slow", [2], indirect=True)
def test_a_refused_join_is_still_reported(slow):
    """The claim bookkeeping keeps finish_join's refusal as it was."""
    slow.release(hold=False)
    a, b = slow.client("a").join(3, sampling(), 10), slow.client("b").join(3, sampling(), 10)
    with pytest.raises(JoinRefused, match="full"):
        slow.client("c").join(3, sampling(), 10)
    a.close()
    b.close()
    assert wait_until(lambda: slow.sessions() == 0, 10)
