"""The reverse star's verify service: the hub holds the target and verifies the drafts of many
drafting devices, all pending sessions in ONE batched engine call per step.

A core for edge/runtime/loop.py (no thread, no I/O), on the draft service's machinery: the session
table, Q_in (one pending request per session, a newer one replacing it), eviction of silent
sessions and the replies a step returns are edge/star/draft_sessions.py's; the node around it
(per-session topics, HMAC, replay, hello, admission by the hub) is edge/star/draft_node.py's.

Per session the service holds the committed tokens of the device's generation and the target's KV
of all but the last of them. A VerifyRequest (keep, append, drafts, q) names the context
T = committed[:keep] + append; the service cuts its KV back to the common prefix with T (a long
feed -- a prompt -- is prefilled first, one call), then every request taken feeds its
[T[-1]] + drafts in one `Engine.forward_batch` (llama.cpp: one llama_decode over every session's
sequence). Iteration-level joining is what the loop gives: a request arriving while a call runs
is taken by the next step, one verify later, never a whole batch later.

The verdict is edge/speculative/verify.py's, unchanged: greedy takes the longest prefix the target's
argmax agrees with, sampled accepts each draft with min(1, p/q) under the exact q the device sent
(each row the target's own distribution, to_probs). The rejected drafts' KV is rolled back
(truncate); the session then holds T + drafts[:n] + [token], which the answer's `held` says.

Random streams: the target's acceptance uniforms come from role_rng(seed, TARGET) restarted at a
generation's first request (`start`: a seeded generation replays), else from a stream of this
session's own (a rejoin mid-generation never replays uniforms already used); never the device's
DRAFT stream (docs/architecture.md, Independent random streams).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, List, Optional, Tuple

from edge.engines.base import Engine, EngineError
from edge.speculative.common_prefix import common_prefix
from edge.speculative.sampling import Role, SamplingParams, SparseDist, role_rng, to_probs
from edge.speculative.verify import verify_greedy, verify_stochastic
from edge.star.draft_chain import sid_key
from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.draft_sessions import DraftSessions
from edge.wire.protocol import (E_BAD_KEEP, E_BAD_REQUEST, E_CONTEXT_FULL, E_INTERNAL, E_OVERLOADED, Error,
                                VerifyRequest, VerifyResponse)


class VerifySession:
    def __init__(self, sid: str, now: float):
        self.sid, self.key = sid, sid_key(sid)
        self.seq: Optional[int] = None       # the target's sequence, made at the first request
        self.fed: List[int] = []             # tokens in its KV: committed[:-1] between requests
        self.committed: List[int] = []       # the generation's tokens the device and the hub agree on
        self.rng = None
        self.mode: Optional[tuple] = None    # sampling the stream was drawn for
        self.last_seq, self.last_seen = -1, now
        self.kv = 0                          # KV bytes reserved / held
        self.closed = False


@dataclasses.dataclass
class VerifyItem:
    """One request of a step: its session, the context it names, what the call feeds."""
    sess: VerifySession
    req: VerifyRequest
    context: List[int]
    drafts: List[int]
    qs: list
    params: SamplingParams
    t_in: float


class VerifyService(DraftSessions):
    """The verify core. open/close/submit from any thread; `step` (the engine's only user) from the loop."""
    full_hint = "add a verify service or raise --max-sessions"

    def __init__(self, engine: Engine, limits: Optional[DraftLimits] = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "verify"):
        limits = limits or DraftLimits(ahead=False)
        cap = getattr(engine, "capacity", None)
        if cap is not None and cap < limits.max_sessions:       # llama.cpp's n_seq_max
            limits = dataclasses.replace(limits, max_sessions=int(cap))
        super().__init__(limits, clock, name, engine.vocab_size)
        self.engine = engine
        self.fingerprint = getattr(engine, "fingerprint", "")
        self._to_free: List[int] = []
        self._freeing = 0
        self._streams = itertools.count()

    # ---- sessions (the table and Q_in: edge/star/draft_sessions.py) ----
    def _new_session(self, sid: str) -> VerifySession:
        return VerifySession(sid, self.clock())

    def _check_open(self) -> None:
        if self.kv_bytes() >= self.limits.max_kv_mb * 1e6:
            self.stats.count("refused_sessions")
            raise DraftRefused(f"verify service {self.name!r} has used its KV memory limit of "
                               f"{self.limits.max_kv_mb:g} MB; raise --max-kv-mb or add a verify service")

    def _release(self, s: VerifySession) -> None:
        if s.seq is not None:
            self._to_free.append(s.seq)
            self._freeing += s.kv

    def kv_bytes(self) -> int:
        with self._lock:
            return sum(s.kv for s in self._sessions.values()) + self._freeing

    # ---- the core's step ----
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._outbox or self._to_free or self._pending)

    def step(self) -> List[Tuple[str, object]]:
        """Free closed sessions' KV, then verify every pending request in one batched call."""
        with self._lock:
            seqs, self._to_free, self._freeing = self._to_free, [], 0
        for q in seqs:
            self.engine.free(q)
        t0 = self.clock()
        work = []
        for s, req, t_in in self._take():
            try:
                work.append(self._prepare(s, req, t_in))
            except DraftRefused as e:
                self._reply(s.sid, Error(s.sid, req.seq, e.code, e.reason))
            except ValueError as e:                       # a q the verify math refuses (not a distribution)
                self.stats.count("bad_q")
                self._reply(s.sid, Error(s.sid, req.seq, E_BAD_REQUEST, f"drafts refused: {e}"[:1024]))
            except EngineError as e:
                self._reset(s)
                self._reply(s.sid, Error(s.sid, req.seq, E_INTERNAL, f"target engine: {e}"))
        if work:
            self._verify(work, t0)
        return self._replies()

    # ---- one request ----
    def _check(self, s: VerifySession, req: VerifyRequest) -> None:
        s.last_seq = req.seq
        if req.keep > len(s.committed):
            self.stats.count("bad_keep")
            raise DraftRefused(f"keep={req.keep} but this session holds only {len(s.committed)} committed "
                               f"tokens: resend with keep <= {len(s.committed)}", E_BAD_KEEP)
        if len(req.drafts) > self.limits.max_gamma:
            self.stats.count("bad_gamma")
            raise DraftRefused(f"{len(req.drafts)} drafts exceed this verify service's limit of "
                               f"{self.limits.max_gamma}", E_BAD_REQUEST)
        if any(t >= self.vocab_size for t in list(req.append) + list(req.drafts)):
            self.stats.count("bad_token")
            raise DraftRefused(f"a token id >= the target's vocabulary of {self.vocab_size}", E_BAD_REQUEST)

    def _prepare(self, s: VerifySession, req: VerifyRequest, t_in: float) -> VerifyItem:
        self._check(s, req)
        context = s.committed[:req.keep] + list(req.append)
        room = self.engine.max_len - len(context)
        if room < 0:
            self.stats.count("context_full")
            raise DraftRefused(f"the context of {len(context)} tokens does not fit the target's "
                               f"{self.engine.max_len}", E_CONTEXT_FULL)
        drafts, qs = list(req.drafts[:room]), list(req.q or [])[:room]
        params = SamplingParams.from_wire(req.sampling)
        need = self.engine.seq_kv_bytes(s.seq, len(context) + len(drafts))
        with self._lock:                                  # reserved now: the next request counts it
            if need > s.kv and self.kv_bytes() + need - s.kv > self.limits.max_kv_mb * 1e6:
                self.stats.count("refused_kv")
                raise DraftRefused(f"the target's KV memory limit of {self.limits.max_kv_mb:g} MB is "
                                   "reached; try later or raise --max-kv-mb", E_OVERLOADED)
            s.kv = max(s.kv, need)
        if s.seq is None:
            s.seq = self.engine.new_sequence()
        mode = tuple(sorted(req.sampling.items(), key=lambda kv: kv[0]))
        if req.start:                                     # a generation begins: its seed's own stream
            s.rng = role_rng(params.seed, Role.TARGET)
        elif s.rng is None or s.mode != mode:             # never a stream replayed mid-generation
            s.rng = role_rng(params.seed, Role.TARGET, s.key, next(self._streams))
        s.mode = mode
        cut = min(common_prefix(s.fed, context), len(context) - 1)
        if cut < len(s.fed):
            self.engine.truncate(s.seq, cut)
            del s.fed[cut:]
        if len(context) - 1 > cut:                        # a prompt (or a rejoin): prefilled alone
            self.engine.forward_last(s.seq, context[cut:-1])
            s.fed = list(context[:-1])
        qs = [SparseDist(i.astype("int64"), p.astype("float64")) for i, p in qs] if not params.greedy else []
        return VerifyItem(s, req, context, drafts, qs, params, t_in)

    def _verify(self, work: List[VerifyItem], t0: float) -> None:
        """One engine call over every item's [last committed] + drafts, then each verdict."""
        calls = [(w.sess.seq, [w.context[-1]] + w.drafts) for w in work]
        t_call = self.clock()
        try:
            rows = self.engine.forward_batch(calls)
        except EngineError:
            rows = []
            for c in calls:                               # all or nothing: find the failing one alone
                try:
                    rows.append(self.engine.forward_batch([c])[0])
                except EngineError as e:
                    rows.append(e)
        now = self.clock()
        self.stats.add_step(len(work), now - t_call)
        for w, r in zip(work, rows):
            if isinstance(r, EngineError):
                self.stats.count("step_refused")
                self._reset(w.sess)
                self._reply(w.sess.sid, Error(w.sess.sid, w.req.seq, E_INTERNAL, f"target engine: {r}"))
                continue
            try:
                self._verdict(w, r, now, len(work))
            except ValueError as e:                       # the session's KV is as before the call's drafts
                self.stats.count("bad_q")
                self.engine.truncate(w.sess.seq, len(w.context))
                w.sess.fed = list(w.context)
                self._reply(w.sess.sid, Error(w.sess.sid, w.req.seq, E_BAD_REQUEST, f"drafts refused: {e}"[:1024]))
        self.stats.add_batch(len(work), 1, self.clock() - t0)

    def _verdict(self, w: VerifyItem, rows, now: float, batch: int) -> None:
        s, drafts = w.sess, w.drafts
        if w.params.greedy:
            n, token = verify_greedy(drafts, rows)
        else:
            n, token = verify_stochastic(drafts, w.qs, to_probs(rows, w.params), s.rng)
        keep = len(w.context) + n
        if n < len(drafts):
            self.engine.truncate(s.seq, keep)             # roll back the rejected drafts' KV
        s.fed = w.context + drafts[:n]
        s.committed = s.fed + [token]
        with self._lock:
            if not s.closed:
                s.kv = self.engine.seq_kv_bytes(s.seq)
        s.last_seen = max(s.last_seen, now)               # silence counts from our answer
        self.stats.count("accepted", n)
        self.stats.count("drafted_in", len(drafts))
        self.stats.add_request(n + 1, now - w.t_in)
        self._reply(s.sid, VerifyResponse(s.sid, w.req.seq, n, token, len(s.committed),
                                          int(max(0.0, now - w.t_in) * 1e6), batch))

    def _reset(self, s: VerifySession) -> None:
        if s.seq is not None:
            try:
                self.engine.truncate(s.seq, 0)
            except EngineError:
                pass
        s.fed, s.committed, s.mode = [], [], None
