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
sequence). Iteration-level joining: a request arriving while a call runs is taken by the next
step, one verify later, never a whole batch later; and the step waits a moment for the sessions it
answered that are due back (edge/star/verify_join.py: at most one call's time, `wake_in`), so the
devices' verifies go into one call and the devices stay in step.

The verdict is edge/speculative/verify.py's, unchanged: greedy takes the longest prefix the target's
argmax agrees with, sampled accepts each draft with min(1, p/q) under the exact q the device sent
(each row the target's own distribution, to_probs). The rejected drafts' KV is rolled back
(truncate); the session then holds T + drafts[:n] + [token], which the answer's `held` says.

Constrained output and logprobs (edge/star/verify_rules.py): a request may name a grammar, which
masks every row of its verify call (the drafts cut after the first one it refuses), and ask for
logprobs, read from those rows; the answer carries one entry per committed token.

Random streams: the target's acceptance uniforms come from role_rng(seed, TARGET) restarted at a
generation's first request (`start`: a seeded generation replays), else from a stream of this
session's own (a rejoin mid-generation never replays uniforms already used); never the device's
DRAFT stream (docs/architecture.md, Independent random streams).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Tuple

from edge.engines.base import Engine, EngineError
from edge.speculative.constrained import NoTokenAllowed
from edge.speculative.sampling import Role, SamplingParams, SparseDist, role_rng, to_probs
from edge.speculative.verify import verify_greedy, verify_stochastic
from edge.star.draft_chain import sid_key
from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.engine_sessions import EngineSessions
from edge.star.verify_join import VerifyJoin
from edge.star.verify_rules import VerifyGrammars, entries, legal_for, masked
from edge.wire.protocol import (E_BAD_GRAMMAR, E_BAD_KEEP, E_BAD_REQUEST, E_CONTEXT_FULL, E_INTERNAL, Error,
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
        self.grammar = None                  # the grammar its rows are masked with (edge/star/draft_grammar.py)


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
    masks: Optional[list] = None         # one grammar mask per row of its call (None: unconstrained)


class VerifyService(EngineSessions):
    """The verify core. open/close/submit from any thread; `step` (the engine's only user) from the loop."""
    full_hint = "add a verify service or raise --max-sessions"
    service_kind, engine_role = "verify", "target"

    def __init__(self, engine: Engine, limits: Optional[DraftLimits] = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "verify", grammar_tokenizer=None):
        """grammar_tokenizer: the target's tokenizer for grammars (grammar_tokenizer(), or a function
        making it at the first grammar); None: requests naming a grammar are refused bad_grammar."""
        super().__init__(engine, limits or DraftLimits(ahead=False), clock, name)
        self.grammars = VerifyGrammars(grammar_tokenizer)
        self.join = VerifyJoin()

    # ---- sessions (the table and Q_in: draft_sessions.py; their KV: engine_sessions.py) ----
    def _new_session(self, sid: str) -> VerifySession:
        s = VerifySession(sid, self.clock())
        self.join.opened(sid, s.last_seen)
        return s

    def _arrived(self, sid: str, t: float) -> None:
        self.join.arrived(sid, t)

    def _release(self, s: VerifySession) -> None:
        self.join.forget(s.sid)
        super()._release(s)

    # ---- the core's step ----
    def has_work(self) -> bool:
        with self._lock:
            if self._outbox or self._to_free:
                return True
            return bool(self._pending) and self._held_until() is None

    def _held_until(self) -> Optional[float]:
        """When the pending requests will be verified, if held for sessions due back (verify_join.py)."""
        with self._lock:
            return self.join.until(self.clock(), self._pending.keys())

    def wake_in(self) -> Optional[float]:
        """Seconds until a held step is due (the loop's longest sleep), None if none is held."""
        t = self._held_until()
        return None if t is None else max(0.0, t - self.clock())

    def step(self) -> List[Tuple[str, object]]:
        """Free closed sessions' KV, then verify every pending request in one batched call."""
        self._free_closed()
        t0 = self.clock()
        work = self._prepare_taken()
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
        try:
            return self._prepare_checked(s, req, t_in)
        except ValueError as e:                           # a q the verify math refuses (not a distribution)
            self.stats.count("bad_q")
            raise DraftRefused(f"drafts refused: {e}"[:1024], E_BAD_REQUEST) from None

    def _prepare_checked(self, s: VerifySession, req: VerifyRequest, t_in: float) -> VerifyItem:
        self._check(s, req)
        context = s.committed[:req.keep] + list(req.append)
        room = self.engine.max_len - len(context)
        if room < 0:
            self.stats.count("context_full")
            raise DraftRefused(f"the context of {len(context)} tokens does not fit the target's "
                               f"{self.engine.max_len}", E_CONTEXT_FULL)
        drafts, qs = list(req.drafts[:room]), list(req.q or [])[:room]
        params = SamplingParams.from_wire(req.sampling)
        self.grammars.apply(s, req, self.stats)
        self._reserve(s, self.engine.seq_kv_bytes(s.seq, len(context) + len(drafts)),
                      f"the target's KV memory limit of {self.limits.max_kv_mb:g} MB is reached; "
                      "try later or raise --max-kv-mb")
        if s.seq is None:
            s.seq = self.engine.new_sequence()
        mode = tuple(sorted(req.sampling.items(), key=lambda kv: kv[0]))
        if req.start:                                     # a generation begins: its seed's own stream
            s.rng = role_rng(params.seed, Role.TARGET)
        elif s.rng is None or s.mode != mode:             # never a stream replayed mid-generation
            s.rng = role_rng(params.seed, Role.TARGET, s.key, next(self._streams))
        s.mode = mode
        cut = self._cut_back(s, context)
        if len(context) - 1 > cut:                        # a prompt (or a rejoin): prefilled alone
            self.engine.forward_last(s.seq, context[cut:-1])
            s.fed = list(context[:-1])
        qs = [SparseDist(i.astype("int64"), p.astype("float64")) for i, p in qs] if not params.greedy else []
        drafts, qs, masks = legal_for(s.grammar, context, drafts, qs)
        return VerifyItem(s, req, context, drafts, qs, params, t_in, masks)

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
        with self._lock:
            self.join.call(len(work), now - t_call, now)
        for w, r in zip(work, rows):
            if isinstance(r, EngineError):
                self.stats.count("step_refused")
                self._reset(w.sess)
                self._reply(w.sess.sid, Error(w.sess.sid, w.req.seq, E_INTERNAL, f"target engine: {r}"))
                continue
            try:
                self._verdict(w, r, now, len(work))
            except NoTokenAllowed as e:                   # the grammar engine gave up here (its limits)
                self.stats.count("bad_grammar")
                self._rewind(w)
                self._reply(w.sess.sid, Error(w.sess.sid, w.req.seq, E_BAD_GRAMMAR, f"the grammar allows no "
                                              f"token here ({e}); send a simpler schema"[:1024]))
            except ValueError as e:                       # the session's KV is as before the call's drafts
                self.stats.count("bad_q")
                self._rewind(w)
                self._reply(w.sess.sid, Error(w.sess.sid, w.req.seq, E_BAD_REQUEST, f"drafts refused: {e}"[:1024]))
        self.stats.add_batch(len(work), 1, self.clock() - t0)

    def _rewind(self, w: VerifyItem) -> None:
        """The session's KV as before the call's drafts (a request refused after the call)."""
        self.engine.truncate(w.sess.seq, len(w.context))
        w.sess.fed = list(w.context)

    def _verdict(self, w: VerifyItem, rows, now: float, batch: int) -> None:
        s, drafts = w.sess, w.drafts
        rows = masked(rows, w.masks)                      # the grammar's distribution, the target's own
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
        with self._lock:
            self.join.answered(s.sid, now)
        self._reply(s.sid, VerifyResponse(s.sid, w.req.seq, n, token, len(s.committed),
                                          int(max(0.0, now - w.t_in) * 1e6), batch,
                                          entries(rows, drafts[:n] + [token], w.req.logprobs)))

    def _reset(self, s: VerifySession) -> None:
        self._empty_sequence(s)
        s.fed, s.committed, s.mode, s.grammar = [], [], None, None
