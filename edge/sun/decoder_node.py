"""The SUN shared decoder on the MQTT star (edge/sun/prefill_node.py has the flow).

It reserves a slot on the router's DecodeAssign, collects the request's signed
KV chunks (chunks that overtake their assignment are held, bounded in bytes
and time, per sender: edge/sun/early_kv.py), admits the KV into its SharedDecoder and streams tokens 1.. to the
client. Its hello carries its load, which the router's least-loaded choice reads, and the
decoder's max_sequences: an assignment past it (running, waiting and awaited KV together) is
answered `overloaded` at once, before its KV is on the way.

When its link comes back after a loss (edge/wire/link.py moves it to another broker node, with a
fresh client id and a fresh subscription), whatever was published to its KV topic meanwhile is
gone, and a KV cache is sent once. So every request still waiting for KV then is failed at once
with worker_lost, which the SunClient answers by sending it again under a new id (prefilled
again, each token still handed out once), instead of waiting out `kv_timeout` (a timeout the
client also resends, for KV lost any other way). Requests already decoding go on: the tokens
published while the link was down are sent on reconnect (QoS 1).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from edge.wire.field_types import MAX_SEQ
from edge.wire.link import Link
from edge.wire.protocol import (E_INTERNAL, E_OVERLOADED, E_REFUSED, E_TIMEOUT, E_WORKER_LOST, DecodeAssign, Error, KVChunk,
                           ProtocolError, SunHello, SunTokens, decode, parse_topic, sun_ctl_topic,
                           sun_hello_topic, sun_kv_sub, sun_stream_topic)
from edge.sun.decoder import AdmissionError, DecoderFull, SharedDecoder, TokenEvent
from edge.sun.early_kv import EarlyKV
from edge.runtime.node import Node
from edge.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)
# how long an assignment waits for its KV: the router assigns a decoder when a request arrives, so the
# KV of a request queued behind a burst at its prefill worker comes minutes later on a small CPU (at
# 30 s, 4 of 6 burst requests failed on 2 loaded cores: benchmarks/sun/sun_vs_multilora.py). A dead
# prefill worker's reservations are released at once by the router (worker_lost); this bounds KV
# lost any other way, as long as the hub endpoint's own request timeout.
KV_TIMEOUT_S = 300.0
KV_LATE_S = 30.0               # a request waiting this long for its KV is logged once (lost, or a long queue)
MAX_ASSIGNED_KEYS = 4096       # recent assignments whose KV may pass a full queue (a bounded memory)
EARLY_QUOTA = 64 << 20         # early KV one sender may have held (at most max_pending / 4)


def size(n: int) -> str:
    """Bytes as a person reads them (a limit under 1 MiB is not "0 MiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{round(n / (1 << shift), 2):g} {unit}"
    return f"{n} bytes"


@dataclass
class _Pending:
    assign: DecodeAssign
    since: float
    chunks: Dict[int, bytes] = field(default_factory=dict)
    total: int = 0
    first: int = -1
    nbytes: int = 0
    said_late: bool = False     # logged once as late (KV_LATE_S)


@dataclass
class _Live:
    client: str
    secret: bytes
    task: str
    seq: int = 0


class DecoderNode(Node):
    """A SharedDecoder on the star: takes assignments, reassembles KV, batches every task together.

    `batches` records the task of every sequence in each recent engine step (the
    evidence that one step mixed tasks); `tasks_served` every task it decoded.
    """
    role = "decoder"

    def __init__(self, decoder: SharedDecoder, link: Link, worker_id: str, ctl_key: Optional[bytes] = None,
                 hello_every: float = 2.0, kv_timeout: float = KV_TIMEOUT_S, max_pending_mb: float = 1024.0):
        super().__init__(decoder, link, worker_id, ctl_key, hello_every, idle_wait=0.05)
        self.decoder, self.kv_timeout = decoder, kv_timeout
        self.max_pending = int(max_pending_mb * (1 << 20))
        self._pending: Dict[str, _Pending] = {}
        self._held_notices = 0                            # "still held here" answers to assignment copies
        # KV that overtook its assignment, per sender; all senders together within max_pending
        self._early = EarlyKV(min(self.max_pending // 4, EARLY_QUOTA), self.max_pending)
        self._live: Dict[str, _Live] = {}
        self._last_sweep = time.monotonic()
        self.tasks_served: set = set()
        self.stats = {"admitted": 0, "refused": 0, "timeouts": 0, "overloaded": 0, "finished": 0, "kv_lost": 0}
        self._link_lost = False                           # the link went down since it was last up
        self._queued, self._queued_lock = 0, threading.Lock()    # KV bytes waiting in the loop's queue
        self._assigned: "OrderedDict[str, bytes]" = OrderedDict()  # rid -> secret of recent assignments
        self._turned_away: "OrderedDict[str, None]" = OrderedDict()  # refused at assignment: KV dropped

    @property
    def load(self) -> int:
        """Running sequences plus those whose KV is on its way."""
        return self.decoder.load + len(self._pending)

    @property
    def batches(self):
        return self.decoder.batches

    def telemetry(self) -> dict:
        """The node's counters plus the decoder's: requests held, tokens decoded, batch sizes."""
        d = self.decoder
        recent = list(d.batches)
        return {**super().telemetry(), "sessions": self.load, "tokens": d.tokens_out,
                "batch_mean": d.rows_out / d.steps if d.steps else 0.0,
                "batch_max": max(map(len, recent)) if recent else 0}

    # ---- the node's hooks ----
    def hello_topic(self) -> str:
        return sun_hello_topic(self.id)

    def ctl_topic(self) -> str:
        return sun_ctl_topic(self.id)

    def status(self, online: bool = True) -> SunHello:
        d = self.decoder
        return SunHello(self.id, "decoder", "", d.fingerprint, d.engine.vocab_size, online, self.load,
                        d.max_batch, self.served, d.max_sequences, grammars=d.grammars is not None)

    def status_key(self):
        return self.load, self.served

    def subscribe(self) -> None:
        self.link.subscribe(sun_kv_sub(self.id), self._on_kv)
        self.link.on_connection(self._on_link)

    def _on_link(self, up: bool) -> None:
        if not up:
            self._link_lost = True
        elif self._link_lost:
            self._link_lost = False
            self.put("relinked", None)                    # the loop owns the pending requests

    def _relinked(self) -> None:
        """The link is back after a loss: KV sent to the old subscription meanwhile is lost."""
        log.warning("decoder %s: link back after a loss; %d requests waiting for their KV are failed "
                    "(worker_lost: their clients send them again), %d decoding go on", self.id,
                    len(self._pending), self.decoder.load)
        for p in list(self._pending.values()):
            self.stats["kv_lost"] += 1
            self._fail(p, E_WORKER_LOST, f"decoder {self.id}'s link to the broker was lost while this "
                                         "request's KV cache was on its way (what was sent meanwhile is "
                                         "gone); send it again")

    def _on_kv(self, topic: str, payload: bytes) -> None:
        """Queue a KV message for the loop, within max_pending bytes queued. Past that (a flood faster
        than the loop) only chunks signed for an assigned request still queue; the rest are dropped
        and counted here, so a flood can neither grow the queue nor crowd out the real KV."""
        try:
            kind, ids = parse_topic(topic)                # the sender is the topic's last level
        except ProtocolError:
            kind, ids = "", {}
        if kind != "sun_kv" or ids.get("worker") != self.id:
            self.drop("invalid")
            return
        self.take_kv(ids["sender"], payload)

    def take_kv(self, sender: str, payload: bytes) -> None:
        """A KV message from `sender` (the broker's, or a prefill worker's in this process handing
        its KV over without the broker: edge/sun/colocated.py); checked exactly as from the network."""
        with self._queued_lock:
            room = self._queued + len(payload) <= self.max_pending
        if not room and not self._signed_for_assigned(payload):
            self.drop("kv_backlog")
            return
        with self._queued_lock:
            self._queued += len(payload)
        self.put("kv", (sender, payload))

    def put(self, kind: str, msg) -> None:
        if kind == "ctl" and isinstance(msg, DecodeAssign) and msg.worker == self.id:
            with self._queued_lock:                       # known before the loop reaches it (see _on_kv)
                self._assigned[msg.rid] = msg.secret
                while len(self._assigned) > MAX_ASSIGNED_KEYS:
                    self._assigned.popitem(last=False)
        super().put(kind, msg)

    def _signed_for_assigned(self, payload: bytes) -> bool:
        def key(rid: str) -> Optional[bytes]:
            with self._queued_lock:
                return self._assigned.get(rid)
        try:
            decode(payload, key)
            return True
        except ProtocolError:
            return False

    def tick(self, now: float) -> None:
        if now - self._last_sweep > 0.25:
            self._last_sweep = now
            self._expire(now)

    def publish(self, e: TokenEvent) -> None:
        if e.done and e.finish_reason == "error":         # the engine refused its row, or its grammar
            live = self._live.pop(e.request_id, None)     # allowed no token: it ends alone, said so
            self.decoder.results.pop(e.request_id, None)
            if live is not None:
                self.send(sun_stream_topic(live.client, e.request_id),
                          Error(e.request_id, 0, E_INTERNAL, f"decoder {self.id} could not continue the request "
                                                             f"after {e.index + 1} tokens"), live.secret)
            return
        self._emit(e.request_id, e.index, e.token, e.finish_reason if e.done else None, e.logprob)

    def handle(self, kind: str, msg) -> None:
        if kind == "ctl":
            if isinstance(msg, DecodeAssign) and msg.worker == self.id:
                self._assign(msg)
            else:
                self.drop("not_mine")
        elif kind == "relinked":
            self._relinked()
        else:
            sender, payload = msg
            with self._queued_lock:
                self._queued -= len(payload)
            self._kv(payload, sender)

    def _assign(self, a: DecodeAssign) -> None:
        if not self.fresh(a.rid):
            if a.kv_sent:
                self._kv_lost_if_pending(a.rid)
            return
        self.served += 1                                  # taken, refused or not (the router counts it)
        if self.load >= self.decoder.max_sequences:       # the KV it would send has nowhere to go
            self.stats["overloaded"] += 1
            self._turned_away[a.rid] = None
            with self._queued_lock:                       # its KV may not pass a full queue either
                self._assigned.pop(a.rid, None)
            while len(self._turned_away) > MAX_ASSIGNED_KEYS:
                self._turned_away.popitem(last=False)
            self._fail(_Pending(a, time.monotonic()), E_OVERLOADED,
                       f"decoder {self.id} holds its limit of {self.decoder.max_sequences} sequences (running, "
                       "waiting and on their way); retry or add a decoder")
            return
        self._pending[a.rid] = _Pending(a, time.monotonic())
        self._early.vouch(a.prefill)                      # the router's prefill worker: a quota of its own
        mine, others = self._early.claim(a.rid, a.prefill)
        for _ in range(others):
            self.drop("kv_wrong_sender")                  # held for this request, but not from its prefill
        for payload in mine:
            self._kv(payload, a.prefill)
        if a.kv_sent:                                     # the first copy to arrive (the assignment was lost)
            self._kv_lost_if_pending(a.rid)

    def _kv_lost_if_pending(self, rid: str) -> None:
        """A copy of the assignment says the prefill worker is done, and the KV that came before it (in
        this loop's order) is in: a request still waiting here lost (part of) its KV on the way, as
        when this decoder's link moved to another broker node meanwhile. Failed at once (the client
        sends it again under a new id), not held for kv_timeout."""
        p = self._pending.get(rid)
        if p is None:
            return
        self.stats["kv_lost"] += 1
        log.info("decoder %s: request %s lost its KV on the way (%d of %s chunks came): failed, its client sends "
                 "it again", self.id, rid, len(p.chunks), p.total or "?")
        self._fail(p, E_TIMEOUT, f"decoder {self.id} holds {len(p.chunks)} of {p.total or '?'} KV chunks of this "
                                 f"request, which prefill worker {p.assign.prefill} sent: the rest was lost on the "
                                 "way; send it again")

    def _kv(self, payload: bytes, sender: str) -> None:
        asked: List[str] = []

        def key(rid: str) -> Optional[bytes]:
            asked.append(rid)
            p = self._pending.get(rid)
            return p.assign.secret if p else None
        try:
            msg = decode(payload, key)
        except ProtocolError as e:
            rid = asked[0] if asked else None
            if e.code == "auth" and rid and rid not in self._pending and rid not in self.seen:
                self._hold_early(sender, rid, payload)    # its assignment has not arrived yet
            elif rid in self._turned_away:
                self.drop("kv_turned_away")               # the KV of a request refused as overloaded
            else:
                self.drop(e.code)
            return
        p = self._pending[asked[0]]
        if isinstance(msg, Error):                        # the prefill failed and told the client
            del self._pending[asked[0]]
            return
        if not isinstance(msg, KVChunk):
            self.drop("invalid")
            return
        if p.total and (msg.total, msg.first_token) != (p.total, p.first) or msg.index in p.chunks:
            self.drop("inconsistent")
            return
        p.total, p.first = msg.total, msg.first_token
        if self._pending_bytes() + len(msg.data) > self.max_pending:
            self.stats["overloaded"] += 1
            self._fail(p, E_OVERLOADED, f"decoder {self.id} has no room for more KV in transit "
                                        f"({size(self.max_pending)}); retry or add a decoder")
            return
        p.chunks[msg.index] = msg.data
        p.nbytes += len(msg.data)
        if len(p.chunks) == p.total:
            del self._pending[msg.rid]
            self._admit(p)

    def _hold_early(self, sender: str, rid: str, payload: bytes) -> None:
        if not self._early.hold(sender, rid, payload, time.monotonic()):
            self.drop("early_overflow")                   # this sender's quota is full

    def _pending_bytes(self) -> int:
        return sum(p.nbytes for p in self._pending.values())

    def _admit(self, p: _Pending) -> None:
        a = p.assign
        blob = b"".join(p.chunks[i] for i in range(p.total))
        try:
            rid = self.decoder.admit(blob, request_id=a.rid, max_new=a.max_new, params=SamplingParams.from_wire(a.sampling),
                                     first_token=p.first, stop_ids=self.decoder.stop_ids | set(a.stop),
                                     task=a.task, grammar=a.grammar, logprobs=a.logprobs)
        except DecoderFull as e:                          # held by sequences admitted some other way
            self.stats["overloaded"] += 1
            self._fail(p, E_OVERLOADED, str(e))
            return
        except AdmissionError as e:
            self.stats["refused"] += 1
            self._fail(p, E_REFUSED, str(e))
            return
        except Exception as e:  # a bad blob must never stop the decoder
            log.exception("decoder %s: admitting %s failed", self.id, a.rid)
            self._fail(p, E_INTERNAL, f"decoder {self.id} could not admit the request: {e}")
            return
        self.stats["admitted"] += 1
        self.tasks_served.add(a.task)
        self._live[rid] = _Live(a.client, a.secret, a.task)
        res = self.decoder.results.get(rid)
        if res is not None:                               # done at once: stop token first, or max_new 1
            self._emit(rid, len(res.tokens) - 1, res.tokens[-1], res.finish_reason)

    def answer_on_arrival(self, msg) -> bool:
        """A copy of the assignment of a request decoding or waiting here: its client heard nothing
        for a while (a full batch) and sent it again. Tell it the request is held (no tokens, no
        worker name; a seq of its own counted down from MAX_SEQ // 2: never a token message's, never
        a prefill worker's notice), in the link's thread, so it waits instead of sending it under a
        new id (edge/sun/client.py)."""
        if not (isinstance(msg, DecodeAssign) and msg.worker == self.id):
            return False
        live = self._live.get(msg.rid)
        if live is None and msg.rid in self._pending and self._queued > 0:
            # assigned here and KV waits in the inbox behind a step (its prefill worker answered and no
            # longer holds it): held too; a KV lost on the way is answered only while others queue
            live = _Live(msg.client, msg.secret, msg.task)
        if live is None:
            return False
        self.drop("replay")
        self._held_notices += 1
        self.send(sun_stream_topic(live.client, msg.rid), SunTokens(msg.rid, MAX_SEQ // 2 - self._held_notices, 0, []),
                  live.secret)
        return True

    def _emit(self, rid: str, index: int, token: int, reason: Optional[str], logprob=None) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        live.seq += 1
        msg = SunTokens(rid, live.seq, index, [token], reason is not None, reason or "", self.id,
                        [logprob] if logprob is not None else [])
        self.send(sun_stream_topic(live.client, rid), msg, live.secret)
        if reason is not None:
            del self._live[rid]
            self.decoder.results.pop(rid, None)
            self.stats["finished"] += 1

    def _expire(self, now: float) -> None:
        for rid, p in list(self._pending.items()):
            if not p.said_late and now - p.since > KV_LATE_S:
                p.said_late = True                        # info: a burst's queue at its prefill worker is normal
                log.info("decoder %s: request %s of client %s has waited %.0f s for its KV from prefill worker "
                            "%s (%d of %s chunks here); it is held until %g s", self.id, rid, p.assign.client,
                            now - p.since, p.assign.prefill, len(p.chunks), p.total or "?", self.kv_timeout)
            if now - p.since > self.kv_timeout:
                self.stats["timeouts"] += 1
                log.warning("decoder %s: the KV of request %s never came within %g s", self.id, rid, self.kv_timeout)
                self._fail(p, E_TIMEOUT, f"the KV cache from prefill worker {p.assign.prefill!r} did not "
                                         f"reach decoder {self.id} within {self.kv_timeout:g} s")
        for _ in range(self._early.expire(now, self.kv_timeout)):
            self.drop("kv_unclaimed")                     # no assignment came: another decoder's, or forged

    def _fail(self, p: _Pending, code: str, message: str) -> None:
        a = p.assign
        self._pending.pop(a.rid, None)
        self.send(sun_stream_topic(a.client, a.rid), Error(a.rid, 0, code, message[:1024]), a.secret)
