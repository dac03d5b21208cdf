"""The two SUN gaps of a clustered broker (issue 38), each played deterministically on an in-process
bus with the real router, prefill worker, decoder and client:

* a message to a worker lost on the way -- the decoder's KV while its link moves to another broker
  node, its KV lost without a move, its assignment lost -- and
* a request sent while no hub claims its client,

each ends with the in-process answer, every token handed out once and in order, the request
prefilled once unless its KV was lost, and nothing left held (the router's tables, the decoder's
reservations).
"""
from __future__ import annotations

import threading

import pytest

from edge.engines.torch_engine import TorchEngine
from edge.model.sun_modules import split_generate
from edge.sun.client import SAME_COPIES, SunClient
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import DecodeAssign, PrefillJob, ProtocolError, decode, sun_hello_topic
from harness.sun_star import KEY, prompts, sun_models
from harness.waiting import wait_until
from server.sun_router import SunRouter

MAX_NEW = 9


class LossyLink(MemoryLink):
    """A MemoryLink that loses the first delivered message `lose(msg)` picks; with `move`, its link
    also drops and comes back at that moment (a broker node died, the link moved to another)."""

    def __init__(self, bus, lose, move=False, every=False):
        """every: lose every message `lose` picks, not only the first."""
        super().__init__(bus)
        self.lose, self.move, self.every, self.lost = lose, move, every, []

    def _dispatch(self, topic, payload):
        if not self.lost or self.every:
            try:
                msg = decode(payload, KEY)                   # a control message (KV: by its topic)
            except ProtocolError:
                msg = None
            if self.lose(topic, msg, payload):
                self.lost.append(topic)
                if self.move:
                    self._set_up(False)
                    self._set_up(True)
                return
        super()._dispatch(topic, payload)


def is_kv(topic, msg, payload):
    return "/kv/" in topic


def is_assign(topic, msg, payload):
    return isinstance(msg, DecodeAssign)


@pytest.fixture(scope="module")
def models():
    return sun_models()


class Star:
    """Router, prefill worker, decoder and client on one MemoryBus; the decoder on `dec_link`."""

    def __init__(self, models, dec_link=None, owns=None, kv_timeout=60.0, claim_s=0.2, pre_link=None):
        self.base, self.fp, self.specs = models
        self.bus = MemoryBus()
        self.links = []
        self.router = SunRouter(self.link().connect(), ctl_key=KEY, owns=owns).start()
        self.router._routes.every = claim_s / 2          # re-deliveries at this test's pace (claim_s 0.2 s)
        worker = PrefillWorker(TorchEngine(self.specs["maths"], fingerprint=self.fp), "maths", kv_dtype="float64")
        pl = pre_link(self.bus) if pre_link else MemoryLink(self.bus)
        self.links.append(pl)
        self.prefill = self.node(lambda ln: PrefillNode(worker, ln, "pre", KEY, chunk_bytes=1500), pl)
        dec = SharedDecoder(TorchEngine(self.base, fingerprint=self.fp), max_batch=8, name="dec")
        dl = dec_link(self.bus) if dec_link else MemoryLink(self.bus)
        self.links.append(dl)
        self.decoder = self.node(lambda ln: DecoderNode(dec, ln, "dec", KEY, kv_timeout=kv_timeout), dl)
        assert wait_until(lambda: all(n in self.router.workers and self.router.workers[n].online
                                      for n in ("pre", "dec")))
        self.client = SunClient(self.link().connect(), "app", claim_s=claim_s).start()

    def link(self):
        ln = MemoryLink(self.bus)
        self.links.append(ln)
        return ln

    def node(self, make, ln):
        node = make(ln)
        ln.set_will(sun_hello_topic(node.id), node.will())
        ln.connect()
        return node.start()

    def run(self, prompt):
        """Submit `prompt`, wait for it; (result, handle, what on_token was handed)."""
        told = []
        h = self.client.submit("maths", prompt, max_new=MAX_NEW, on_token=lambda i, t: told.append((i, t)))
        return h.wait(20), h, told

    def expect(self, prompt):
        return split_generate(self.specs["maths"], self.base, [prompt], max_new=MAX_NEW)[0]

    def clean(self):
        r, d = self.router, self.decoder
        return (not any(r.inflight.values()) and not any(r.prefilling.values()) and not d._pending
                and not d._live and not d._early and d.load == 0 and self.prefill.load == 0)

    def close(self):
        self.client.close()
        for n in (self.prefill, self.decoder):
            n.stop()
        for ln in self.links:
            ln.close()


def test_kv_lost_while_the_decoders_link_moves_is_prefilled_again_at_once(models):
    star = Star(models, dec_link=lambda bus: LossyLink(bus, is_kv, move=True), kv_timeout=60.0)
    try:
        p = prompts(1, seed=31)[0]
        r, h, told = star.run(p)                 # well inside the decoder's 60 s KV timeout
        want = star.expect(p)
        assert star.decoder.link.lost, "no KV chunk was lost: the test did not play the fault"
        assert r.tokens == want and told == list(enumerate(want)), "a token lost, changed or repeated"
        assert h.resent == 1 and star.decoder.stats["kv_lost"] == 1 and star.decoder.stats["timeouts"] == 0
        assert star.prefill.stats["jobs"] == 2                     # prefilled again, under a new id
        assert wait_until(star.clean), "something is still held"
    finally:
        star.close()


def test_kv_lost_without_a_move_is_prefilled_again_at_the_first_copy(models):
    """The client hears token 0 and nothing after, and sends a copy: the prefill worker, whose KV went
    out, tells the decoder after it on the same topic; the decoder, missing a chunk, fails the request
    at once (kv_lost), not after its KV timeout."""
    star = Star(models, dec_link=lambda bus: LossyLink(bus, is_kv), kv_timeout=60.0)
    try:
        p = prompts(1, seed=37)[0]
        r, h, told = star.run(p)
        want = star.expect(p)
        assert star.decoder.link.lost
        assert r.tokens == want and told == list(enumerate(want))
        assert h.resent == 1 and star.decoder.stats["kv_lost"] == 1 and star.decoder.stats["timeouts"] == 0
        assert wait_until(star.clean)
    finally:
        star.close()


def test_an_assignment_and_its_kv_lost_while_the_decoder_is_away_hold_no_reservation(models):
    """As a RabbitMQ node's kill -9 played it in make test (the decoder's link moving): the assignment
    and the KV of a request are both lost while the decoder's link is down. The client's copy brings
    the assignment again (a reservation, first seen there) and the prefill worker's word that the KV
    went out: the decoder fails it at once, the client sends it under a new id, and no reservation
    waits out the 60 s KV timeout (it did, and a test waiting 90 s for idle workers failed)."""
    star = Star(models, kv_timeout=60.0)
    try:
        p = prompts(1, seed=53)[0]
        want = star.expect(p)
        link = star.decoder.link
        link._set_up(False)                                   # away: whatever comes for it is lost
        told = []
        h = star.client.submit("maths", p, max_new=MAX_NEW, on_token=lambda i, t: told.append((i, t)))
        assert wait_until(lambda: star.prefill.stats["jobs"] == 1), "the prefill worker never delivered"
        link._set_up(True)                                    # back (moved): nothing pending to fail
        r = h.wait(20)
        assert r.tokens == want and told == list(enumerate(want))
        assert h.resent == 1 and star.decoder.stats["kv_lost"] == 1 and star.decoder.stats["timeouts"] == 0
        assert star.prefill.stats["jobs"] == 2
        assert wait_until(star.clean, 10), f"held: {sorted(star.decoder._pending)}"
    finally:
        star.close()


def test_an_assignment_lost_on_the_way_is_delivered_again_and_claims_the_early_kv(models):
    star = Star(models, dec_link=lambda bus: LossyLink(bus, is_assign))
    try:
        p = prompts(1, seed=41)[0]
        r, h, told = star.run(p)
        want = star.expect(p)
        assert star.decoder.link.lost
        assert r.tokens == want and told == list(enumerate(want))
        # the same request again: never routed twice, its assignment went again, its prefill ran once
        assert h.resent == 0 and h.reasked >= 1
        assert star.router.counters["routed"] == 1 and star.router.counters.get("redelivered", 0) >= 1
        assert star.prefill.stats["jobs"] == 1 and star.decoder.stats["admitted"] == 1
        assert wait_until(star.clean)
    finally:
        star.close()


def test_a_request_sent_while_no_hub_claims_its_client_is_routed_once_claimed(models):
    claimed = threading.Event()
    star = Star(models, owns=lambda client: claimed.is_set())
    try:
        p = prompts(1, seed=43)[0]
        told = []
        h = star.client.submit("maths", p, max_new=MAX_NEW, on_token=lambda i, t: told.append((i, t)))
        # nobody routes it (a starting hub claims its clients late; a dead hub's when its will comes)
        assert wait_until(lambda: star.router.counters.get("left_to_its_hub", 0) >= 2)
        claimed.set()
        r = h.wait(20)
        want = star.expect(p)
        assert r.tokens == want and told == list(enumerate(want))
        assert h.resent == 0 and h.reasked >= 2
        assert star.router.counters["routed"] == 1 and star.prefill.stats["jobs"] == 1
        assert wait_until(star.clean)
    finally:
        star.close()


def test_a_request_whose_copies_bring_nothing_is_sent_under_a_new_id(models):
    """A loss no worker still counts as held (every copy of the job lost here): after SAME_COPIES
    copies the client gives it a new id, which is routed afresh."""
    first = []

    def first_job(topic, msg, payload):
        if isinstance(msg, PrefillJob):
            first.append(msg.rid) if not first else None
            return msg.rid == first[0]
        return False
    star = Star(models, pre_link=lambda bus: LossyLink(bus, first_job, every=True), kv_timeout=1.0)
    try:
        p = prompts(1, seed=47)[0]
        r, h, told = star.run(p)
        want = star.expect(p)
        assert len(star.prefill.link.lost) >= 2, "the job's copies were not lost: the fault was not played"
        assert r.tokens == want and told == list(enumerate(want))
        assert h.resent == 1 and h.reasked == SAME_COPIES and star.router.counters["routed"] == 2
        assert star.prefill.stats["jobs"] == 1
        # the first id's reservation at the decoder (its KV never comes) ends with the KV timeout
        assert wait_until(star.clean) and star.decoder.stats["timeouts"] == 1
    finally:
        star.close()


def test_jobs_held_behind_a_long_prefill_step_are_waited_for_not_sent_under_a_new_id(models):
    """A burst of long prompts holds jobs at their prefill worker for minutes: one in the step now
    running, the next still in the loop's inbox. Their client's copies are answered "held" from the
    link's thread, so the client keeps waiting; each job is prefilled once, none under a new id."""
    star = Star(models)
    gate, stepping = threading.Event(), threading.Event()
    worker = star.prefill.loop.core
    step = worker.step

    def held_step():
        stepping.set()
        assert gate.wait(60), "the test never released the prefill step"
        return step()
    worker.step = held_step
    try:
        ps = prompts(2, seed=53)
        told = [[], []]
        first = star.client.submit("maths", ps[0], max_new=MAX_NEW, on_token=lambda i, t: told[0].append((i, t)))
        assert stepping.wait(20)                          # the first job is in the step now held open
        second = star.client.submit("maths", ps[1], max_new=MAX_NEW, on_token=lambda i, t: told[1].append((i, t)))
        # without the answers the client would have given up on each job after SAME_COPIES copies
        assert wait_until(lambda: min(h.reasked for h in (first, second)) >= SAME_COPIES + 2
                          or first.resent or second.resent, 30)
        assert first.resent == second.resent == 0 and star.prefill.dropped.get("replay", 0) >= 2 * SAME_COPIES
        gate.set()
        for h, p, got in zip((first, second), ps, told):
            r = h.wait(20)
            want = star.expect(p)
            assert r.tokens == want and got == list(enumerate(want)) and r.workers == ["pre", "dec"]
        assert star.prefill.stats["jobs"] == 2 and star.router.counters["routed"] == 2
        assert wait_until(star.clean) and not star.prefill._held
    finally:
        gate.set()
        star.close()


def test_a_job_answered_whose_kv_waits_behind_the_decoders_step_is_waited_for_not_prefilled_again(models):
    """The split layout's burst: a prefill worker answers a job (token 0 and its KV sent) while its
    decoder is busy in a step, the KV queued behind it. Its client's copies are answered "held" (by the
    prefill worker that answered it lately, or the decoder that has its assignment and queued KV), so it
    keeps waiting; the job is prefilled once (it was prefilled again under a new id: 31 jobs for 17)."""
    star = Star(models)
    gate, kv_waits = threading.Event(), threading.Event()
    handle = star.decoder.handle

    def held_kv(kind, msg):
        if kind == "kv":
            kv_waits.set()
            assert gate.wait(60), "the test never released the decoder"
        return handle(kind, msg)
    star.decoder.handle = held_kv
    try:
        p = prompts(1, seed=59)[0]
        told = []
        h = star.client.submit("maths", p, max_new=MAX_NEW, on_token=lambda i, t: told.append((i, t)))
        assert kv_waits.wait(20) and wait_until(lambda: star.prefill.stats["jobs"] == 1)
        assert wait_until(lambda: h.reasked >= SAME_COPIES + 2 or h.resent, 30)
        assert h.resent == 0
        gate.set()
        r = h.wait(20)
        want = star.expect(p)
        assert r.tokens == want and told == list(enumerate(want)) and r.workers == ["pre", "dec"]
        assert star.prefill.stats["jobs"] == 1 and star.router.counters["routed"] == 1
        assert wait_until(star.clean)
    finally:
        gate.set()
        star.close()
