"""The StarSD target's side of a remote draft: never depend on the draft.

`RemoteDrafter` plugs a hub session into `edge.spec.generate.generate_speculative`
(the same loop as local speculation): each round it sends a DraftRequest
{keep, append, γ} and waits for the answer until a deadline adapted to the
measured round trips. A late, missing or refused answer just means this
round is a plain target step; a late answer that arrives later is still used
if its first drafts match what the target decoded meanwhile. When the hub
goes away the drafter rejoins in the background; meanwhile it returns no
drafts. The output is the target's alone (greedy: its exact greedy text).

With adaptive γ at 0 (the draft agrees too little to pay), greedy probes go in the background
(`observe`): the request is sent and never waited for, and its drafts are scored against the
tokens the target decodes meanwhile, exactly what a greedy verify would have accepted. So a
prompt where the draft disagrees costs the target no probing rounds.

`keep` is a lower bound on what the draft holds of our context: after an
answer to a request that named context length L with drafts d, the draft
holds context[:L] + d[:-1], so keep = L + (common prefix of d[:-1] and what
we committed after L); while a request is unanswered its own keep stays safe
whichever way it went.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from edge.spec.common_prefix import common_prefix
from edge.spec.drafter import Drafter
from edge.wire.protocol import (E_BAD_KEEP, E_OVERLOADED, E_UNKNOWN_SESSION, MAX_GAMMA, DraftResponse, Error)
from edge.spec.remote_gamma import RemoteGamma, RoundTrips, Wait
from edge.star.session import HubClient, JoinRefused, Session
from edge.spec.sampling import SamplingParams, SparseDist
from edge.spec.verify import CostTracker

log = logging.getLogger(__name__)
SHORT_FEED = 4          # a request feeding more than this is a prefill, not a round-trip sample
MAX_MISSES = 3          # unanswered requests in a row before the session is presumed lost
BUSY_BACKOFF_S = (0.05, 2.0)   # after 'overloaded': decode alone this long, doubling up to the cap


class Deadline:
    """How long to wait for a draft answer: srtt + 4·rttvar (RFC 6298 style), clamped.

    A request for γ drafts takes the draft γ times its per-token time, so with adaptive γ
    (requests of different sizes) the samples are normalised to one draft and `for_gamma`
    adds the per-token time back: a deep request after shallow ones is not given up on early."""

    def __init__(self, initial: float = 0.5, lo: float = 0.002, hi: float = 1.0):
        self.lo, self.hi = lo, hi
        self.srtt: Optional[float] = None
        self.rttvar = 0.0
        self.value = initial

    def sample(self, rtt: float, gamma: int = 1, per_token_s: float = 0.0) -> None:
        rtt = max(0.0, rtt - max(0, gamma - 1) * per_token_s)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.value = min(self.hi, max(self.lo, self.srtt + 4 * self.rttvar))

    def for_gamma(self, gamma: int, per_token_s: float = 0.0) -> float:
        return min(self.hi, self.value + max(0, gamma - 1) * 1.25 * per_token_s)

    def timed_out(self) -> None:
        self.value = min(self.hi, self.value * 1.5)


@dataclass
class _Outstanding:
    seq: int
    keep: int
    length: int            # context length the request named
    sent: float
    deadline: float
    give_up: float
    fed: int               # len(append): long ones (a prompt) cost the draft a prefill
    gamma: int = 1         # drafts asked for
    background: bool = False   # a probe observe() sent: nobody waits for it


class RemoteDrafter(Drafter):
    """A Drafter (see edge.spec.generate) whose draft model runs behind the hub."""

    def __init__(self, hub: HubClient, sampling: dict, max_gamma: int = 4,
                 deadline: Optional[Deadline] = None, rejoin_s: tuple = (0.2, 5.0),
                 verify_costs: Optional[dict] = None, stop_aware: bool = True):
        """verify_costs: {k: seconds of a target call over k tokens} measured beforehand
        (edge/spec/verify_costs.py), seeding the adaptive γ's cost model. stop_aware: the adaptive γ
        prices a round by the drafts the service is expected to send and asks for its own
        confidence stop (RemoteGamma.p_min)."""
        self.hub = hub
        self.stop_aware = stop_aware
        self.verify_costs = verify_costs or {}
        self.sampling = sampling
        self.max_gamma = max_gamma
        self.vocab_size = hub.vocab_size
        self.name = f"remote:{hub.client}"
        self.deadline = deadline or Deadline()
        self.rejoin_s = rejoin_s
        self.session: Optional[Session] = None
        self._pending_join = None
        self._next_join = 0.0
        self._join_backoff = rejoin_s[0]
        self.refusal: Optional[str] = None
        self._out: Optional[_Outstanding] = None
        self._misses = 0                # requests given up on in a row
        self._busy_until = 0.0          # an overloaded draft service: no requests before this
        self._busy_backoff = BUSY_BACKOFF_S[0]
        self._base = (0, 0, ())     # (keep, L, drafts): the draft holds ctx[:keep], or ctx[:L] + drafts[:-1]
        self.waits = RoundTrips()   # what each round's wait cost this target: the adaptive γ reads it
        self.policy: Optional[RemoteGamma] = None   # the adaptive γ's, when there is one: its p_min goes out
        self._wait: Optional[Wait] = None
        self._probe: Optional[tuple] = None    # (L, drafts, asked): a background answer not yet scored
        self.stats = {"rounds": 0, "answered": 0, "late_used": 0, "timeouts": 0, "alone": 0, "probes": 0,
                      "probe_answers": 0, "errors": 0, "overloaded": 0, "joins": 0, "rejoins": 0, "refused": 0,
                      "answered_since_join": 0,
                      "rtt_s": deque(maxlen=4096), "overhead_s": deque(maxlen=4096)}

    # ---- session management ----
    def connect(self, timeout: float = 5.0) -> Session:
        """Join now (blocking); raises JoinRefused with the hub's reason, or TimeoutError."""
        self.session = self.hub.join(min(self.max_gamma, MAX_GAMMA), self.sampling, timeout)
        self._reset_state()
        self.stats["joins"] += 1
        return self.session

    def _reset_state(self) -> None:
        self._out = None
        self._probe = None
        self._base = (0, 0, ())
        self.stats["answered_since_join"] = 0

    def _ready(self) -> Optional[Session]:
        s = self.session
        if s is not None and not s.lost:
            return s if self.hub.link.is_connected() else None
        if s is not None:                          # lost: the hub restarted or went away
            self.session = None
            s.close()
        if not self.hub.hub_online:
            return None
        now = time.monotonic()
        pj = self._pending_join
        if pj is not None and pj.done.is_set():
            self._pending_join = None
            try:
                s = self.hub.finish_join(pj)
            except JoinRefused as e:                # retried with the backoff: the reason may pass
                self.refusal = e.reason
                self.stats["refused"] += 1
                return None
            if s is not None:
                self.session = s
                self._reset_state()
                self._join_backoff = self.rejoin_s[0]
                self.stats["rejoins"] += 1
                return s
        if self._pending_join is None and now >= self._next_join:
            self._pending_join = self.hub.join_async(min(self.max_gamma, MAX_GAMMA), self.sampling)
            self._next_join = now + self._join_backoff
            self._join_backoff = min(self.rejoin_s[1], self._join_backoff * 2)
        elif self._pending_join is not None and now >= self._next_join:
            self.hub.abandon(self._pending_join)     # no answer: try again next round; a late
            self._pending_join = None                # acceptance of this one is closed (bye) at once
        return None

    def close(self) -> None:
        if self._pending_join is not None:           # a join still on its way: nobody will use it
            self.hub.abandon(self._pending_join)
            self._pending_join = None
        if self.session is not None:
            self.session.close()
            self.session = None

    # ---- one round ----
    def _keep(self, context: List[int]) -> int:
        keep, L, drafts = self._base
        if L:
            return L + common_prefix(drafts[:-1], context[L:])
        return keep

    def prime(self, context: Sequence[int], gamma: int) -> bool:
        """Send the first request now, so the draft prefills while the target does.

        Its deadline starts at the first draft() call, not now."""
        s = self._ready()
        if s is None or self._out is not None or gamma < 1:
            return False
        return self._send(s, list(context), gamma, time.monotonic(), primed=True)

    def _send(self, s: Session, context: List[int], gamma: int, now: float, primed: bool = False,
              background: bool = False) -> bool:
        keep = min(self._keep(context), len(context))
        seq = s.next_seq()
        p_min = self.policy.p_min() if self.policy is not None else None
        if not s.request(seq, keep, context[keep:], min(gamma, MAX_GAMMA), self.sampling, background, p_min):
            return False
        self._base = (keep, 0, ())
        d = self.deadline.for_gamma(gamma, self.waits.per_token_s)
        self._out = _Outstanding(seq, keep, len(context), now, math.inf if primed else now + d,
                                 math.inf if primed else now + max(4 * d, 0.05), len(context) - keep,
                                 min(gamma, MAX_GAMMA))
        return True

    def gamma_policy(self, max_gamma: int) -> RemoteGamma:
        """γ from the running acceptance, the target's verify costs and the waits seen here."""
        costs = CostTracker()
        for k, seconds in sorted(self.verify_costs.items()):
            costs.add_target(k, seconds)
        # With the cost curve measured, the primed first request (answered while the target
        # prefills: free) is the only exploring round; a second one costs a round at low α.
        # Greedy: a probe's drafts are scored against the target's own tokens, so probing does
        # not make the target wait (sampling has no such score: its probes are real rounds).
        # Background probes cost the target nothing: they start after 4 plain steps, not 16.
        background = SamplingParams.from_wire(self.sampling).greedy
        self.policy = RemoteGamma(max_gamma, self.waits, costs=costs, explore=1 if self.verify_costs else 2,
                                  background=background, probe_start=4 if background else 16,
                                  max_interval=32 if background else 64, stop_aware=self.stop_aware)
        return self.policy

    def observe(self, context: Sequence[int], gamma: int):
        """A background probe (edge.spec.drafter.Drafter.observe): poll, never wait."""
        s = self._ready()
        if s is None:
            return None
        out, now = self._out, time.monotonic()
        if out is not None:
            if out.deadline == math.inf:               # primed: its clock starts now
                self._start_clock(out, now)
            got = s.wait(out.seq, 0.0)
            # a round's own request was already counted in the waits by draft(); a probe is here
            if got is not None:
                msg = self._book(s, out, got)
                if msg is not None and out.background:   # an empty answer too: a round would get nothing
                    self.stats["probe_answers"] += 1
                    self.waits.add(Wait(out.gamma, got[1] - out.sent, msg.compute_us * 1e-6,
                                        len(msg.tokens), short=out.fed <= SHORT_FEED))
                if msg is not None and msg.tokens:
                    self._probe = (out.length, tuple(int(t) for t in msg.tokens[:out.gamma]), out.gamma)
            elif now >= out.give_up:
                if out.background:
                    self.waits.add(Wait(out.gamma, now - out.sent, None))
                self._expire(s)
        elif gamma > 0 and self._probe is None and now >= self._busy_until:
            if self._send(s, list(context), gamma, now, background=True):
                self._out.background = True
                self.stats["probes"] += 1
        return self._score(context)

    def _start_clock(self, out: _Outstanding, now: float) -> None:
        d = self.deadline.for_gamma(out.gamma, self.waits.per_token_s)
        out.deadline, out.give_up = now + d, now + max(4 * d, 0.05)

    def _score(self, context: Sequence[int]):
        """(asked, accepted) of the background answer once the target decoded past a mismatch
        or past all of its drafts: what a greedy verify of them would have accepted. Drafts
        asked for and not sent (the service unsure of them) count as a rejection, as in a round."""
        if self._probe is None:
            return None
        L, drafts, asked = self._probe
        seen = list(context[L:L + len(drafts)])
        n = common_prefix(list(drafts), seen)
        if n < len(seen) or len(seen) == len(drafts):
            self._probe = None
            return max(asked, len(drafts)), n
        return None

    def _expire(self, s: Session) -> bool:
        """The outstanding request was given up on; True when the session is presumed lost."""
        self._out = None
        self.stats["timeouts"] += 1
        self.deadline.timed_out()
        self._misses += 1
        if self._misses < MAX_MISSES:
            return False
        self._misses = 0
        self.session = None
        s.close()
        return True

    def _book(self, s: Session, out: _Outstanding, got) -> Optional[DraftResponse]:
        """Account for the answer `got` to `out`: round trips, errors, what the draft now holds.
        The DraftResponse, or None for an error."""
        msg, t_recv = got
        self._out = None
        self._misses = 0
        if out.fed <= SHORT_FEED:                  # a long feed (a prompt) is no round-trip sample
            self.deadline.sample(t_recv - out.sent, out.gamma, self.waits.per_token_s)
            self.stats["rtt_s"].append(t_recv - out.sent)
        if isinstance(msg, Error):
            self.stats["errors"] += 1
            if msg.code == E_BAD_KEEP:
                self._base = (0, 0, ())
            elif msg.code == E_UNKNOWN_SESSION:
                s.mark_lost()
            elif msg.code == E_OVERLOADED:
                self.stats["overloaded"] += 1
                self._busy_until = time.monotonic() + self._busy_backoff
                self._busy_backoff = min(BUSY_BACKOFF_S[1], 2 * self._busy_backoff)
            log.debug("draft error %s: %s", msg.code, msg.message)
            return None
        assert isinstance(msg, DraftResponse)
        self.stats["answered"] += 1
        self._busy_backoff = BUSY_BACKOFF_S[0]
        if out.fed <= SHORT_FEED:                  # round trip minus the draft's own time
            self.stats["overhead_s"].append(max(0.0, t_recv - out.sent - msg.compute_us * 1e-6))
        self.stats["answered_since_join"] += 1
        if msg.tokens:
            self._base = (out.keep, out.length, tuple(msg.tokens))
        return msg

    def draft(self, context: Sequence[int], gamma: int, rng: np.random.Generator):
        t = time.monotonic()
        self._wait = None
        self.stats["rounds"] += 1
        try:
            return self._draft(list(context), gamma, rng)
        finally:
            w = self._wait              # set only when this call sent a request and waited for it
            if w is not None:
                w.wall_s = time.monotonic() - t
                self.waits.add(w)

    def _draft(self, context: List[int], gamma: int, rng: np.random.Generator, retry: bool = True):
        s = self._ready()
        if s is None:
            self.stats["alone"] += 1
            return [], []
        now = time.monotonic()
        out = self._out
        if out is not None and out.deadline == math.inf:        # primed: its clock starts now
            self._start_clock(out, now)
            self._wait = Wait(out.gamma, 0.0, None, short=out.fed <= SHORT_FEED)   # a round like any
        got = None
        if out is not None and now >= out.give_up:
            got = s.wait(out.seq, 0.0)             # it may have come while this target decoded alone
        if out is not None and now >= out.give_up and got is None:
            out = None
            if self._expire(s):                    # a hub that forgot us answers nothing: rejoin
                self.stats["alone"] += 1
                return [], []
        if out is None:
            if now < self._busy_until:             # the draft said it is overloaded: leave it be
                self.stats["alone"] += 1
                return [], []
            if not self._send(s, context, gamma, now):
                self.stats["alone"] += 1
                return [], []
            out = self._out
            self._wait = Wait(gamma, 0.0, None, short=out.fed <= SHORT_FEED)
        if got is None:
            got = s.wait(out.seq, out.deadline)
        if got is None:
            self.stats["alone"] += 1
            return [], []
        msg = self._book(s, out, got)
        if msg is None:
            return [], []
        if self._wait is not None:
            self._wait.compute_s, self._wait.tokens = msg.compute_us * 1e-6, len(msg.tokens)
        skip = len(context) - out.length
        if skip and msg.tokens[:skip] != context[out.length:]:   # late, and the target went another way:
            if retry and self._wait is None:       # ask again now (after plain steps of γ auto: a probe)
                return self._draft(context, gamma, rng, retry=False)
            return [], []
        if skip:
            self.stats["late_used"] += 1
        toks = [int(t) for t in msg.tokens[skip:skip + gamma]]
        if msg.q is None:
            return toks, [SparseDist.one_hot(t) for t in toks]
        try:
            qs = [SparseDist(i.astype(np.int64), p.astype(np.float64)) for i, p in msg.q[skip:skip + gamma]]
            return toks, qs
        except ValueError as e:                    # a q we cannot use exactly: no speculation this round
            self.stats["errors"] += 1
            log.debug("unusable q from the draft: %s", e)
            return [], []
