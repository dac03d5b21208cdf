"""The one engine loop and the node base every networked role stands on."""
import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import (DecodeAssign, KVChunk, PrefillJob, SunTokens, decode, encode, new_secret, sampling,
                           sun_ctl_topic, sun_hello_topic, sun_kv_sub, sun_stream_topic)
from edge.runtime.loop import EngineLoop
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode

from harness.tiny_models import random_model
from harness.waiting import wait_until

torch.set_num_threads(1)
KEY = b"k" * 32


class Doubler:
    """A core: doubles what it was given, one item per step; step fails on 13."""

    def __init__(self):
        self.queue = []

    def has_work(self):
        return bool(self.queue)

    def step(self):
        x = self.queue.pop(0)
        if x == 13:
            raise RuntimeError("unlucky")
        return [2 * x]


def test_the_loop_drains_inputs_steps_the_core_publishes_and_idles():
    core, out = Doubler(), []
    loop = EngineLoop(core, "t", handle=core.queue.append, publish=out.append)
    for x in (1, 2, 3):
        loop.put(x)
    assert loop.backlog() == 3 and loop.run_once()              # one turn: all inputs, one step
    assert loop.backlog() == 0 and out == [2] and core.queue == [2, 3]
    while loop.run_once():
        pass
    assert out == [2, 4, 6] and loop.stats.steps == 3
    idle = []
    loop = EngineLoop(core, "t", handle=core.queue.append, publish=out.append, idle_wait=0.01,
                      on_idle=idle.append).start()
    try:
        assert wait_until(lambda: len(idle) >= 3)                # nothing to do: it waits, and says so
        loop.put(5)
        assert wait_until(lambda: out[-1:] == [10])
        assert loop.stats.idle_s > 0 and loop.stats.busy_s > 0
    finally:
        loop.stop()
    assert not loop.running


def test_a_bad_input_output_or_step_never_stops_the_loop():
    core, out = Doubler(), []

    def handle(x):
        if x == "junk":
            raise ValueError("junk")
        core.queue.append(x)

    def publish(y):
        if y == 2:
            raise OSError("link down")
        out.append(y)
    loop = EngineLoop(core, "t", handle=handle, publish=publish, idle_wait=0.01, error_backoff=0.01).start()
    try:
        for x in ("junk", 1, 13, 4):
            loop.put(x)
        assert wait_until(lambda: out == [8])
        assert loop.stats.errors == {"input": 1, "publish": 1, "step": 1}
        loop.put(5)
        assert wait_until(lambda: out == [8, 10])
    finally:
        loop.stop()


def test_a_node_checks_control_messages_drops_replays_and_says_goodbye():
    bus = MemoryBus()
    base = random_model()
    link = MemoryLink(bus, "prefill")
    node = PrefillNode(PrefillWorker(TorchEngine(base, fingerprint="f" * 64), "maths", kv_dtype="float64"),
                       link, "prefill-maths", KEY)
    link.set_will(sun_hello_topic("prefill-maths"), node.will())
    link.connect()
    node.start()
    spy = MemoryLink(bus, "spy").connect()
    hellos, got = [], []
    spy.subscribe(sun_hello_topic("prefill-maths"), lambda t, p: hellos.append(decode(p, KEY)))
    secret = new_secret()
    spy.subscribe(sun_stream_topic("app", "r1"), lambda t, p: got.append(decode(p, secret)))
    spy.subscribe(sun_kv_sub("dec"), lambda t, p: got.append(decode(p, secret)))
    try:
        job = PrefillJob("prefill-maths", "r1", "app", secret, "maths", [3, 4, 5], sampling(), decoder="dec")
        ctl = sun_ctl_topic("prefill-maths")
        spy.publish(ctl, encode(job, KEY))
        spy.publish(ctl, encode(job, KEY))                                       # replayed
        spy.publish(ctl, encode(job, b"x" * 32))                                 # forged
        spy.publish(ctl, encode(PrefillJob("prefill-maths", "r2", "app", secret, "code", [3], sampling(),
                                           decoder="dec"), KEY))                         # not its task
        spy.publish(ctl, encode(DecodeAssign("prefill-maths", "r3", "app", secret, "maths", 4,
                                             prefill="pf"), KEY))
        assert wait_until(lambda: sum(node.dropped.values()) == 4), node.dropped
        assert node.dropped == {"replay": 1, "ctl_auth": 1, "wrong_task": 1, "not_mine": 1}
        assert wait_until(lambda: any(isinstance(m, KVChunk) for m in got))
        assert isinstance(got[0], SunTokens) and node.served == 1 and node.stats["jobs"] == 1
        assert hellos and hellos[0].online and node.telemetry()["served"] == 1
    finally:
        node.stop()
    assert wait_until(lambda: not hellos[-1].online)                             # goodbye, retained
    spy.close()
    link.close()
