"""The SUN star of tests/system/test_sun_*.py: a router, prefill workers, decoders and a client,
each on its own MQTT link, on tiny random float64 models (greedy comparisons stay exact)."""
from __future__ import annotations

import os

import numpy as np
import torch

from edge.engines.torch_engine import TorchEngine
from edge.wire.link import MqttLink
from edge.wire.protocol import SunHello, encode, sun_ctl_topic, sun_hello_topic
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.sun.client import SunClient
from edge.model.sun_modules import split_generate, weights_fingerprint
from server.sun_router import SunRouter
from harness.tiny_models import random_model, specialist
from harness.waiting import wait_until

torch.set_num_threads(1)
TASKS = ("maths", "code", "tools")
KEY = b"k" * 32                                   # the deployment's ctl key


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


def sun_models():
    base = random_model()
    return base, weights_fingerprint(base), {t: specialist(base, i + 10) for i, t in enumerate(TASKS)}


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
        assert wait_until(lambda: name in self.router.workers and self.router.workers[name].online), name
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


def stuck_prefill(link, fp):
    """A prefill worker that is alive (it answers the router's probes with its hello) and never prefills."""
    hello = encode(SunHello("prefill-stuck", "prefill", "stuck", fp, 256), KEY)
    link.subscribe(sun_ctl_topic("prefill-stuck"),
                   lambda t, p: link.publish(sun_hello_topic("prefill-stuck"), hello, kind="status"))
    link.publish(sun_hello_topic("prefill-stuck"), hello, kind="status")
