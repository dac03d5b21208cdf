"""SUN admission is bounded everywhere a request can wait (the load test found none of it was):
the shared decoder's running + waiting sequences (max_sequences), the decoder node's
assignments on top of them, the router's choice of decoder, and a prefill worker's queue.
Past each: a clean `overloaded` with its reason, and nothing held. Driven by hand, without
the loops' threads: every count is exact."""
from __future__ import annotations

import pytest
import torch

from edge.wire import protocol as P
from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.sun.decoder import DecoderFull, SharedDecoder
from edge.sun.decoder_node import DecoderNode, size
from edge.sun.prefill import PrefillWorker
from edge.sun.prompt_queue import QueueFull
from edge.sun.prefill_node import PrefillNode
from server.sun_router import SunRefusal, SunRouter
from harness.tiny_models import random_model
from harness.waiting import wait_until

torch.set_num_threads(1)
FP = "fp"


@pytest.fixture(scope="module")
def base():
    return random_model()


def blob(base, prompt=(5, 6, 7), rid="r"):
    w = PrefillWorker(TorchEngine(base, fingerprint=FP), "maths", kv_dtype="float64")
    return w.prefill(list(prompt), request_id=rid).blob


def test_the_decoder_holds_at_most_max_sequences_running_and_waiting(base):
    eng = TorchEngine(base, fingerprint=FP)
    eng.capacity = 1                                  # llama.cpp-like: one slot, the rest wait
    dec = SharedDecoder(eng, max_batch=1, max_sequences=2)
    dec.admit(blob(base), "a", max_new=3, first_token=1)
    dec.admit(blob(base), "b", max_new=3, first_token=1)
    assert (len(dec._run), len(dec._waiting)) == (1, 1)
    with pytest.raises(DecoderFull, match="limit of 2 sequences"):
        dec.admit(blob(base), "c", max_new=3, first_token=1)
    assert dec.load == 2 and dec.refused == 1 and eng.active_sequences == 1
    dec.run()                                         # both finish: room again
    dec.admit(blob(base), "c", max_new=3, first_token=1)
    assert dec.load == 1


class Decoder:
    """A decoder node on a memory bus whose client stream topics the test reads."""

    def __init__(self, base, max_sequences=1, max_pending_mb=1024.0):
        self.bus = MemoryBus()
        dec = SharedDecoder(TorchEngine(base, fingerprint=FP), max_batch=2, max_sequences=max_sequences, name="dec")
        self.node = DecoderNode(dec, MemoryLink(self.bus, "dec").connect(), "dec", max_pending_mb=max_pending_mb)
        self.seen = []
        watch = MemoryLink(self.bus, "client").connect()
        watch.subscribe("#", lambda t, p: self.seen.append((t, p)))

    def assign(self, rid):
        a = P.DecodeAssign("dec", rid, "client", rid.encode() * 16, "maths", prefill="pre")
        self.node._assign(a)
        return a

    def errors(self, rid):
        """What the client heard on `rid`'s stream (waits for the bus to deliver it)."""
        def got():
            topic = P.sun_stream_topic("client", rid)
            return [P.decode(p, rid.encode() * 16) for t, p in list(self.seen) if t == topic]
        wait_until(got, 5)
        return got()


def test_an_assignment_past_the_decoders_limit_is_refused_at_once_and_its_kv_dropped(base):
    d = Decoder(base, max_sequences=1)
    d.assign("r-1")                                   # awaits its KV: that holds the one place
    assert d.node.load == 1 and d.node.status().max_load == 1
    a = d.assign("r-2")
    err, = d.errors("r-2")
    assert err.code == P.E_OVERLOADED and "holds its limit of 1 sequences" in err.message
    assert d.node.stats["overloaded"] == 1 and "r-2" not in d.node._pending and d.node.served == 2
    d.node._kv(P.encode(P.KVChunk("r-2", 0, 1, 1, b"k" * 64), a.secret), "pre")   # its KV comes anyway
    assert d.node.dropped == {"kv_turned_away": 1} and d.node.load == 1


def test_the_kv_in_transit_limit_names_its_size_below_one_mib(base):
    assert (size(256 << 10), size(3 << 20), size(1536 << 20), size(100)) == ("256 KiB", "3 MiB", "1.5 GiB",
                                                                          "100 bytes")
    d = Decoder(base, max_sequences=8, max_pending_mb=0.25)
    a = d.assign("r-big")
    d.node._kv(P.encode(P.KVChunk("r-big", 0, 2, 1, b"k" * (300 << 10)), a.secret), "pre")
    err, = d.errors("r-big")
    assert err.code == P.E_OVERLOADED and "(256 KiB)" in err.message, err.message


def test_the_router_passes_over_a_full_decoder_and_refuses_when_all_are(base):
    r = SunRouter(MemoryLink(MemoryBus(), "router").connect())
    pre = P.SunHello("pre", "prefill", "maths", FP, 256)
    for load_a, load_b in ((0, 0), (4, 1)):          # twice: a probe, then the answer proves it alive
        for h in (pre, P.SunHello("a", "decoder", "", FP, 256, load=load_a, max_load=4),
                  P.SunHello("b", "decoder", "", FP, 256, load=load_b, max_load=2)):
            r.update_worker(h)
    assert r.route("maths")[1].id == "b"             # a is at its limit, b has room for one
    with pytest.raises(SunRefusal) as e:             # b's one place is now taken (sent, not yet counted)
        r.route("maths")
    assert e.value.code == P.E_OVERLOADED and "a 4/4, b 2/2" in e.value.reason


def test_a_prefill_worker_queues_at_most_max_queue_and_refuses_cleanly(base):
    w = PrefillWorker(TorchEngine(base, fingerprint=FP), "maths", kv_dtype="float64", max_queue=2)
    bus = MemoryBus()
    node = PrefillNode(w, MemoryLink(bus, "pre").connect(), "pre")
    seen = []
    MemoryLink(bus, "watch").connect().subscribe("#", lambda t, p: seen.append(t))
    for i in range(3):
        node.handle("ctl", P.PrefillJob("pre", f"r{i}", "client", b"s" * 32, "maths", [5, 6], decoder="dec"))
    assert w.load == 2 and node.stats["overloaded"] == 1 and set(node._jobs) == {"r0", "r1"}
    with pytest.raises(QueueFull):
        w.submit([5], "x")
    # the client hears it, and the decoder's reservation is released
    assert wait_until(lambda: {P.sun_stream_topic("client", "r2"), P.sun_kv_topic("dec", "pre")} <= set(seen), 5)
