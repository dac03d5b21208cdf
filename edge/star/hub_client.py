"""Session plumbing shared by targets and draft services: keys, replay, join.

`SessionKeys` (edge/star/session_keys.py) holds the secret of every session a node serves and
turns raw MQTT payloads into checked messages.

`HubClient` is a target device's side of the handshake (ss/hub/join/{me} ->
ss/c/{me}/joined) and the owner of its sessions' down topics. It watches the
hub's retained status: the hub stamps it with its start time (`time`), so a
new stamp or `online=False` (the last will) means the hub's registry and the
draft KV are gone — the sessions are marked lost and their users rejoin.

With a hub list (`hubs`, several hubs: edge/star/hub_watch.py) each join names the hub that owns
this client among the live ones, each session remembers its hub, and that hub's will, silence
or new epoch loses only its sessions; a returning hub gets the client back at its next join.

After an outage (the link lost, the hub offline or restarted) the first draft answer logs, at
INFO, that drafting resumed: through which broker, how long after the loss.

A join nobody waits for any more (its waiter gave up: `abandon`, a blocking `join` that timed
out, or one left unanswered for `join_ttl_s`) is forgotten; if the hub accepts it anyway, the
session is closed at once (bye) instead of holding a slot at the draft until eviction.
"""
from __future__ import annotations

import itertools
import logging
import secrets as _secrets
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Optional

from edge.star.ended_sessions import EndedSessions
from edge.star.hub_watch import HubWatch
from edge.wire.link import Link
from edge.star.session_keys import SessionKeys  # noqa: F401  (draft services import it from here)
from edge.wire.protocol import (STATUS_TOPIC, Bye, DraftRequest, DraftResponse, Error, HubStatus, Join,
                                Joined, ProtocolError, VerifyResponse, decode, encode, join_topic, joined_topic)

log = logging.getLogger(__name__)
JOIN_TTL_S = 60.0       # an unanswered join is forgotten after this (the draft evicts after 60 s too)
LATE_KEPT = 1024        # nonces of forgotten joins remembered, so that a late acceptance is closed


class JoinRefused(RuntimeError):
    """The hub refused to join us; `reason` is the hub's explanation."""

    def __init__(self, reason: str):
        super().__init__(f"the hub refused the session: {reason}")
        self.reason = reason


class Session:
    """One joined session: its topics, seq counter and the replies that came back."""

    def __init__(self, hub: "HubClient", joined: Joined, epoch: Optional[float], home: str = ""):
        self.hub = hub
        self.home = home                  # the hub that assigned it, of several ("": the one hub)
        self.sid, self.secret, self.draft = joined.sid, joined.secret, joined.draft
        self.up, self.down = joined.up, joined.down
        self.epoch = epoch
        self.lost = False
        self._seq = itertools.count(1)
        self._cv = threading.Condition()
        self._replies: Dict[int, tuple] = {}     # seq -> (message, receive time)

    def next_seq(self) -> int:
        return next(self._seq)

    def send(self, msg) -> bool:
        if self.lost:
            return False
        return self.hub.link.publish(self.up, encode(msg, self.secret),
                                     kind="control" if isinstance(msg, Bye) else "draft")

    def request(self, seq: int, keep: int, append, gamma: int, sampling: dict, background: bool = False,
                p_min: Optional[float] = None, grammar: tuple = ("", "", 0)) -> bool:
        """grammar: (grammar_id, its text or "", grammar_from), edge/star/remote_drafter.py's."""
        return self.send(DraftRequest(self.sid, seq, keep, list(append), gamma, sampling, background, p_min,
                                      *grammar))

    def _deliver(self, msg) -> None:
        with self._cv:
            self._replies[msg.seq] = (msg, time.monotonic())
            for old in [s for s in self._replies if s < msg.seq]:
                del self._replies[old]               # only the newest reply matters
            self._cv.notify_all()

    def wait(self, seq: int, until: float) -> Optional[tuple]:
        """(message, receive time) for request seq, waiting until monotonic `until`."""
        with self._cv:
            while True:
                got = self._replies.pop(seq, None)
                if got is not None or self.lost:
                    return got
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def wait_any(self, seqs, until: float) -> Optional[tuple]:
        """(message, receive time) answering any of `seqs` (a request resent under new seqs: the
        first answer to any of them), waiting until monotonic `until`."""
        seqs = set(seqs)
        with self._cv:
            while True:
                hit = next((q for q in sorted(self._replies, reverse=True) if q in seqs), None)
                if hit is not None or self.lost:
                    return self._replies.pop(hit) if hit is not None else None
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def mark_lost(self) -> None:
        with self._cv:
            self.lost = True
            self._cv.notify_all()

    def close(self) -> None:
        """Say bye (best effort) and forget the session. A session lost with one of several hubs
        still says bye: its draft service outlived that hub and would hold the slot until eviction."""
        if not self.lost or self.home:
            self.hub.ended.ended(self.sid, self.home)     # the next join names it: the bye may come later
            try:
                self.hub.link.publish(self.up, encode(Bye(self.sid), self.secret), kind="control")
            except Exception:
                pass
        self.mark_lost()
        self.hub._forget(self)


class _PendingJoin:
    def __init__(self, expires: float = float("inf")) -> None:
        self.done = threading.Event()
        self.joined: Optional[Joined] = None
        self.epoch: Optional[float] = None
        self.hub = ""               # the hub it was sent to, of several
        self.expires = expires
        self.claimed = False        # finish_join took it: the session is in use
        self.abandoned = False      # nobody will finish it: an acceptance is closed at once
        self.ended: list = []       # the ended sessions it names (Join.ended)


class HubClient:
    """A device's handshake with the hub and the home of its sessions."""

    def __init__(self, link: Link, client_id: str, model_fp: str, vocab_size: int,
                 join_ttl_s: float = JOIN_TTL_S, hubs=(), role: str = "target"):
        """hubs: the ids of the star's hubs when there are several (empty: the one hub). role: how
        it joins: "target" (StarSD) or "drafter" (the reverse star: the hub verifies its drafts)."""
        self.link, self.client, self.role = link, client_id, role
        self.model_fp, self.vocab_size = model_fp, vocab_size
        self.join_ttl_s = join_ttl_s
        self.keys = SessionKeys()
        self.sessions: Dict[str, Session] = {}
        self.ended = EndedSessions()                  # said bye to; the next joins name them
        self._joins: Dict[str, _PendingJoin] = {}
        self._late: "OrderedDict[str, None]" = OrderedDict()   # nonces of joins forgotten unanswered
        self.join_counts = {"orphans_closed": 0, "expired": 0}
        self._lock = threading.Lock()
        self.status: Optional[HubStatus] = None
        self._statuses = 0                            # statuses heard (the one hub's)
        self.epoch: Optional[float] = None
        self._listeners: list = []
        self._started = False
        self._outage: Optional[tuple] = None          # (since, what): drafting has not come back yet
        self.watch = HubWatch(link, hubs, self._hub_changed) if hubs else None

    def start(self) -> "HubClient":
        if not self._started:
            self._started = True
            self.link.on_connection(self._on_connection)
            self.link.subscribe(joined_topic(self.client), self._on_joined)
            self.link.subscribe(f"ss/s/{self.client}/+/+/down", self._on_down)
            if self.watch is None:
                self.link.subscribe(STATUS_TOPIC, self._on_status)
            else:
                self.watch.start()
            if not self.link.is_connected():
                self.link.connect(timeout=None)
        return self

    def on_hub_change(self, fn: Callable[[], None]) -> None:
        """fn() when the hub goes away or comes back (sessions may be lost)."""
        self._listeners.append(fn)

    @property
    def hub_online(self) -> bool:
        if self.watch is not None:
            return self.link.is_connected() and self.watch.any_live()
        return self.link.is_connected() and (self.status is None or self.status.online)

    @property
    def spoken(self) -> int:
        """How many hub statuses this client has heard: the one hub's, or any of several (HubWatch).
        A join no hub answered is worth waiting for again only once this moved."""
        return self.watch.heard if self.watch is not None else self._statuses

    # ---- join ----
    def join_async(self, gamma: int, sampling: dict, wait_s: float = 0.0) -> _PendingJoin:
        """Send a join; its answer completes the returned handle. Pass the handle to finish_join,
        or to abandon when no longer waiting. wait_s: how long a caller may wait (past join_ttl_s)."""
        nonce = _secrets.token_hex(6)
        now = time.monotonic()
        pj = _PendingJoin(now + max(self.join_ttl_s, wait_s))
        pj.hub = (self.watch.owner(self.client) or "") if self.watch is not None else ""
        pj.ended = self.ended.for_join(pj.hub)
        with self._lock:
            self._prune(now)
            self._joins[nonce] = pj
        msg = Join(self.client, self.model_fp, self.vocab_size, gamma, sampling, self.role, nonce, pj.hub,
                   pj.ended)
        sent = (self.watch is None or bool(pj.hub)) and self.link.is_connected() and \
            self.link.publish(join_topic(self.client), encode(msg), "control")
        if not sent:
            with self._lock:
                self._joins.pop(nonce, None)
            pj.done.set()
        return pj

    def finish_join(self, pj: _PendingJoin) -> Optional[Session]:
        """The Session of a completed join; raises JoinRefused; None if it failed (or was abandoned)."""
        with self._lock:
            if pj.claimed or pj.abandoned or pj.joined is None:
                return None
            pj.claimed = True
            j = pj.joined
        if not j.accepted:
            raise JoinRefused(j.reason)
        return self._open_session(j, pj.epoch, pj.hub)

    session_type = Session                              # a harness may record through a subclass

    def _open_session(self, j: Joined, epoch: Optional[float], home: str = "") -> Session:
        s = self.session_type(self, j, epoch, home)
        with self._lock:
            self.sessions[s.sid] = s
        self.keys.add(s.sid, self.client, s.secret)
        return s

    def abandon(self, pj: Optional[_PendingJoin]) -> None:
        """Nobody will finish this join: a session the hub grants for it is closed at once."""
        if pj is None:
            return
        with self._lock:
            if pj.claimed or pj.abandoned:
                return
            pj.abandoned = True
            j = pj.joined                               # answered already, never finished
        if j is not None and j.accepted:
            self._close_orphan(j)

    def _close_orphan(self, j: Joined) -> None:
        with self._lock:
            self.join_counts["orphans_closed"] += 1
        Session(self, j, self.epoch).close()            # bye: the draft frees its slot and KV now

    def _prune(self, now: float) -> None:
        """Forget joins unanswered past their time (caller holds the lock); a late answer is closed."""
        for nonce in [n for n, pj in self._joins.items() if now >= pj.expires]:
            pj = self._joins.pop(nonce)
            pj.abandoned = True
            pj.done.set()
            self.join_counts["expired"] += 1
            self._late[nonce] = None
            while len(self._late) > LATE_KEPT:
                self._late.popitem(last=False)

    def join(self, gamma: int, sampling: dict, timeout: float = 5.0) -> Session:
        """Join and wait; raises JoinRefused (with the hub's reason) or TimeoutError."""
        end = time.monotonic() + timeout
        while not self.link.is_connected() and time.monotonic() < end:
            time.sleep(0.01)                           # a join sent before we subscribed is lost
        pj = self.join_async(gamma, sampling, wait_s=timeout)
        if not pj.done.wait(max(0.0, end - time.monotonic())) or pj.joined is None:
            self.abandon(pj)                           # an acceptance after this is closed at once
            where = getattr(self.link, "url", "?")
            raise TimeoutError(f"no answer from the hub within {timeout:g} s "
                               f"(is `edge-hub serve` running and reachable at {where}?)")
        s = self.finish_join(pj)
        if s is None:
            raise TimeoutError("the join was given up on before its answer arrived")
        return s

    def _forget(self, s: Session) -> None:
        with self._lock:
            self.sessions.pop(s.sid, None)
        self.keys.remove(s.sid)

    # ---- callbacks (link thread) ----
    def _on_joined(self, topic: str, payload: bytes) -> None:
        try:
            j = decode(payload)
        except ProtocolError as e:
            self.keys.drop(e.code)
            return
        if not isinstance(j, Joined) or j.client != self.client:
            self.keys.drop("invalid")
            return
        with self._lock:
            self._prune(time.monotonic())
            pj = self._joins.pop(j.nonce, None)
            late = pj is None and j.nonce in self._late    # forgotten unanswered (_prune)
            if late:
                del self._late[j.nonce]
            if pj is not None:
                pj.joined, pj.epoch = j, self.watch.epoch(pj.hub) if self.watch else self.epoch
                self.ended.answered(pj.ended)          # the hub released them before it answered
            orphan = late or (pj is not None and pj.abandoned)
        if pj is not None:
            pj.done.set()
        if orphan and j.accepted:
            self._close_orphan(j)                      # granted, but nobody waits for it any more

    def _on_down(self, topic: str, payload: bytes) -> None:
        msg = self.keys.open(topic, payload, self.vocab_size)
        if msg is None:
            return
        s = self.sessions.get(msg.sid)
        if s is not None and isinstance(msg, (DraftResponse, VerifyResponse, Error)):
            s._deliver(msg)
            if self._outage is not None and isinstance(msg, (DraftResponse, VerifyResponse)):
                self._resumed()

    def _on_status(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            st = decode(payload)
        except ProtocolError as e:
            self.keys.drop(e.code)
            return
        if not isinstance(st, HubStatus):
            return
        self.status = st
        self._statuses += 1
        epoch = st.time if st.online else None
        changed = epoch != self.epoch
        if changed and self.epoch is not None:
            self._lost("the hub went offline" if epoch is None else "the hub restarted")
        self.epoch = epoch
        if changed:
            self._epoch_changed("", epoch)

    def _hub_changed(self, hub: str) -> None:
        """One of several hubs went, came or restarted (HubWatch): only its sessions are affected."""
        epoch = self.watch.epoch(hub)
        if epoch is None:
            self._lost(f"hub {hub} went offline")
        self._epoch_changed(hub, epoch)

    def _epoch_changed(self, home: str, epoch: Optional[float]) -> None:
        with self._lock:
            sessions = [s for s in self.sessions.values() if s.home == home]
        for s in sessions:
            if s.epoch is None and epoch is not None and not s.lost:
                s.epoch = epoch                        # joined before the first status arrived
            elif s.epoch != epoch:
                s.mark_lost()
        self._fire()

    def _on_connection(self, up: bool) -> None:
        if not up:
            self._lost(f"losing broker {self.link.broker}")
        self._fire()

    def _lost(self, what: str) -> None:
        if self._outage is None:
            self._outage = (time.monotonic(), what)

    def _resumed(self) -> None:
        outage, self._outage = self._outage, None
        if outage is not None:
            log.info("%s: drafting resumed through broker %s, %.2f s after %s", self.client,
                     self.link.broker, time.monotonic() - outage[0], outage[1])

    def _fire(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:
                log.exception("hub change listener failed")

    def close(self) -> None:
        with self._lock:
            sessions = list(self.sessions.values())
            joins = list(self._joins.values())
        for pj in joins:
            self.abandon(pj)
        for s in sessions:
            s.close()
        if self.watch is not None:
            self.watch.stop()
