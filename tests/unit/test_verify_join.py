"""VerifyJoin (edge/star/verify_join.py): when the reverse star's verify service waits for sessions due
back, so that their verifies join one call -- pure, fed with times; and the service itself on a fake
clock: the order of events decides, never the wall clock."""
import pytest
import torch

from edge.star.verify_join import VerifyJoin
from edge.star.verify_service import VerifyService
from edge.wire.protocol import VerifyRequest, VerifyResponse

from harness.counting_engine import CountingEngine
from harness.tiny_models import target_and_draft

torch.set_num_threads(1)


def answered_together(j: VerifyJoin, sids, t: float) -> None:
    j.call(len(sids), 0.4, t)
    for s in sids:
        j.answered(s, t)


def test_new_sessions_are_waited_for_at_most_one_bound():
    j = VerifyJoin(max_hold_s=1.0)
    j.opened("A", 0.0)
    j.opened("B", 0.0)
    assert j.until(0.3, {"A"}) == pytest.approx(1.0)       # B joined and has not sent: wait (bound 1 s before any call)
    assert j.until(0.31, {"A", "B"}) is None                # in: serve both at once
    j.opened("C", 5.0)
    assert j.until(7.0, {"A"}) is None                      # C joined long ago and never sent: not waited for


def test_sessions_answered_together_are_served_together():
    j = VerifyJoin()
    for s in "ABCD":
        j.opened(s, 0.0)
    answered_together(j, "ABCD", 1.0)
    # the first back waits for the others (return time unknown yet: at most one call, 0.4 s)
    assert j.until(1.30, {"A"}) == pytest.approx(1.40)
    assert j.until(1.31, {"A", "B", "C"}) == pytest.approx(1.40)
    assert j.until(1.32, {"A", "B", "C", "D"}) is None
    for s in "ABCD":
        j.arrived(s, 1.3)
    answered_together(j, "ABCD", 2.0)                       # return times known now (0.3 s)
    due = j.until(2.30, {"A"})
    assert 2.30 < due <= 2.30 + 0.4 and due == pytest.approx(2.3 + 0.25 * 0.3)   # due, plus a little slack
    assert j.until(2.30 + 0.25 * 0.3 + 1e-6, {"A"}) is None                       # late: gone ahead without them


def test_a_lone_session_never_waits_and_a_long_return_is_not_waited_for():
    j = VerifyJoin()
    j.opened("A", 0.0)
    assert j.until(0.3, {"A"}) is None                      # nobody else: work-conserving
    j.opened("B", 0.0)
    answered_together(j, "AB", 1.0)
    j.arrived("A", 1.1)
    j.arrived("B", 1.9)                                     # B drafts for 0.9 s, longer than a call of 0.4
    answered_together(j, "AB", 2.0)
    assert j.until(2.1, {"A"}) is None                      # B is due past the bound: A goes alone
    j.forget("B")
    with pytest.raises(ValueError):
        VerifyJoin(max_hold_s=0.0)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_service_holds_a_step_until_the_devices_answered_together_are_back():
    """Three devices answered by one call: the first one back is held (has_work False, wake_in within
    one call's time) until the others' drafts are in, then ONE call verifies all three; a device that
    stays away past the bound is not waited for. Event order on a fake clock, no sleeps."""
    clock = Clock()
    eng = CountingEngine(target_and_draft()[0], fingerprint="target")
    svc = VerifyService(eng, clock=clock)
    sids = ["s0", "s1", "s2"]
    held = {}
    for i, s in enumerate(sids):
        svc.open(s)
        svc.submit(VerifyRequest(s, 1, 0, [5 + i, 6, 7], [8]))
    assert svc.has_work()
    for sid, r in svc.step():
        assert isinstance(r, VerifyResponse) and r.batch == 3
        held[sid] = r.held
    assert eng.batches == [3]
    clock.t += 0.2                                          # s0 comes back first
    svc.submit(VerifyRequest("s0", 2, held["s0"], [], [9]))
    assert not svc.has_work() and 0.0 < svc.wake_in() <= 1.0
    clock.t += 0.01
    svc.submit(VerifyRequest("s1", 2, held["s1"], [], [9]))
    assert not svc.has_work()
    clock.t += 0.01
    svc.submit(VerifyRequest("s2", 2, held["s2"], [], [9]))
    assert svc.has_work() and svc.wake_in() is None
    out = dict(svc.step())
    assert eng.batches == [3, 3] and all(out[s].batch == 3 for s in sids)
    for s in sids:
        held[s] = out[s].held
    # s2 stays away: s0 and s1 are held no longer than the bound, then go without it
    clock.t += 0.2
    svc.submit(VerifyRequest("s0", 3, held["s0"], [], [9]))
    svc.submit(VerifyRequest("s1", 3, held["s1"], [], [9]))
    assert not svc.has_work()
    clock.t += svc.wake_in() + 1e-6
    assert svc.has_work()
    out = dict(svc.step())
    assert eng.batches[-1] == 2 and set(out) == {"s0", "s1"}
