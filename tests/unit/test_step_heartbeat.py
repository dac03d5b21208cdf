"""A node says its hello while one long step runs (edge/runtime/heartbeat.py), for a bounded time.

The checks are driven by a fake clock and explicit `beat()` calls, and the threaded one waits on
the hellos themselves (events), never on elapsed time."""
import threading

from edge.runtime.heartbeat import StepHeartbeat
from edge.runtime.loop import EngineLoop
from edge.runtime.node import Node
from edge.wire.memory_link import MemoryBus, MemoryLink


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Loop:
    def __init__(self, clock):
        self.clock, self.stepping_since = clock, None


def test_hellos_only_while_a_step_runs_between_one_period_and_the_hang_bound():
    clock, said = Clock(), []
    loop = Loop(clock)
    hb = StepHeartbeat(loop, lambda: said.append(clock.now), every=2.0, max_step_s=60.0)
    assert not hb.beat()                               # idle: the loop says its own hellos
    loop.stepping_since = clock.now
    clock.now += 1.0
    assert not hb.beat()                               # a short step: the next turn's hello is soon
    clock.now += 2.0
    assert hb.beat() and said == [103.0]
    clock.now += 56.0
    assert hb.beat()                                   # 59 s into the step: still within the bound
    clock.now += 2.0
    assert not hb.beat() and len(said) == 2            # 61 s: past the bound, a hang, silent
    loop.stepping_since = None
    assert not hb.beat() and hb.sent == 2


def test_a_failing_hello_is_skipped_not_raised():
    clock = Clock()
    loop = Loop(clock)
    loop.stepping_since = clock.now - 5

    def boom():
        raise RuntimeError("changed while read")
    hb = StepHeartbeat(loop, boom, every=2.0)
    assert not hb.beat() and hb.sent == 0


class BlockedCore:
    """A core whose one step blocks until released."""

    def __init__(self):
        self.release, self.stepping = threading.Event(), threading.Event()
        self.work = True

    def has_work(self):
        return self.work

    def step(self):
        self.work = False
        self.stepping.set()
        assert self.release.wait(60), "the test never released the step"
        return []


class QuietNode(Node):
    role = "test"

    def hello_topic(self):
        return "ss/test/hello/n1"

    def ctl_topic(self):
        return "ss/test/ctl/n1"

    def status(self, online=True):
        from edge.wire.protocol import Probe
        return Probe(target="n1" if online else "gone")    # any encodable message stands for a hello


def test_a_node_inside_a_long_step_keeps_saying_hello():
    bus = MemoryBus()
    link, spy = MemoryLink(bus, "n1").connect(), MemoryLink(bus, "spy").connect()
    hellos = []
    two = threading.Event()

    def heard(topic, payload):
        hellos.append(payload)
        if len(hellos) >= 3:                                # the start hello + two from the heartbeat
            two.set()
    spy.subscribe("ss/test/hello/n1", heard)
    core = BlockedCore()
    node = QuietNode(core, link, "n1", hello_every=0.05).start()
    try:
        assert core.stepping.wait(30)
        assert two.wait(30), f"only {len(hellos)} hellos while the step ran"
        assert node.heartbeat.sent >= 2 and node.loop.stepping_since is not None
    finally:
        core.release.set()
        node.stop()
    assert node.loop.stepping_since is None


def test_the_loop_says_when_its_step_began():
    clock = Clock()
    seen = []

    class Core:
        def has_work(self):
            return True

        def step(self):
            seen.append(loop.stepping_since)
            return []
    loop = EngineLoop(Core(), "t", clock=clock)
    loop.run_once()
    assert seen == [100.0] and loop.stepping_since is None
