"""SUN's hand-over with a seed: the prefill worker and the shared decoder draw independent streams.

The prefill worker samples the first answer token, the decoder the second. Had
both seeded a generator with the request's bare seed, the two tokens would
come from the same uniform (strongly correlated). With tiny table engines
(their KV blob carries the token ids) the exact law of the first two tokens is
P(t1 | prompt; specialist) * P(t2 | prompt, t1; decoder), compared by a
chi-square test at alpha=1e-4 in process and through the SUN star on the
in-memory bus; a negative control restores the shared stream and must fail.
"""
import itertools
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import edge.sun.decoder as decoder_mod
import edge.sun.prefill as prefill_mod
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import sampling, sun_hello_topic
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.sun.client import SunClient
from edge.speculative.sampling import SamplingParams, to_probs
from server.sun_router import SunRouter

from harness.table_engine import TableEngine
from harness.goodness_of_fit import chi_square, critical_value

FP = "table-decoder"
PROMPT = [1, 3, 0]
HOT = SamplingParams(temperature=1.0)
KEY = b"s" * 32


class KVTable(TableEngine):
    """A table model (whole context) that exports and imports KV blobs; the blob's
    header carries the tokens, which is all this model's 'KV' is."""

    cfg = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)

    def __init__(self, seed):
        super().__init__(vocab=4, rows=4099, seed=seed, window=None, max_len=64)
        self.fingerprint = FP                 # a specialist names the decoder it was tuned for

    @property
    def active_sequences(self):
        return len(self._seqs)

    def export_kv(self, seq, dtype="float16", meta=None):
        toks = self._known(self._seqs, seq)
        return self._blob(np.zeros((1, 2, 1, len(toks), 1)), toks, dtype, meta)

    def import_kv(self, blob):
        _, head = self._read_kv_array(blob)
        seq = self.new_sequence()
        self._seqs[seq] = list(head["tokens"])
        return seq


def engines():
    return KVTable(seed=11), KVTable(seed=12)       # the specialist's prefill module, the decoder


def exact(prefill, decoder):
    p1 = to_probs(prefill.row(PROMPT), HOT)
    return {(a, b): p1[a] * to_probs(decoder.row(PROMPT + [a]), HOT)[b]
            for a, b in itertools.product(range(4), repeat=2)}


def fit(counts, prefill, decoder, n):
    stat, df = chi_square(counts, exact(prefill, decoder), n)
    return stat, df, critical_value(df)


def shared_stream(monkeypatch):
    """The bug: prefill and decoder both seed a generator with the bare request seed."""
    bare = lambda seed, role, *extra: np.random.default_rng(seed)  # noqa: E731
    for mod in (prefill_mod, decoder_mod):
        monkeypatch.setattr(mod, "role_rng", bare)


def in_process(n):
    pre, dec_engine = engines()
    worker = PrefillWorker(pre, "maths", kv_dtype="float32")
    dec = SharedDecoder(dec_engine, max_batch=64)
    counts = {}
    for i in range(n):
        params = SamplingParams(temperature=1.0, seed=20_000 + i)
        out = worker.prefill(PROMPT, request_id=f"r{i}", params=params)
        dec.admit(out.blob, max_new=2, params=params)
        if (i + 1) % 64 == 0 or i + 1 == n:            # decode in batches, as the role does
            for r in dec.run().values():
                counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
            dec.results.clear()
    assert sum(counts.values()) == n
    return fit(counts, pre, dec_engine, n)


N = 6000


def test_seeded_prefill_to_decoder_hand_over_is_exact():
    stat, df, crit = in_process(N)
    print(f"SUN in process: chi2={stat:.1f} df={df} crit={crit:.1f}")
    assert df >= 12, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): the first two tokens are not the model's law"


def test_negative_control_shared_stream_fails(monkeypatch):
    shared_stream(monkeypatch)
    stat, df, crit = in_process(N // 3)
    print(f"SUN shared stream: chi2={stat:.1f} df={df} crit={crit:.1f}")
    assert stat > crit, f"the shared stream passed (chi2={stat:.1f} < {crit:.1f}): the test has no power"


def sun_star(bus):
    """Router, one prefill worker, one shared decoder and a client on the memory bus."""
    pre, dec_engine = engines()
    nodes, links = [], []

    def link(name):
        ln = MemoryLink(bus, f"{name}-{os.getpid()}")
        links.append(ln)
        return ln
    router = SunRouter(link("router").connect(5), ctl_key=KEY).start()
    for name, make in (("prefill-maths", lambda ln: PrefillNode(PrefillWorker(pre, "maths", "float32"), ln,
                                                                 "prefill-maths", KEY)),
                       ("dec-a", lambda ln: DecoderNode(SharedDecoder(dec_engine, max_batch=16), ln, "dec-a", KEY))):
        ln = link(name)
        node = make(ln)
        ln.set_will(sun_hello_topic(name), node.will())
        ln.connect(5)
        nodes.append(node.start())
    client = SunClient(link("client").connect(5), "client").start()
    return SimpleNamespace(router=router, nodes=nodes, links=links, client=client, pre=pre, dec=dec_engine)


@pytest.mark.parametrize("shared", [False, True], ids=["own-streams", "negative-control"])
def test_seeded_hand_over_through_the_sun_star(monkeypatch, shared):
    if shared:
        shared_stream(monkeypatch)
    n = N if not shared else N // 3
    star = sun_star(MemoryBus())
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and not {"prefill-maths", "dec-a"} <= {
                w for w, s in star.router.workers.items() if s.online}:
            time.sleep(0.01)
        counts = {}
        for i in range(0, n, 50):                        # 50 requests in flight at a time
            hs = [star.client.submit("maths", PROMPT, max_new=2,
                                     sampling=sampling(temperature=1.0, seed=30_000 + j))
                  for j in range(i, min(n, i + 50))]
            for h in hs:
                r = h.wait(20)
                assert r.workers == ["prefill-maths", "dec-a"], r.workers
                counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
                star.client.forget(h.rid)
    finally:
        star.client.close()
        for node in star.nodes:
            node.stop()
        star.router.stop()
        for ln in star.links:
            ln.close()
    stat, df, crit = fit(counts, star.pre, star.dec, n)
    print(f"SUN star shared={shared}: chi2={stat:.1f} df={df} crit={crit:.1f}")
    if shared:
        assert stat > crit, f"the shared stream passed (chi2={stat:.1f} < {crit:.1f}): the test has no power"
    else:
        assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): SUN's seeded hand-over is not exact"
