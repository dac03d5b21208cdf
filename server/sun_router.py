"""SUN routing at the hub: a request goes to its task's prefill worker, its KV to the least-loaded decoder.

The router only moves small control messages; KV caches go from the prefill
worker straight to the chosen decoder and tokens from the workers straight to
the client (edge/sun/prefill_node.py has the flow). For each SunRequest it

1. picks a prefill worker serving the task (server/sun_placement.py has the rules) -- a
   full-copy specialist announcing it, or a worker with adapters listing it in its hello's
   tasks -- the least loaded (as for decoders, ties by id: with equal loads a task always
   lands on the same worker);
2. picks a decoder among the online ones whose fingerprint is the one that
   prefill module was tuned for (model-agnostic otherwise): the least loaded,
   load = what the decoder last reported (running + awaited sequences) plus
   assignments sent since that it had not yet counted (SunHello.served);
   a decoder at the limit its hello names (max_load: its max_sequences) is
   passed over, and with every fitting one there the request is refused
   `overloaded` at once (the decoder refuses past it too: the backstop);
3. sends DecodeAssign to the decoder first, then PrefillJob to the prefill
   worker, so the reservation normally reaches the decoder before the KV.

`isolated=True` is the conventional baseline on the same code: each task owns
its own decoder(s) — `pools` names them ({task: [decoder ids]}), otherwise a
task binds one free decoder the first time it is asked for (sticky until that
decoder goes offline). A request that cannot be routed is answered at once,
on its own topic and signed with its own secret, with an Error saying what to
start (unknown_task, no_decoder, bad_request). When a decoder goes offline (its
will) the requests it may still hold are answered with worker_lost at once, so
their clients can resend instead of waiting out a timeout; when a prefill
worker does, so are the requests it had not yet prefilled, and their decoders'
reservations are released. A request is routed once: a copy of it (the same id; a SunClient
sends one when it hears nothing for a while) is not routed again, but its job and assignment go
again to the workers still holding it, in case one was lost on the way (server/sun_routes.py).
A worker is routed to only while
server/liveness.py says it is alive: a retained hello is not enough until the
worker answers a probe, and silence or a job it never acknowledges ends it
like its will (`sweep()`, which the hub runs every status period).

A router routes only the pool it can authenticate: a hello signed with a control key it does not
have (or, with a key, one not signed with it) is another deployment's worker -- counted, neither
probed nor routed to (a keyed worker drops what it cannot check). Until it has heard a worker of its own, a router that
has heard such foreign ones leaves SUN requests unanswered: their own router answers them, and a
second one would refuse each as unknown_task first (a StarSD hub on a broker it shares with a
keyed SUN pool). With no hello at all it refuses them as before, saying what to start.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import msgpack

from edge.wire.link import Link
from edge.wire.protocol import (E_BAD_REQUEST, E_WORKER_LOST,
                           SUN_REQ_SUB, SUN_WORKERS_SUB, DecodeAssign, Error, PrefillJob, Probe, ProtocolError, SunHello,
                           SunRequest, decode, encode, parse_topic, sun_ctl_topic, sun_kv_topic, sun_stream_topic)
from edge.wire.seen_ids import SeenIds
from server.liveness import Liveness
from server.sun_placement import (SunRefusal, WorkerInfo, decoders_for, following_grammars, isolated_pool,
                                  least_loaded, pick_prefill)
from server.sun_routes import RecentRoutes

log = logging.getLogger(__name__)
INFLIGHT_MAX = 4096             # requests remembered per decoder for worker_lost
# a worker idle this long after our last job that still has not counted every job we sent it never
# got them (a link that moved lost them; their clients send them again): our count follows its own
LOST_AFTER_S = 5.0
FOREIGN_MAX = 1024              # foreign workers remembered (a flood of hellos must not grow it)


def _signed(payload: bytes) -> bool:
    """Whether a (decoded, so well-formed) control message carries an HMAC."""
    env = msgpack.unpackb(payload, raw=False)
    return isinstance(env, dict) and bool(env.get("h"))


class SunRouter:
    """Start with `start()` on the hub's link (its filters do not overlap StarSD's)."""

    def __init__(self, link: Link, *, isolated: bool = False, pools: Optional[Dict[str, List[str]]] = None,
                 ctl_key: Optional[bytes] = None, liveness: Optional[Liveness] = None,
                 owns: Optional[Callable[[str], bool]] = None):
        """owns(client): whether this router's hub serves the client, of several hubs (None: one hub)."""
        if pools and not isolated:
            raise ValueError("pools (a decoder pool per task) only apply with isolated=True")
        self.link, self.isolated, self.ctl_key, self.owns = link, isolated, ctl_key, owns
        self.pools = {t: list(d) for t, d in (pools or {}).items()}
        self.workers: Dict[str, WorkerInfo] = {}
        self.bindings: Dict[str, str] = {}                # isolated, automatic: task -> decoder
        self.counters: Dict[str, int] = {"requests": 0, "routed": 0, "dropped": 0}
        self.routed: Dict[str, Dict[str, int]] = {}       # task -> decoder -> requests
        self._seen = SeenIds()                            # (client, rid) recently routed: replays dropped
        self._routes = RecentRoutes()                     # ... and where they went (a client's copy: again)
        # decoder -> {(client, rid): secret}: what it may still be decoding. Cleared when its hello
        # says it took all we sent and runs nothing; failed (worker_lost) when it goes offline.
        self.inflight: Dict[str, Dict[Tuple[str, str], bytes]] = {}
        # prefill worker -> {(client, rid): (secret, decoder)}: jobs it may not have prefilled yet
        self.prefilling: Dict[str, Dict[Tuple[str, str], Tuple[bytes, str]]] = {}
        self.liveness = liveness or Liveness()
        self.foreign: set = set()                         # hello topics of workers we cannot authenticate
        self._own = False                                 # heard a worker of our own pool
        self._lock = threading.RLock()

    # ---- lifecycle ----
    def start(self) -> "SunRouter":
        self.link.on_connection(lambda up: up and self.liveness.forget_probes())
        self.link.subscribe(SUN_WORKERS_SUB, self._on_hello)
        self.link.subscribe(SUN_REQ_SUB, self._on_request)
        return self

    def stop(self) -> None:
        self.link.unsubscribe(SUN_REQ_SUB)
        self.link.unsubscribe(SUN_WORKERS_SUB)

    # ---- workers ----
    def _on_hello(self, topic: str, payload: bytes) -> None:
        if not payload:
            return                                        # a cleared retained message
        try:
            _, ids = parse_topic(topic)
            h = decode(payload, self.ctl_key)
        except ProtocolError as e:
            self._count(f"bad_hello_{e.code}")
            if e.code == "auth":
                self._foreign(topic)
            return
        if not isinstance(h, SunHello) or h.worker != ids.get("worker"):
            self._count("bad_hello")
            return
        if self.ctl_key is None and _signed(payload):
            self._foreign(topic)
            return
        self.update_worker(h)

    def _foreign(self, topic: str) -> None:
        with self._lock:
            new = topic not in self.foreign and len(self.foreign) < FOREIGN_MAX
            if new:
                self.foreign.add(topic)
        self._count("foreign_hello")
        if new:
            log.warning("sun: %s is signed with another control key than this router's (%s): not routed to; "
                        "its own router serves it, or give both the same --ctl-key-file", topic,
                        "none" if self.ctl_key is None else "a key")

    def update_worker(self, h: SunHello) -> None:
        """Take a worker's report (also for workers in the hub's own process)."""
        if self.liveness.heard(h.worker, h.online):        # not proven alive yet: ask it
            self.link.publish(sun_ctl_topic(h.worker), encode(Probe(h.worker), self.ctl_key), kind="control")
        alive = self.liveness.alive(h.worker)
        with self._lock:
            self._own = True
            w = self.workers.get(h.worker)
            if w is None and not alive:
                return                                    # a retained hello, maybe a dead worker's
            if w is None or (w.role, w.fingerprint) != (h.role, h.fingerprint):
                w = WorkerInfo(h.worker, h.role, h.task, h.fingerprint, h.vocab_size)
                self.workers[h.worker] = w
                self._unbind(h.worker)
            w.task, w.tasks = h.task, tuple(h.tasks) or ((h.task,) if h.task else ())   # adapters come and go
            w.grammars = h.grammars
            if h.served < w.served or h.served > w.sent:
                w.sent = h.served                         # it restarted, or we did
            was_online = w.online
            w.vocab_size, w.online, w.load, w.capacity = h.vocab_size, alive, h.load, h.capacity
            w.max_load = h.max_load
            w.served, w.seen = h.served, time.monotonic()
            if alive and h.load == 0 and h.served < w.sent and time.monotonic() - w.sent_at > LOST_AFTER_S:
                w.sent = h.served                         # idle, and never got them: lost on the way
            if alive and h.load == 0 and h.served >= w.sent:
                self.inflight.pop(h.worker, None)         # it took everything we sent and runs nothing
                self.prefilling.pop(h.worker, None)
        if not alive and (was_online or not h.online):
            self._lost(h.worker, "went offline")

    def sweep(self) -> List[str]:
        """Workers found dead by silence or an unacknowledged job: handled like their will."""
        dead = self.liveness.sweep()
        for name in dead:
            with self._lock:
                w = self.workers.get(name)
                if w is not None:
                    w.online = False
            self._lost(name, "stopped answering")
        return dead

    def _lost(self, worker: str, how: str) -> None:
        """`worker` is gone: fail what it held at once (its clients may resend), free reservations."""
        with self._lock:
            self._unbind(worker)
            w = self.workers.get(worker)
            if w is not None:
                w.sent = w.served                         # what it had not taken is failed below
            decoding = self.inflight.pop(worker, {})
            prefilling = self.prefilling.pop(worker, {})
            for (client, rid), (_, dec) in prefilling.items():
                self.inflight.get(dec, {}).pop((client, rid), None)
        for (client, rid), secret in decoding.items():    # their tokens will never come: say so now
            self._fail(client, rid, secret, f"decoder {worker} {how} mid-request; send it again")
        for (client, rid), (secret, dec) in prefilling.items():
            self._fail(client, rid, secret, f"prefill worker {worker} {how} before the KV cache was "
                                            "sent; send it again")
            # the decoder's reservation for this KV: released now, not after its KV timeout
            err = Error(rid, 0, E_WORKER_LOST, f"prefill worker {worker} {how}")
            # (as the lost prefill worker's sender: the KV the decoder awaits is that worker's)
            self.link.publish(sun_kv_topic(dec, worker), encode(err, secret), kind="control")

    def _fail(self, client: str, rid: str, secret: bytes, message: str) -> None:
        self._count("worker_lost")
        msg = Error(rid, 0, E_WORKER_LOST, message)
        self.link.publish(sun_stream_topic(client, rid), encode(msg, secret), kind="control")

    def _unbind(self, decoder: str) -> None:
        for t in [t for t, d in self.bindings.items() if d == decoder]:
            del self.bindings[t]

    # ---- routing ----
    def route(self, task: str, grammar: bool = False) -> Tuple[WorkerInfo, WorkerInfo]:
        """(prefill, decoder) for a request of `task`, counted as sent; or raise SunRefusal.
        grammar: the request has one, so both must follow grammars."""
        with self._lock:
            prefill = self._prefill_for(task, grammar)
            dec = self._decoder_for(task, prefill.fingerprint, grammar)
            prefill.sent += 1
            dec.sent += 1
            prefill.sent_at = dec.sent_at = time.monotonic()
            self.liveness.owe(prefill.id)                 # each must acknowledge it in its next hello
            self.liveness.owe(dec.id)
            return prefill, dec

    def tasks(self) -> List[str]:
        """The tasks some online prefill worker serves (what a front end can offer)."""
        with self._lock:
            return sorted({t for w in self._online("prefill") for t in w.tasks})

    def _online(self, role: str) -> List[WorkerInfo]:
        return sorted((w for w in self.workers.values()
                       if w.online and w.role == role and self.liveness.alive(w.id)), key=lambda w: w.id)

    def _prefill_for(self, task: str, grammar: bool = False) -> WorkerInfo:
        online = self._online("prefill")
        if grammar:
            online = following_grammars([w for w in online if task in w.tasks], task, "prefill worker") \
                if any(task in w.tasks for w in online) else online   # none serves it: unknown_task below
        return pick_prefill(online, task)

    def _decoder_for(self, task: str, fp: str, grammar: bool = False) -> WorkerInfo:
        fits = decoders_for(self._online("decoder"), task, fp)
        if self.isolated:
            fits = isolated_pool(task, fits, self.pools, self.bindings)
        if grammar:
            fits = following_grammars(fits, task, "decoder")
        return least_loaded(fits, task)

    def _on_request(self, topic: str, payload: bytes) -> None:
        self._count("requests")
        with self._lock:
            other = self.foreign and not self._own
        if other:
            self._count("left_to_their_router")          # a pool of another key: its router answers
            return
        try:
            _, ids = parse_topic(topic)
            req = decode(payload)
        except ProtocolError as e:
            self._count(f"bad_request_{e.code}")
            return
        if not isinstance(req, SunRequest) or req.client != ids.get("client"):
            self._count("bad_request")                   # a request must come from its own client's topic
            return
        if self.owns is not None and not self.owns(req.client):
            self._count("left_to_its_hub")               # of several hubs, the client's owner routes it
            return
        with self._lock:
            fresh = self._seen.add((req.client, req.rid))
        if not fresh:
            self._again(req)
            return
        try:
            self._check(req)
            prefill, dec = self.route(req.task, bool(req.grammar))
        except SunRefusal as r:
            self._count(f"refused_{r.code}")
            log.info("sun: refused %s/%s: %s", req.client, req.rid, r.reason)
            self.link.publish(sun_stream_topic(req.client, req.rid),
                              encode(Error(req.rid, 0, r.code, r.reason[:1024]), req.secret), kind="control")
            return
        self._deliver(req, prefill.id, dec.id, assign=True, job=True)
        with self._lock:
            self._routes.add((req.client, req.rid), req.secret, prefill.id, dec.id)
            held = self.inflight.setdefault(dec.id, {})
            held[(req.client, req.rid)] = req.secret
            if len(held) > INFLIGHT_MAX:                  # a decoder that never reports idle: bound it
                del held[next(iter(held))]
            jobs = self.prefilling.setdefault(prefill.id, {})
            jobs[(req.client, req.rid)] = (req.secret, dec.id)
            if len(jobs) > INFLIGHT_MAX:
                del jobs[next(iter(jobs))]
            self.counters["routed"] += 1
            per = self.routed.setdefault(req.task, {})
            per[dec.id] = per.get(dec.id, 0) + 1

    def _deliver(self, req: SunRequest, prefill: str, dec: str, assign: bool, job: bool,
                 kv_sent: bool = False) -> None:
        """The decoder's reservation first, then the prefill worker's job (see the module docstring).
        kv_sent: the prefill worker is done with it (an assignment sent again alone)."""
        if assign:
            a = DecodeAssign(dec, req.rid, req.client, req.secret, req.task, req.max_new, req.sampling,
                             req.stop, prefill=prefill, grammar=req.grammar, logprobs=req.logprobs,
                             kv_sent=kv_sent)
            self.link.publish(sun_ctl_topic(dec), encode(a, self.ctl_key), kind="control")
        if job:
            j = PrefillJob(prefill, req.rid, req.client, req.secret, req.task, req.prompt, req.sampling,
                           decoder=dec, grammar=req.grammar, logprobs=req.logprobs)
            self.link.publish(sun_ctl_topic(prefill), encode(j, self.ctl_key), kind="control")

    def _again(self, req: SunRequest) -> None:
        """A request routed before: its client's copy (it heard nothing), or a replay. Never routed
        twice; its own client's copy goes again to the workers that still hold it (server/sun_routes.py)."""
        key = (req.client, req.rid)
        with self._lock:
            r = self._routes.get(key, req.secret)
            dec = r is not None and key in self.inflight.get(r.decoder, {})
            job = r is not None and key in self.prefilling.get(r.prefill, {})
            due = (dec or job) and self._routes.due(r)
        if not (dec or job):
            self._count("replay")                        # not ours, not its secret, or over
            return
        self._count("resent")
        if due:
            self._count("redelivered")
            log.info("sun: %s/%s sent again by its client: its %s goes again", req.client, req.rid,
                     " and ".join(n for n, x in (("assignment", dec), ("job", job)) if x))
            self._deliver(req, r.prefill, r.decoder, assign=dec, job=job, kv_sent=not job)

    def _check(self, req: SunRequest) -> None:
        if not req.prompt:
            raise SunRefusal(E_BAD_REQUEST, "empty prompt: a SUN request needs at least one prompt token")
        with self._lock:
            pre = [w for w in self._online("prefill") if req.task in w.tasks]
        if pre and max(req.prompt + req.stop) >= pre[0].vocab_size:
            raise SunRefusal(E_BAD_REQUEST, f"token id {max(req.prompt + req.stop)} is outside the "
                                            f"vocabulary of task {req.task!r} ({pre[0].vocab_size} tokens)")

    def _count(self, what: str) -> None:
        with self._lock:
            n = self.counters[what] = self.counters.get(what, 0) + 1
        if what.startswith(("bad_request", "replay")):    # a dropped request: the first is worth a warning
            log.log(logging.WARNING if n == 1 else logging.DEBUG, "sun: dropped a request (%s; %d so far)", what, n)

    # ---- reporting ----
    def snapshot(self) -> dict:
        """Workers, bindings and counters, JSON-ready (for `edge-hub serve` stats and benchmarks)."""
        with self._lock:
            return {"isolated": self.isolated, "counters": dict(self.counters),
                    "routed": {t: dict(d) for t, d in self.routed.items()},
                    "bindings": dict(self.bindings), "pools": {t: list(d) for t, d in self.pools.items()},
                    "inflight": {d: len(v) for d, v in self.inflight.items() if v},
                    "prefilling": {p: len(v) for p, v in self.prefilling.items() if v},
                    "liveness": self.liveness.snapshot(),
                    "workers": {w.id: {"role": w.role, "task": w.task, "tasks": list(w.tasks), "grammars": w.grammars,
                                       "fingerprint": w.fingerprint,
                                       "online": w.online, "load": w.load, "est_load": w.est_load,
                                       "capacity": w.capacity, "max_load": w.max_load}
                                for w in self.workers.values()}}
