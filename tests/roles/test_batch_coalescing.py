"""The draft service holds a batch for a session due back, so turns of one-request batches merge
(edge/star/batch_hold.py), and the loop wakes when the hold falls due."""
from edge.wire.protocol import DraftRequest, DraftResponse
from edge.star.draft_service import DraftLimits, DraftService
from edge.runtime.loop import EngineLoop
from edge.engines.torch_engine import TorchEngine

from harness.draft_services import FakeClock, make_engine


class TimedEngine(TorchEngine):
    """A step over b sequences takes 0.1 + 0.05·b s of the fake clock: a fixed cost, as a CPU draft's."""
    clock = None

    def step(self, seqs, tokens):
        out = super().step(seqs, tokens)
        self.clock.t += 0.1 + 0.05 * len(seqs)
        return out


def timed_service(coalesce):
    clock = FakeClock()
    eng = make_engine(cls=TimedEngine)
    eng.clock = clock
    svc = DraftService(eng, DraftLimits(coalesce=coalesce, ahead=False), clock=clock)
    for sid in ("A", "B"):
        svc.open(sid)
    return svc, clock


def answered(svc):
    return sorted(sid for sid, m in svc.step() if isinstance(m, DraftResponse))


def a_has_come_back_once(svc, clock):
    """A is served, its target comes back 0.03 s later and is served again: its return time is known."""
    svc.submit(DraftRequest("A", 1, 0, [3, 4, 5], 2))
    assert answered(svc) == ["A"]
    clock.t += 0.03
    svc.submit(DraftRequest("A", 2, 3, [6], 2))
    assert answered(svc) == ["A"]


def test_a_request_waits_for_the_session_due_back_and_both_go_in_one_batch():
    svc, clock = timed_service(coalesce=True)
    a_has_come_back_once(svc, clock)
    svc.submit(DraftRequest("B", 1, 0, [7, 8, 9], 2))
    assert not svc.has_work() and svc.step() == []          # held: A is due in 0.03 s
    assert 0.0 < svc.wake_in() <= 0.03 * 1.25 + 1e-9
    clock.t += 0.03
    svc.submit(DraftRequest("A", 3, 4, [6], 2))
    assert svc.has_work()
    assert answered(svc) == ["A", "B"]                      # one step, one batch of two
    assert svc.stats.batch_sizes[-1] == 2
    assert svc.hold.holds == 1 and svc.hold.held_s > 0


def test_without_coalescing_or_when_the_session_does_not_come_back_the_request_is_served():
    svc, clock = timed_service(coalesce=False)
    a_has_come_back_once(svc, clock)
    svc.submit(DraftRequest("B", 1, 0, [7, 8, 9], 2))
    assert svc.has_work() and answered(svc) == ["B"]
    svc, clock = timed_service(coalesce=True)
    a_has_come_back_once(svc, clock)
    svc.submit(DraftRequest("B", 1, 0, [7, 8, 9], 2))
    assert svc.step() == []
    clock.t += 0.05                                         # A is overdue: B waits no longer
    assert svc.has_work() and answered(svc) == ["B"]


def test_the_loop_sleeps_no_longer_than_the_core_asks():
    class Core:
        due = None

        def has_work(self):
            return False

        def wake_in(self):
            return self.due

    core = Core()
    loop = EngineLoop(core, "t", idle_wait=0.25)
    assert loop._sleep() == 0.25
    core.due = 0.01
    assert loop._sleep() == 0.01
    core.due = 5.0
    assert loop._sleep() == 0.25
