"""Each role's `telemetry()` hook reports the counters it already keeps (edge/telemetry/readings.py names
the keys), and a reporter turns them into a valid Telemetry message: the hub with its own
draft service and a target over the memory bus, a SUN prefill worker and shared decoder
behind the router."""
from __future__ import annotations

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.model.transformer import Transformer, tiny_config
from edge.wire.protocol import decode, encode, sun_hello_topic
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.star.hub_client import HubClient
from edge.sun.client import SunClient
from edge.star.target import StarTarget
from edge.model.sun_modules import weights_fingerprint
from edge.telemetry.readings import SystemSampler, TelemetryReporter
from server.hub import Hub
from server.sun_router import SunRouter

from harness.tiny_models import random_model
from harness.waiting import wait_until

torch.set_num_threads(1)
KEY = b"k" * 32


def engine(seed):
    torch.manual_seed(seed)
    m = Transformer(tiny_config("llama")).double()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return TorchEngine(m, fingerprint=f"tiny-{seed}")


def report(role, counters):
    msg = TelemetryReporter("x", role, counters, SystemSampler(gpu="none")).report()
    return decode(encode(msg))                      # every report is a valid wire message


def test_hub_draft_service_and_target_report_their_counters():
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=engine(1), tokenizer_fp="tok").start()
    try:
        idle = hub.telemetry()
        assert idle["sessions"] == 0 and idle["tokens"] == 0 and idle["kv_used_bytes"] == 0
        assert idle["kv_budget_bytes"] == 1024e6                  # --max-kv-mb's default
        star = StarTarget(engine(0), HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=3)
        got = star.generate([1, 2, 3, 4], 24)
        t = star.telemetry()
        assert (t["tokens"], t["accepted"], t["drafted"]) == (len(got.tokens), got.n_accepted, got.n_drafted)
        assert t["sessions"] == 0 and t["generations"] == 1 and 0 < t["busy_s"] <= t["wall_s"]
        h = hub.telemetry()
        assert h["tokens"] == hub.node.service.stats.drafted > 0
        assert h["batch_max"] >= 1 and h["busy_s"] > 0 and "bad_join" in h["dropped"]
        msg = report("target", star.telemetry)
        assert msg.acceptance == pytest.approx(got.n_accepted / got.n_drafted)
        assert report("hub", hub.telemetry).kv_budget_mb == pytest.approx(1024.0)
    finally:
        hub.stop()


def test_sun_prefill_worker_and_decoder_report_their_counters():
    bus = MemoryBus()
    base = random_model()
    fp = weights_fingerprint(base)
    links = []

    def link(name):
        ln = MemoryLink(bus, name)
        links.append(ln)
        return ln
    router = SunRouter(link("router").connect(5), ctl_key=KEY).start()
    nodes = []
    for name, make in (("prefill-maths", lambda ln: PrefillNode(
            PrefillWorker(TorchEngine(base, fingerprint=fp), "maths", "float64"), ln, "prefill-maths", KEY)),
                       ("dec", lambda ln: DecoderNode(SharedDecoder(TorchEngine(base, fingerprint=fp), max_batch=4),
                                                     ln, "dec", KEY))):
        ln = link(name)
        node = make(ln)
        ln.set_will(sun_hello_topic(name), node.will())
        ln.connect(5)
        nodes.append(node.start())
    client = SunClient(link("client").connect(5), "client").start()
    try:
        wait_until(lambda: {"prefill-maths", "dec"} <= {w for w, s in router.workers.items() if s.online},
                   timeout=10)
        handles = [client.submit("maths", [3, 4, 5 + i], max_new=6) for i in range(3)]
        results = [h.wait(20) for h in handles]
        prefill, dec = nodes
        p, d = prefill.telemetry(), dec.telemetry()
        assert p["tokens"] == 3 and p["served"] == 3 and p["sessions"] == 0
        assert d["tokens"] == dec.decoder.tokens_out == sum(len(r.tokens) - 1 for r in results)
        assert 1 <= d["batch_mean"] <= d["batch_max"] <= 4
        assert 0 < p["busy_s"] <= p["wall_s"] and 0 < d["busy_s"] <= d["wall_s"]
        assert report("decoder", dec.telemetry).tokens == d["tokens"]
    finally:
        client.close()
        for node in nodes:
            node.stop()
        router.stop()
        for ln in links:
            ln.close()
