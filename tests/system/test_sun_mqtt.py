"""SUN over real brokers: every task on one shared decoder, KV refused or held with a reason,
across processes, through the ACL and inside the hub (routing policy: test_sun_routing.py).

Tiny random float64 models keep greedy comparisons exact; the reference for
every request is the in-process split generation (specialist prefill, then
the shared decoder), edge.model.sun_modules.split_generate. KV caches travel in small
chunks here (chunk_bytes) so reassembly is exercised on every request.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edge.engines.torch_engine import TorchEngine
from edge.wire.link import MqttLink
from edge.wire.protocol import (SunTokens, encode, sun_hello_topic, sun_stream_sub,
                           sun_stream_topic)
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.sun.client import SunClient, SunRequestError
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill_node import PrefillNode
from edge.model.sun_modules import split_generate
from harness.sun_star import KEY, TASKS, Star, prompts, sun_models
from harness.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models():
    return sun_models()


@pytest.fixture(params=["mosquitto", "embedded"])
def broker(request):
    return request.getfixturevalue("mosquitto" if request.param == "mosquitto" else "embedded_broker")


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
        # ... while its hellos go on announcing the decoder's: else the router may hear the new one
        # first (a periodic hello) and refuse at routing, and the decoder's own check goes untested
        announced = rogue.status
        rogue.status = lambda online=True: dataclasses.replace(announced(online), fingerprint=star.fp)
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
        assert wait_until(lambda: any(t == sun_stream_topic("client", long.rid) for t, _ in seen))
        genuine = [p for t, p in seen if t == sun_stream_topic("client", long.rid)]
        spy.publish(sun_stream_topic("client", long.rid), genuine[-1], "control")
        forged = encode(SunTokens(long.rid, 9999, 5, [1], worker="dec-a"), b"x" * 32)
        spy.publish(sun_stream_topic("client", long.rid), forged, "control")
        assert long.wait(20).tokens == star.expect("code", ps[0], 120)
        assert c.generate("tools", ps[2], max_new=10, timeout=20).tokens == star.expect("tools", ps[2], 10)
        assert wait_until(lambda: c.dropped.get("replay") == 1 and c.dropped.get("auth") == 1), c.dropped
        dec = star.decoders["dec-a"]
        assert dec.stats["refused"] == 1 and dec.decoder.refused == 1 and dec.load == 0
        # a prompt the prefill cannot take: the client hears why, the decoder's reservation is freed
        with pytest.raises(SunRequestError, match="context") as e:
            c.generate("tools", [5] * 600, max_new=4, timeout=20)
        assert e.value.code == "bad_request" and wait_until(lambda: dec.load == 0)
    finally:
        spy.close()
        star.close()


def test_kv_from_this_process_is_decoded_by_a_decoder_process(mosquitto, models, tmp_path):
    from export.tune import save_decoder
    base, fp, _ = models
    save_decoder(tmp_path / "dec", base, "fp32", fp)
    star = Star(mosquitto.url, models, decoders=(), ctl_key=None, tasks=("maths", "code"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli.agent", "run", "--role", "decoder", "--module",
                             str(tmp_path / "dec"), "--broker", mosquitto.url, "--client-id", "dec-proc",
                             "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: "dec-proc" in star.router.workers, 60), proc.stderr.read() if proc.poll() else ""
        assert star.router.workers["dec-proc"].fingerprint == fp
        ps = prompts(2, seed=13)
        handles = [star.client.submit(t, p, max_new=10) for t, p in zip(("maths", "code"), ps)]
        for h, t, p in zip(handles, ("maths", "code"), ps):
            r = h.wait(30)
            assert r.tokens == star.expect(t, p, 10) and r.workers == [f"prefill-{t}", "dec-proc"]
        proc.terminate()                               # it leaves cleanly and says so
        assert proc.wait(20) == 0, proc.stderr.read()
        assert wait_until(lambda: not star.router.workers["dec-proc"].online)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        star.close()


def test_kv_that_overtakes_its_assignment_is_held_and_a_missing_kv_times_out(memory_bus, models):
    """Brokers may reorder publishers: KV that arrives before its DecodeAssign waits for it."""
    from edge.wire.memory_link import MemoryLink
    from edge.wire.protocol import DecodeAssign, KVChunk, new_secret, sun_ctl_topic, sun_kv_topic
    base, fp, specs = models
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp))
    node = DecoderNode(dec, MemoryLink(memory_bus).connect(), "dec-m", KEY, kv_timeout=0.5).start()
    # retries=0: a KV timeout is otherwise sent again (tests/roles/test_sun_resend.py); no router here
    client = SunClient(MemoryLink(memory_bus).connect(), "client", retries=0).start()
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
        assert wait_until(lambda: h.rid in node._early and len(node._early[h.rid]) == n)
        for x in handles:
            bus.publish(sun_ctl_topic("dec-m"), encode(DecodeAssign("dec-m", x.rid, "client", x.req.secret,
                                                                    "code", 7, prefill="pf"), KEY))
        assert h.wait(10).tokens == split_generate(specs["code"], base, [p], max_new=7)[0]
        with pytest.raises(SunRequestError, match="did not reach decoder dec-m") as e:
            handles[1].wait(10)                       # its KV never comes
        assert e.value.code == "timeout" and node.load == 0 and not node._early
        forged = encode(KVChunk(h.rid, 0, 1, 1, b"x"), new_secret())
        bus.publish(sun_kv_topic("dec-m", "pf"), forged)    # after the fact, with a wrong key: dropped
        assert wait_until(lambda: node.dropped.get("auth") == 1), node.dropped
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
    from edge.wire.memory_link import MemoryLink
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
        assert wait_until(lambda: {"hub-decoder", "prefill-tools"} <= set(hub.snapshot()["sun"]["workers"]))
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
    from edge.wire.protocol import decode
    assert wait_until(lambda: seen) and decode(seen[-1], KEY).online is False
    spy.close()
