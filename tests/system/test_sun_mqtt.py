"""SUN routing over real brokers: task -> its prefill worker, KV -> least-loaded shared decoder.

Tiny random float64 models keep greedy comparisons exact; the reference for
every request is the in-process split generation (specialist prefill, then
the shared decoder), edge.sun.split_generate. KV caches travel in small
chunks here (chunk_bytes) so reassembly is exercised on every request.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.link import MqttLink
from edge.protocol import (SunHello, SunTokens, encode, sun_ctl_topic, sun_hello_topic, sun_stream_sub,
                           sun_stream_topic)
from edge.roles.decoder import SharedDecoder
from edge.roles.prefill import PrefillWorker
from edge.roles.sun_client import SunClient, SunRequestError
from edge.roles.decoder_node import DecoderNode
from edge.roles.prefill_node import PrefillNode
from edge.sun import split_generate, weights_fingerprint
from server.sun_router import SunRouter

from tiny_models import random_model, specialist

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
TASKS = ("maths", "code", "tools")
KEY = b"k" * 32                                   # the deployment's ctl key


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def models():
    base = random_model()
    return base, weights_fingerprint(base), {t: specialist(base, i + 10) for i, t in enumerate(TASKS)}


@pytest.fixture(params=["mosquitto", "embedded"])
def broker(request):
    return request.getfixturevalue("mosquitto" if request.param == "mosquitto" else "embedded_broker")


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return cond()


class Star:
    """A router, prefill workers, decoders and a client, each on its own MQTT link.

    Links connect one at a time: amqtt 0.12.1 can drop a client whose connect
    overlaps another client's SUBSCRIBE."""

    def __init__(self, url, models, decoders=("dec-a",), isolated=False, ctl_key=KEY, tasks=TASKS):
        self.url, self.key = url, ctl_key
        self.base, self.fp, self.specs = models
        self.links, self.nodes, self.prefills, self.decoders = [], [], {}, {}
        self.router = SunRouter(self.link("router").connect(5), isolated=isolated, ctl_key=ctl_key).start()
        for t in tasks:
            self.add_prefill(t, self.specs[t])
        for d in decoders:
            self.add_decoder(d)
        self.client = SunClient(self.link("client").connect(5), "client").start()

    def link(self, name):
        ln = MqttLink(self.url, client_id=f"{name}-{os.getpid()}-{len(self.links)}")
        self.links.append(ln)
        return ln

    def _start(self, make, name):
        ln = self.link(name)
        node = make(ln)
        ln.set_will(sun_hello_topic(name), node.will())
        ln.connect(5)
        self.nodes.append(node.start())
        assert _wait(lambda: name in self.router.workers and self.router.workers[name].online), name
        return node

    def add_prefill(self, task, model, name=None):
        name = name or f"prefill-{task}"
        worker = PrefillWorker(TorchEngine(model, fingerprint=self.fp), task, kv_dtype="float64")
        self.prefills[name] = self._start(lambda ln: PrefillNode(worker, ln, name, self.key, chunk_bytes=1500),
                                          name)
        return self.prefills[name]

    def add_decoder(self, name, max_batch=16, **kw):
        dec = SharedDecoder(TorchEngine(self.base, fingerprint=self.fp), max_batch=max_batch, name=name)
        self.decoders[name] = self._start(lambda ln: DecoderNode(dec, ln, name, self.key, **kw), name)
        return self.decoders[name]

    def expect(self, task, prompt, max_new):
        return split_generate(self.specs[task], self.base, [prompt], max_new=max_new)[0]

    def close(self):
        for n in self.nodes:
            n.stop()
        for ln in self.links:
            ln.close()


def test_shared_decoder_batches_all_tasks_and_matches_in_process(broker, models):
    star = Star(broker.url, models)
    try:
        c, ps = star.client, prompts(9, seed=3)
        running = threading.Event()
        # a long request first: while it runs, the others join its batch whatever their task
        long = c.submit("maths", ps[0], max_new=200, on_token=lambda i, t: i >= 1 and running.set())
        assert running.wait(10)
        jobs = [(t, p) for t, p in zip(TASKS * 3, ps[1:])]
        handles = [c.submit(t, p, max_new=8) for t, p in jobs]
        for h, (t, p) in zip(handles, jobs):
            r = h.wait(20)
            assert r.tokens == star.expect(t, p, 8), t
            assert r.workers == [f"prefill-{t}", "dec-a"] and r.finish_reason == "length"
        assert long.wait(20).tokens == star.expect("maths", ps[0], 200)
        node = star.decoders["dec-a"]
        mixed = max(len(set(b)) for b in node.batches)
        assert mixed > 1, "one engine step should have decoded sequences of several tasks"
        assert node.tasks_served == set(TASKS)
        # deterministic: every task's requests went to its own prefill worker, and only there
        counts = {t: sum(1 for j, _ in jobs if j == t) + (t == "maths") for t in TASKS}
        assert {t: star.prefills[f"prefill-{t}"].stats["jobs"] for t in TASKS} == counts
        assert star.router.snapshot()["routed"] == {t: {"dec-a": n} for t, n in counts.items()}
        assert c.dropped == {}
    finally:
        star.close()


def test_foreign_kv_is_refused_with_a_reason_and_the_decoder_keeps_serving(broker, models):
    star = Star(broker.url, models)
    spy = MqttLink(broker.url).connect(5)
    seen = []
    spy.subscribe(sun_stream_sub("client"), lambda t, p: seen.append((t, p)))
    try:
        c, ps = star.client, prompts(4, seed=7)
        # a worker whose KV does not match what it announced (swapped weights, wrong manifest)
        rogue = star.add_prefill("rogue", star.specs["maths"], "prefill-rogue")
        rogue.worker.engine.fingerprint = "f" * 64
        running = threading.Event()
        long = c.submit("code", ps[0], max_new=120, on_token=lambda i, t: i >= 2 and running.set())
        assert running.wait(10)
        with pytest.raises(SunRequestError, match="cannot be admitted") as e:
            c.generate("rogue", ps[1], max_new=8, timeout=20)
        assert e.value.code == "refused"
        with pytest.raises(SunRequestError, match="no prefill worker serves task 'poetry'") as e:
            c.generate("poetry", ps[1], max_new=8, timeout=20)
        assert e.value.code == "unknown_task"
        # forged and replayed stream messages for the running request are dropped and counted
        assert _wait(lambda: any(t == sun_stream_topic("client", long.rid) for t, _ in seen))
        genuine = [p for t, p in seen if t == sun_stream_topic("client", long.rid)]
        spy.publish(sun_stream_topic("client", long.rid), genuine[-1], "control")
        forged = encode(SunTokens(long.rid, 9999, 5, [1], worker="dec-a"), b"x" * 32)
        spy.publish(sun_stream_topic("client", long.rid), forged, "control")
        assert long.wait(20).tokens == star.expect("code", ps[0], 120)
        assert c.generate("tools", ps[2], max_new=10, timeout=20).tokens == star.expect("tools", ps[2], 10)
        assert _wait(lambda: c.dropped.get("replay") == 1 and c.dropped.get("auth") == 1), c.dropped
        dec = star.decoders["dec-a"]
        assert dec.stats["refused"] == 1 and dec.decoder.refused == 1 and dec.load == 0
        # a prompt the prefill cannot take: the client hears why, the decoder's reservation is freed
        with pytest.raises(SunRequestError, match="context") as e:
            c.generate("tools", [5] * 600, max_new=4, timeout=20)
        assert e.value.code == "bad_request" and _wait(lambda: dec.load == 0)
    finally:
        spy.close()
        star.close()


def test_isolated_pools_give_each_task_its_own_decoder(mosquitto, models):
    star = Star(mosquitto.url, models, decoders=("dec-a", "dec-b", "dec-c"), isolated=True)
    try:
        star.add_prefill("extra", star.specs["code"])
        ps = prompts(6, seed=11)
        jobs = list(zip(TASKS * 2, ps))
        handles = [star.client.submit(t, p, max_new=6) for t, p in jobs]
        for h, (t, p) in zip(handles, jobs):
            assert h.wait(20).tokens == star.expect(t, p, 6)
        bound = star.router.bindings
        assert sorted(bound) == sorted(TASKS) and len(set(bound.values())) == 3
        for t, d in bound.items():
            node = star.decoders[d]
            assert node.tasks_served == {t} and all(set(b) <= {t} for b in node.batches)
            assert star.router.snapshot()["routed"][t] == {d: 2}
        with pytest.raises(SunRequestError, match="isolated pools: every decoder is bound") as e:
            star.client.generate("extra", ps[0], max_new=4, timeout=20)
        assert e.value.code == "no_decoder"
    finally:
        star.close()


def _stuck_prefill(link, fp):
    """A prefill worker that is alive (it answers the router's probes with its hello) and never prefills."""
    hello = encode(SunHello("prefill-stuck", "prefill", "stuck", fp, 256), KEY)
    link.subscribe(sun_ctl_topic("prefill-stuck"),
                   lambda t, p: link.publish(sun_hello_topic("prefill-stuck"), hello, kind="status"))
    link.publish(sun_hello_topic("prefill-stuck"), hello, kind="status")


def test_least_loaded_decoder_gets_the_work(mosquitto, models):
    star = Star(mosquitto.url, models, tasks=("maths",))
    stuck = star.link("prefill-stuck")               # announces a task, never answers: KV stays awaited
    try:
        stuck.connect(5)
        _stuck_prefill(stuck, star.fp)
        assert _wait(lambda: "prefill-stuck" in star.router.workers)
        for p in prompts(3, seed=2):
            star.client.submit("stuck", p, max_new=8)
        a = star.decoders["dec-a"]
        assert _wait(lambda: a.load == 3 and star.router.workers["dec-a"].load == 3)
        star.add_decoder("dec-b")
        ps = prompts(2, seed=4)
        for p in ps:
            r = star.client.generate("maths", p, max_new=6, timeout=20)
            assert r.tokens == star.expect("maths", p, 6) and r.workers == ["prefill-maths", "dec-b"]
        assert star.router.snapshot()["routed"] == {"stuck": {"dec-a": 3}, "maths": {"dec-b": 2}}
    finally:
        star.close()


def test_decoder_lost_mid_request_fails_its_requests_at_once(mosquitto, models):
    """A decoder dies holding requests: their clients hear worker_lost from the router (not a
    timeout), requests it had finished get nothing, and the next request goes to a live decoder."""
    star = Star(mosquitto.url, models, tasks=("maths",))
    stuck = star.link("prefill-stuck")               # announces a task, never answers: KV stays awaited
    try:
        p = prompts(1, seed=5)[0]
        assert star.client.generate("maths", p, max_new=6, timeout=20).tokens == star.expect("maths", p, 6)
        assert _wait(lambda: "dec-a" not in star.router.inflight)     # its idle hello cleared it
        stuck.connect(5)
        _stuck_prefill(stuck, star.fp)
        assert _wait(lambda: "prefill-stuck" in star.router.workers)
        star.client.retries = 0                       # no resend (test_process_faults covers it)
        handles = [star.client.submit("stuck", q, max_new=8) for q in prompts(3, seed=6)]
        a = star.decoders["dec-a"]
        assert _wait(lambda: a.load == 3 and len(star.router.inflight.get("dec-a", {})) == 3)
        a.link.crash()                                # killed: the broker publishes its will
        for h in handles:                             # an error, not a TimeoutError after 10 s
            with pytest.raises(SunRequestError, match="dec-a went offline") as e:
                h.wait(10)
            assert e.value.code == "worker_lost"
        assert star.client.dropped == {}, star.client.dropped     # no stray error for the finished one
        star.add_decoder("dec-b")
        r = star.client.generate("maths", p, max_new=6, timeout=20)
        assert r.tokens == star.expect("maths", p, 6) and r.workers == ["prefill-maths", "dec-b"]
    finally:
        star.close()


def test_kv_from_this_process_is_decoded_by_a_decoder_process(mosquitto, models, tmp_path):
    from export.tune import save_decoder
    base, fp, _ = models
    save_decoder(tmp_path / "dec", base, "fp32", fp)
    star = Star(mosquitto.url, models, decoders=(), ctl_key=None, tasks=("maths", "code"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "run", "--role", "decoder", "--module",
                             str(tmp_path / "dec"), "--hub", mosquitto.url, "--client-id", "dec-proc",
                             "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: "dec-proc" in star.router.workers, 60), proc.stderr.read() if proc.poll() else ""
        assert star.router.workers["dec-proc"].fingerprint == fp
        ps = prompts(2, seed=13)
        handles = [star.client.submit(t, p, max_new=10) for t, p in zip(("maths", "code"), ps)]
        for h, t, p in zip(handles, ("maths", "code"), ps):
            r = h.wait(30)
            assert r.tokens == star.expect(t, p, 10) and r.workers == [f"prefill-{t}", "dec-proc"]
        proc.terminate()                               # it leaves cleanly and says so
        assert proc.wait(20) == 0, proc.stderr.read()
        assert _wait(lambda: not star.router.workers["dec-proc"].online)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        star.close()


def test_kv_that_overtakes_its_assignment_is_held_and_a_missing_kv_times_out(memory_bus, models):
    """Brokers may reorder publishers: KV that arrives before its DecodeAssign waits for it."""
    from edge.memory_link import MemoryLink
    from edge.protocol import DecodeAssign, KVChunk, new_secret, sun_ctl_topic, sun_kv_topic
    base, fp, specs = models
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp))
    node = DecoderNode(dec, MemoryLink(memory_bus).connect(), "dec-m", KEY, kv_timeout=0.5).start()
    client = SunClient(MemoryLink(memory_bus).connect(), "client").start()
    bus = MemoryLink(memory_bus).connect()
    try:
        p = prompts(1, seed=17)[0]
        out = PrefillWorker(TorchEngine(specs["code"], fingerprint=fp), "code", kv_dtype="float64").prefill(p)
        handles = [client.submit("code", p, max_new=7), client.submit("code", p, max_new=7)]
        for x in handles:                             # the test plays router and prefill worker
            token0 = SunTokens(x.rid, 0, 0, [out.first_token], worker="pf")
            bus.publish(sun_stream_topic("client", x.rid), encode(token0, x.req.secret))
        h = handles[0]
        n = 4
        for i in range(n):                            # every chunk before the assignment
            part = out.blob[i * len(out.blob) // n:(i + 1) * len(out.blob) // n]
            bus.publish(sun_kv_topic("dec-m", "pf"), encode(KVChunk(h.rid, i, n, out.first_token, part), h.req.secret))
        assert _wait(lambda: h.rid in node._early and len(node._early[h.rid]) == n)
        for x in handles:
            bus.publish(sun_ctl_topic("dec-m"), encode(DecodeAssign("dec-m", x.rid, "client", x.req.secret,
                                                                    "code", 7, prefill="pf"), KEY))
        assert h.wait(10).tokens == split_generate(specs["code"], base, [p], max_new=7)[0]
        with pytest.raises(SunRequestError, match="did not reach decoder dec-m") as e:
            handles[1].wait(10)                       # its KV never comes
        assert e.value.code == "timeout" and node.load == 0 and not node._early
        forged = encode(KVChunk(h.rid, 0, 1, 1, b"x"), new_secret())
        bus.publish(sun_kv_topic("dec-m", "pf"), forged)    # after the fact, with a wrong key: dropped
        assert _wait(lambda: node.dropped.get("auth") == 1), node.dropped
    finally:
        node.stop()
        for ln in (node.link, client.link, bus):
            ln.close()


# ---- the brokers' ACL with SUN roles, and the hub's wiring ------------------------------------

class AclStar(Star):
    """A Star whose links log in: the router as the hub, workers with role sun, the client as itself."""

    def __init__(self, broker, models, **kw):
        self.broker = broker
        super().__init__(broker.url, models, **kw)

    def link(self, name):
        role = "hub" if name == "router" else "client" if name == "client" else "sun"
        user = self.broker.hub_user if role == "hub" else name
        if user not in self.broker.acl.users:
            self.broker.add_user(user, role)
        ln = MqttLink(self.url, username=user, password=self.broker.password(user))
        self.links.append(ln)
        return ln


@pytest.fixture(params=["mosquitto", "embedded"])
def acl_broker(request):
    if request.param == "mosquitto":
        yield request.getfixturevalue("mosquitto_acl")
        return
    from server.broker import EmbeddedBroker
    broker = EmbeddedBroker(acl=True).start()
    yield broker
    broker.stop()


def test_sun_runs_through_the_brokers_acl(acl_broker, models):
    star = AclStar(acl_broker, models, tasks=("maths", "code"))
    try:
        ps = prompts(2, seed=19)
        handles = [star.client.submit(t, p, max_new=8) for t, p in zip(("maths", "code"), ps)]
        for h, t, p in zip(handles, ("maths", "code"), ps):
            r = h.wait(20)
            assert r.tokens == star.expect(t, p, 8) and r.workers == [f"prefill-{t}", "dec-a"]
        assert star.client.dropped == {}
    finally:
        star.close()


def test_hub_routes_sun_and_hosts_a_decoder(memory_bus, models):
    from edge.memory_link import MemoryLink
    from server.hub import Hub
    base, fp, specs = models
    hub = Hub(link=MemoryLink(memory_bus), hub_id="hub", ctl_key=KEY,
              sun_decoder=SharedDecoder(TorchEngine(base, fingerprint=fp), name="hub-decoder")).start()
    worker = PrefillWorker(TorchEngine(specs["tools"], fingerprint=fp), "tools", kv_dtype="float64")
    plink = MemoryLink(memory_bus)
    pnode = PrefillNode(worker, plink, "prefill-tools", KEY)
    plink.set_will(sun_hello_topic("prefill-tools"), pnode.will())
    plink.connect()
    pnode.start()
    client = SunClient(MemoryLink(memory_bus).connect(), "client").start()
    try:
        assert _wait(lambda: {"hub-decoder", "prefill-tools"} <= set(hub.snapshot()["sun"]["workers"]))
        p = prompts(1, seed=23)[0]
        r = client.generate("tools", p, max_new=9, timeout=20)
        assert r.tokens == split_generate(specs["tools"], base, [p], max_new=9)[0]
        assert r.workers == ["prefill-tools", "hub-decoder"]
        sun = hub.snapshot()["sun"]
        assert sun["routed"] == {"tools": {"hub-decoder": 1}} and sun["decoder"]["admitted"] == 1
        with pytest.raises(ValueError, match="sun_isolated"):
            Hub(link=MemoryLink(memory_bus), sun_pools={"tools": ["hub-decoder"]})
    finally:
        hub.stop()
        pnode.stop()
        for ln in (plink, client.link):
            ln.close()
    spy = MemoryLink(memory_bus).connect()           # the hub's decoder said goodbye (retained)
    seen = []
    spy.subscribe(sun_hello_topic("hub-decoder"), lambda t, b: seen.append(b))
    from edge.protocol import decode
    assert _wait(lambda: seen) and decode(seen[-1], KEY).online is False
    spy.close()
