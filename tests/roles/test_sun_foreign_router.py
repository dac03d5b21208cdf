"""A hub routes SUN only for a pool it can authenticate (server/sun_router.py).

A default Hub (sun=True) shares a broker with a SUN pool that has its own router and another
control key (or none where the hub has one): the load test's soak puts its StarSD hub beside
such a pool. The hub's router used to probe the pool's workers (dropped: ctl_auth) and answer
every SUN request as unknown_task before the pool's own router could answer it. Now it leaves
the pool alone; and with no SUN hello at all it still refuses what it cannot route."""
from __future__ import annotations

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import sun_hello_topic
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.sun.client import SunClient, SunRequestError
from edge.model.sun_modules import split_generate, weights_fingerprint
from server.hub import Hub
from server.sun_router import SunRouter
from harness.tiny_models import random_model, specialist
from harness.waiting import wait_until

torch.set_num_threads(1)
KEY = b"k" * 32


class Pool:
    """A SUN pool of its own on `bus`: router, a maths prefill worker, a decoder (control key `key`)."""

    def __init__(self, bus: MemoryBus, key):
        self.base = random_model()
        self.fp, self.spec = weights_fingerprint(self.base), specialist(self.base, 10)
        self.router = SunRouter(MemoryLink(bus, "pool-router").connect(), ctl_key=key).start()
        self.nodes = [
            self._start(bus, "prefill-maths", lambda ln: PrefillNode(
                PrefillWorker(TorchEngine(self.spec, fingerprint=self.fp), "maths", kv_dtype="float64"), ln,
                "prefill-maths", key)),
            self._start(bus, "dec", lambda ln: DecoderNode(
                SharedDecoder(TorchEngine(self.base, fingerprint=self.fp), max_batch=4, name="dec"), ln, "dec", key))]

    def _start(self, bus, name, make):
        ln = MemoryLink(bus, name)
        node = make(ln)
        ln.set_will(sun_hello_topic(name), node.will())
        ln.connect()
        node.start()
        assert wait_until(lambda: name in self.router.workers and self.router.workers[name].online, 10)
        return node

    def stop(self):
        for n in self.nodes:
            n.stop()


@pytest.mark.parametrize("hub_key,pool_key", [(None, KEY), (KEY, None)], ids=["keyless-hub", "keyed-hub"])
def test_a_hub_leaves_a_pool_of_another_key_to_its_own_router(hub_key, pool_key):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), ctl_key=hub_key, status_every=60.0).start()   # sun=True: the default
    pool = Pool(bus, pool_key)
    client = SunClient(MemoryLink(bus, "client").connect(), "client").start()
    try:
        prompts = [[5, 6, 7], [9, 10, 11, 12], [3, 4]]
        handles = [client.submit("maths", p, max_new=6) for p in prompts]
        got = [h.wait(30).tokens for h in handles]             # no unknown_task from the hub first
        assert got == [split_generate(pool.spec, pool.base, [p], max_new=6)[0] for p in prompts]
        r = hub.router
        assert r.workers == {} and r.counters["routed"] == 0 and r.counters["foreign_hello"] >= 2
        assert r.counters["left_to_their_router"] == len(prompts)
        assert not any(k.startswith("ctl_") for n in pool.nodes for k in n.dropped)   # never probed them
    finally:
        client.close()
        pool.stop()
        hub.stop()


def test_a_hub_with_no_sun_worker_at_all_still_refuses_what_it_cannot_route():
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), status_every=60.0).start()
    client = SunClient(MemoryLink(bus, "client").connect(), "client").start()
    try:
        with pytest.raises(SunRequestError) as e:
            client.submit("maths", [5, 6], max_new=4).wait(10)
        assert e.value.code == "unknown_task" and "start one with" in e.value.message
    finally:
        client.close()
        hub.stop()
