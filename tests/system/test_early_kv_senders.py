"""A SUN decoder holds KV that overtook its assignment per sender (edge/sun/early_kv.py), the
sender being the KV topic's last level, which Mosquitto's ACL lets a worker write only under its
own name. So an intruder with a SUN worker's credentials that floods the decoder with early KV
for requests that do not exist fills only its own quota: the early KV of the real prefill
worker is still held, and decodes to the in-process output once its assignment comes. The
test plays the router and the prefill worker over a real Mosquitto with the hub's ACL."""
from __future__ import annotations

import os

import torch

from edge.wire import protocol as P
from edge.engines.torch_engine import TorchEngine
from edge.wire.link import MqttLink
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.client import SunClient
from edge.model.sun_modules import split_generate, weights_fingerprint

from harness.tiny_models import random_model, specialist
from harness.waiting import wait_until

torch.set_num_threads(1)
KEY = b"k" * 32                  # the deployment's ctl key (signs the router's assignments)
DEC, PRE, EVIL, CLIENT = "ekv-dec", "ekv-prefill", "ekv-evil", "ekv-client"
FLOOD = 40                       # forged early chunks of 64 KiB: past the decoder's whole hold (2 MiB)
MAX_NEW = 6


def _until(cond, what: str, timeout: float = 20.0) -> None:
    assert wait_until(cond, timeout), what


def test_a_flood_of_foreign_early_kv_does_not_disturb_a_legit_one(mosquitto_acl):
    broker = mosquitto_acl
    links = []

    def link(name, role):
        pw = broker.add_user(name, role)
        ln = MqttLink(broker.url, username=name, password=pw, client_id=f"{name}-{os.getpid()}")
        links.append(ln.connect(5))
        return ln

    base = random_model()
    fp = weights_fingerprint(base)
    spec = specialist(base, 10)
    node = DecoderNode(SharedDecoder(TorchEngine(base, fingerprint=fp)), link(DEC, "sun"), DEC, KEY,
                       kv_timeout=120.0, max_pending_mb=2.0).start()     # a quota of 512 KiB per sender
    client = SunClient(link(CLIENT, "client"), CLIENT).start()
    pre, evil = link(PRE, "sun"), link(EVIL, "sun")
    router = MqttLink(broker.url, username=broker.hub_user, password=broker.hub_password,
                      client_id=f"ekv-router-{os.getpid()}")
    links.append(router.connect(5))
    prefill = PrefillWorker(TorchEngine(spec, fingerprint=fp), "maths", kv_dtype="float64")
    try:
        # the intruder floods first: 2.5 MiB of chunks for made-up requests, under its own name
        # (its ACL refuses it any other: tests/system/test_broker_acl.py)
        for i in range(FLOOD):
            forged = P.encode(P.KVChunk(f"r-junk{i}", 0, 1, 1, b"j" * (64 << 10)), b"f" * 32)
            evil.publish(P.sun_kv_topic(DEC, EVIL), forged, "control")
        flood_held = lambda: sum(len(node._early.get(f"r-junk{i}")) for i in range(FLOOD))  # noqa: E731
        # each chunk held, or dropped: past the hold's quota, or (a loop slower than the flood,
        # as on a loaded machine) past the decoder's queue
        _until(lambda: flood_held() + node.dropped.get("early_overflow", 0) + node.dropped.get("kv_backlog", 0)
               == FLOOD, "flood handled")
        assert node.dropped["early_overflow"] > 0 and flood_held() * (64 << 10) <= node._early.quota_bytes

        def request(prompt, guess_rid: bool = False):
            """A request whose KV (and token 0) all come before its assignment."""
            h = client.submit("maths", prompt, max_new=MAX_NEW)
            out = prefill.prefill(prompt)
            pre.publish(P.sun_stream_topic(CLIENT, h.rid),
                        P.encode(P.SunTokens(h.rid, 0, 0, [out.first_token], worker=PRE), h.req.secret), "control")
            if guess_rid:                      # the intruder somehow learnt the request id
                evil.publish(P.sun_kv_topic(DEC, EVIL),
                             P.encode(P.KVChunk(h.rid, 0, 3, 1, b"x"), b"f" * 32), "control")
            n = 3
            for i in range(n):
                part = out.blob[i * len(out.blob) // n:(i + 1) * len(out.blob) // n]
                pre.publish(P.sun_kv_topic(DEC, PRE),
                            P.encode(P.KVChunk(h.rid, i, n, out.first_token, part), h.req.secret), "control")
            _until(lambda: len(node._early.get(h.rid)) == n + guess_rid, f"early KV held: {node.dropped}")
            assign = P.DecodeAssign(DEC, h.rid, CLIENT, h.req.secret, "maths", MAX_NEW, prefill=PRE)
            router.publish(P.sun_ctl_topic(DEC), P.encode(assign, KEY), "control")
            return h

        # a prefill worker no assignment has named yet: a stranger's quota of its own
        p1 = [5, 9, 13, 2, 7]
        assert request(p1).wait(20).tokens == split_generate(spec, base, [p1], max_new=MAX_NEW)[0]
        # named now; and the intruder's chunk for the same request is dropped, not decoded
        p2 = [11, 3, 8]
        assert request(p2, guess_rid=True).wait(20).tokens == split_generate(spec, base, [p2], max_new=MAX_NEW)[0]
        assert node.dropped.get("kv_wrong_sender") == 1, node.dropped
        assert node.stats["admitted"] == 2 and node.stats["timeouts"] == 0
        assert flood_held() > 0                # the flood is still held, in its own quota only
    finally:
        node.stop()
        client.close()
        for ln in links:
            ln.close()
