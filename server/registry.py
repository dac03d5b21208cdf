"""The hub's registry: which draft services exist, who may join, who serves whom.

A join is admitted only if some online draft service speaks the target's
tokenizer (same fingerprint AND vocabulary size) and has room; otherwise it
is refused with a reason the user can act on. Admitted sessions get a fresh
session id and secret and go to the least-loaded fitting service.

No client may hold more than `client_share` of the session slots of the services that could
serve it (and never more than `max_sessions_per_client`): else one greedy client, joining
until refused, would take every draft slot and every other client would be refused as "full".
A join's own list of the sessions its client ended (Join.ended) is released before the count: their
byes reach the hub only through their services, often after the next join (server/join_ended.py).

A service counts as online only while server/liveness.py says it is alive: a
retained hello alone (maybe a dead process's) is not enough until the service
answers a probe, and its will, silence or an unanswered assignment ends it
(its sessions are released then).

A live service's hello lists the sessions it holds (DraftHello.held), and that list is the truth:
a session this hub assigned is released when a hello newer than the assignment (by the service's
stamp) does not list it and the assignment is at least `confirm_within` s old. That ends what no
message would: a SessionAssign lost on the way (the service never opened it), a SessionRelease
lost on the way (a bye or an eviction while this hub's link was moving between broker nodes), a
session whose target is gone (the service evicts it after --evict-after). Bound: the assignment
plus max(confirm_within, the service's eviction) plus a hello period.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from edge.wire.protocol import DraftHello, Join, new_secret, new_sid
from server.liveness import Liveness


class Refusal(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class ServiceInfo:
    name: str
    model_fp: str
    vocab_size: int
    max_sessions: int
    max_gamma: int
    sessions: int = 0            # as the service last reported it
    busy: float = 0.0
    online: bool = True
    local: object = None         # the hub's own DraftNode, None for a remote service
    recent: int = 0              # assigned since the last report
    seen: float = field(default_factory=time.monotonic)
    stamp: float = 0.0           # the newest hello's stamp (the service's clock)

    @property
    def load(self) -> int:
        return self.sessions + self.recent


@dataclass
class SessionInfo:
    sid: str
    client: str
    service: str
    created: float = field(default_factory=time.time)
    assigned: float = 0.0        # the registry's clock at the assignment
    after: float = 0.0           # the service's newest hello stamp then: a later hello must list it


def _short(fp: str) -> str:
    return fp if len(fp) <= 20 else fp[:16] + "…"


CLIENT_SHARE = 0.5            # default: a client may hold half the slots that fit its model


def client_limit(share: float, capacity: int, cap: int) -> int:
    """Sessions one client may hold among fitting services with `capacity` slots in all."""
    return max(1, min(cap, int(share * capacity)))


class Registry:
    def __init__(self, max_sessions_per_client: int = 64, liveness: Optional[Liveness] = None,
                 client_share: float = CLIENT_SHARE, role: str = "target"):
        """role: the joins it admits: "target" (StarSD: draft services) or "drafter" (the reverse
        star: verify services, server/hub.py)."""
        if not 0.0 < client_share <= 1.0:
            raise ValueError(f"client_share must be in (0, 1], got {client_share}")
        self.max_per_client = max_sessions_per_client
        self.role = role
        self.noun = "draft service" if role == "target" else "verify service"
        self.client_share = client_share
        self.liveness = liveness or Liveness()
        self.services: Dict[str, ServiceInfo] = {}
        self.sessions: Dict[str, SessionInfo] = {}
        self._lock = threading.Lock()
        self.refusals = 0
        self.unconfirmed = 0          # sessions released because the service's hellos stopped listing them
        self.ended = 0                # sessions released because their client's join named them ended

    # ---- services ----
    def update_service(self, hello: DraftHello, local: object = None) -> bool:
        """Take a service's hello; True when the caller should probe it (not yet proven alive)."""
        probe = self.liveness.heard(hello.service, hello.online, local=local is not None)
        with self._lock:
            s = self.services.get(hello.service)
            if s is None or s.model_fp != hello.model_fp or s.vocab_size != hello.vocab_size:
                s = ServiceInfo(hello.service, hello.model_fp, hello.vocab_size, hello.max_sessions,
                                hello.max_gamma, local=local or (s.local if s else None))
                self.services[hello.service] = s
            s.max_sessions, s.max_gamma = hello.max_sessions, hello.max_gamma
            s.sessions, s.busy, s.online = hello.sessions, hello.busy, hello.online
            s.recent, s.seen = 0, time.monotonic()
            if not hello.online:
                self._drop_sessions(s.name)
            elif hello.stamp > s.stamp:
                s.stamp = hello.stamp
                self._confirm(s.name, hello)
        return probe

    def _confirm(self, service: str, hello: DraftHello) -> None:
        """Release this service's sessions that a hello newer than their assignment does not list."""
        if hello.held is None:
            return                            # too many to list: releases and its death still work
        held, now = set(hello.held), self.liveness.clock()
        gone = [sid for sid, v in self.sessions.items()
                if v.service == service and sid not in held and hello.stamp > v.after
                and now - v.assigned >= self.liveness.answer_within]
        for sid in gone:
            del self.sessions[sid]
        self.unconfirmed += len(gone)

    def sweep(self) -> list:
        """Services found dead (silent, or an assignment unanswered): offline, sessions released."""
        dead = self.liveness.sweep()
        with self._lock:
            for name in dead:
                s = self.services.get(name)
                if s is not None:
                    s.online = False
                    self._drop_sessions(name)
        return dead

    def _drop_sessions(self, service: str) -> None:
        for sid in [k for k, v in self.sessions.items() if v.service == service]:
            del self.sessions[sid]

    def _alive(self) -> list:
        return [s for s in self.services.values() if s.online and self.liveness.alive(s.name)]

    def online_services(self) -> list:
        with self._lock:
            return sorted(s.name for s in self._alive())

    # ---- sessions ----
    def admit(self, join: Join) -> tuple:
        """(ServiceInfo, sid, secret) or raise Refusal with the reason."""
        with self._lock:
            try:
                return self._admit(join)
            except Refusal:
                self.refusals += 1
                raise

    def _admit(self, join: Join) -> tuple:
        if join.role != self.role:
            raise Refusal(f"role {join.role!r} is not served by this hub yet: it serves StarSD targets "
                          "and, with a verify service, drafters")
        online = self._alive()
        if not online:
            raise Refusal(f"no {self.noun} is online at this hub; start one with "
                          + ("`edge-hub serve --draft-model PATH` or `edge-agent run --role draft`"
                             if self.role == "target" else "`edge-hub serve --verify-model PATH`"))
        same_tok = [s for s in online if s.model_fp == join.model_fp]
        if not same_tok:
            have = ", ".join(sorted({_short(s.model_fp) for s in online}))
            raise Refusal(f"tokenizer fingerprint mismatch: your model's tokenizer is "
                          f"{_short(join.model_fp)}, the draft services here use {have}; speculation "
                          f"needs the draft and the target to share one tokenizer (use a target of the "
                          f"draft's model family)")
        fits = [s for s in same_tok if s.vocab_size == join.vocab_size]
        if not fits:
            raise Refusal(f"vocabulary size mismatch: your model has {join.vocab_size} tokens, the draft "
                          f"services with your tokenizer have {sorted({s.vocab_size for s in same_tok})}")
        fits = [s for s in fits if join.gamma <= s.max_gamma]
        if not fits:
            raise Refusal(f"gamma={join.gamma} is more than the draft services allow "
                          f"({max(s.max_gamma for s in same_tok)}); use a smaller --gamma")
        mine = sum(1 for v in self.sessions.values() if v.client == join.client)
        capacity = sum(s.max_sessions for s in fits)
        limit = client_limit(self.client_share, capacity, self.max_per_client)
        if mine >= limit:
            raise Refusal(f"client {join.client!r} already holds {mine} sessions, the most one client may "
                          f"hold ({self.client_share:.0%} of the {capacity} draft slots for its model, at most "
                          f"{self.max_per_client}) so that other clients find room; close some (they end "
                          "with bye) or wait for their eviction")
        room = [s for s in fits if s.load < s.max_sessions]
        if not room:
            raise Refusal(f"every fitting draft service is full ({sum(s.load for s in fits)} sessions); "
                          "try again later or add a draft service (`edge-agent run --role draft`)")
        svc = min(room, key=lambda s: (s.load / max(1, s.max_sessions), s.busy, s.name))
        sid, secret = new_sid(), new_secret()
        svc.recent += 1
        if svc.local is None:
            self.liveness.owe(svc.name)           # its next hello must count this session
        self.sessions[sid] = SessionInfo(sid, join.client, svc.name, assigned=self.liveness.clock(),
                                         after=svc.stamp)
        return svc, sid, secret

    def release(self, sid: str) -> Optional[SessionInfo]:
        """Forget a session (bye, eviction); the service's count follows its next report."""
        with self._lock:
            return self.sessions.pop(sid, None)

    def release_ended(self, client: str, sids) -> list:
        """Forget the sessions `client` says it ended (Join.ended); another client's are left alone."""
        with self._lock:
            mine = [sid for sid in sids if sid in self.sessions and self.sessions[sid].client == client]
            self.ended += len(mine)
            return [self.sessions.pop(sid) for sid in mine]

    def count(self) -> int:
        with self._lock:
            return len(self.sessions)

    def snapshot(self) -> dict:
        with self._lock:
            return {"sessions": len(self.sessions), "refusals": self.refusals, "unconfirmed": self.unconfirmed,
                    "ended_by_join": self.ended,
                    "liveness": self.liveness.snapshot(),
                    "services": {n: {"model_fp": s.model_fp, "vocab": s.vocab_size,
                                     "online": s.online and self.liveness.alive(n),
                                     "sessions": s.sessions, "busy": s.busy, "local": s.local is not None}
                                 for n, s in self.services.items()}}
