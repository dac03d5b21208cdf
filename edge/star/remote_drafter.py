"""The StarSD target's side of a remote draft: never depend on the draft.

`RemoteDrafter` plugs a hub session into `edge.speculative.generate.generate_speculative`
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
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.drafter import Drafter
from edge.speculative.remote_gamma import GammaPricing, RemoteGamma, RoundTrips, Wait
from edge.speculative.sampling import SparseDist
from edge.star.remote_round import Backoff, Deadline, DraftHeld, DrafterStats, Outstanding
from edge.star.hub_client import HubClient, JoinRefused, Session
from edge.star.remote_probe import remote_gamma_policy, score_probe
from edge.wire.protocol import (E_BAD_GRAMMAR, E_BAD_KEEP, E_OVERLOADED, E_UNKNOWN_SESSION, MAX_GAMMA,
                                DraftResponse, Error)

__all__ = ["Deadline", "DrafterStats", "RemoteDrafter"]
log = logging.getLogger(__name__)
SHORT_FEED = 4          # a request feeding more than this is a prefill, not a round-trip sample
MAX_MISSES = 3          # unanswered requests in a row before the session is presumed lost
BUSY_BACKOFF_S = (0.05, 2.0)   # after 'overloaded': decode alone this long, doubling up to the cap


class RemoteDrafter(Drafter):
    """A Drafter (see edge.speculative.generate) whose draft model runs behind the hub."""

    def __init__(self, hub: HubClient, sampling: dict, max_gamma: int = 4,
                 deadline: Optional[Deadline] = None, rejoin_s: tuple = (0.2, 5.0),
                 pricing: Optional[GammaPricing] = None):
        """pricing: what the adaptive γ (gamma_policy) starts from: the target's measured verify
        costs, and how a round is priced (edge/speculative/remote_gamma.py)."""
        self.hub = hub
        self.pricing = pricing or GammaPricing()
        self.sampling = sampling
        self.max_gamma = max_gamma
        self.vocab_size = hub.vocab_size
        self.name = f"remote:{hub.client}"
        self.deadline = deadline or Deadline()
        self.stats = DrafterStats()
        # the session, and joining again in the background when it is lost
        self.session: Optional[Session] = None
        self.refusal: Optional[str] = None
        self._pending_join = None
        self._next_join = 0.0
        self._join_backoff = Backoff(*rejoin_s)
        # the request on its way, and what the draft holds of our context
        self._out: Optional[Outstanding] = None
        self._held = DraftHeld()
        self._misses = 0                # requests given up on in a row
        self._busy_until = 0.0          # an overloaded draft service: no requests before this
        self._busy_backoff = Backoff(*BUSY_BACKOFF_S)
        # what the adaptive γ reads
        self.waits = RoundTrips()   # what each round's wait cost this target
        self.policy: Optional[RemoteGamma] = None   # the adaptive γ's, when there is one: its p_min goes out
        self._wait: Optional[Wait] = None           # this round's, while draft() runs
        self._probe: Optional[tuple] = None    # (L, drafts, asked): a background answer not yet scored
        # constrained output: the grammar the drafts follow, and whether the service has its text
        self._grammar = None
        self._grammar_from = 0
        self._grammar_known = False     # the service answered a request that carried the text
        self._grammar_sent: Optional[int] = None      # the first request (seq) that carried it
        self._grammar_refused: Optional[str] = None   # the service cannot use it: decode alone

    # ---- session management ----
    def connect(self, timeout: float = 5.0) -> Session:
        """Join now (blocking); raises JoinRefused with the hub's reason, or TimeoutError."""
        self.session = self.hub.join(min(self.max_gamma, MAX_GAMMA), self.sampling, timeout)
        self._reset_state()
        self.stats.joins += 1
        return self.session

    def _reset_state(self) -> None:
        self._out = None
        self._grammar_known, self._grammar_sent = False, None   # a new session has no grammar yet
        self._probe = None
        self._held = DraftHeld()
        self.stats.answered_since_join = 0

    def _ready(self) -> Optional[Session]:
        """The session to draft on now; None (decode alone) while there is none."""
        s = self.session
        if s is not None and not s.lost:
            return s if self.hub.link.is_connected() else None
        if s is not None:                          # lost: the hub restarted or went away
            self.session = None
            s.close()
        if not self.hub.hub_online:
            return None
        return self._rejoin(time.monotonic())

    def _rejoin(self, now: float) -> Optional[Session]:
        """Take the answer to a background join, or send one (or give one up) on its backoff."""
        pj = self._pending_join
        if pj is not None and pj.done.is_set():
            self._pending_join = None
            try:
                s = self.hub.finish_join(pj)
            except JoinRefused as e:                # retried with the backoff: the reason may pass
                self.refusal = e.reason
                self.stats.refused += 1
                return None
            if s is not None:
                self.session = s
                self._reset_state()
                self._join_backoff.reset()
                self.stats.rejoins += 1
                return s
        if self._pending_join is None and now >= self._next_join:
            self._pending_join = self.hub.join_async(min(self.max_gamma, MAX_GAMMA), self.sampling)
            self._next_join = now + self._join_backoff.failed()
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

    def adopt(self, session: Session, keep: int) -> None:
        """Draft on a session kept from an earlier generation: its draft holds our first `keep` tokens."""
        self.session = session
        self._reset_state()
        self._held = DraftHeld(keep)

    def held_for(self, context: Sequence[int]) -> int:
        """A lower bound on the tokens of `context` (the committed ones) the draft holds."""
        return min(self._held.keep_for(context), len(context))

    # ---- requests ----
    def constrain(self, grammar, start: int) -> None:
        """The drafts follow `grammar` from context position `start` on: the service applies it
        (the wire carries its id, and its text until the service has answered one request)."""
        same = grammar is not None and self._grammar is not None and grammar.id == self._grammar.id
        if not same or start != self._grammar_from:
            self._grammar, self._grammar_from = grammar, int(start)
            self._grammar_known, self._grammar_sent, self._grammar_refused = False, None, None

    def _grammar_fields(self) -> tuple:
        g = self._grammar
        if g is None:
            return "", "", 0
        return g.id, "" if self._grammar_known else g.text, self._grammar_from

    def prime(self, context: Sequence[int], gamma: int) -> bool:
        """Send the first request now, so the draft prefills while the target does.

        It asks gamma + 1 drafts after `context` (the prompt): the target picks the first token from
        its own prefill, without waiting (generate.py), and the first round takes the gamma drafts
        after it -- on time, not late. Its deadline starts at the first draft() call, not now."""
        s = self._ready()
        if s is None or self._out is not None or gamma < 1:
            return False
        if not self._send(s, list(context), gamma + 1, time.monotonic(), primed=True):
            return False
        self._out.ahead = 1
        return True

    def _send(self, s: Session, context: List[int], gamma: int, now: float, primed: bool = False,
              background: bool = False) -> bool:
        keep = min(self._held.keep_for(context), len(context))
        seq = s.next_seq()
        p_min = self.policy.p_min() if self.policy is not None else None
        if self._grammar_refused is not None:      # the service cannot draft under it: no requests
            return False
        grammar = self._grammar_fields()
        if not s.request(seq, keep, context[keep:], min(gamma, MAX_GAMMA), self.sampling, background, p_min,
                         grammar):
            return False
        if grammar[1] and self._grammar_sent is None:
            self._grammar_sent = seq
        self._held = DraftHeld(keep)
        d = self.deadline.for_gamma(gamma, self.waits.per_token_s)
        inf = float("inf")
        self._out = Outstanding(seq, keep, len(context), now, inf if primed else now + d,
                                inf if primed else now + max(4 * d, 0.05), len(context) - keep,
                                min(gamma, MAX_GAMMA))
        return True

    def _start_clock(self, out: Outstanding, now: float) -> None:
        d = self.deadline.for_gamma(out.gamma, self.waits.per_token_s)
        out.deadline, out.give_up = now + d, now + max(4 * d, 0.05)

    def _expire(self, s: Session) -> bool:
        """The outstanding request was given up on; True when the session is presumed lost."""
        self._out = None
        self.stats.timeouts += 1
        self.deadline.timed_out()
        self._misses += 1
        if self._misses < MAX_MISSES:
            return False
        self._misses = 0
        self.session = None
        s.close()
        return True

    def _book(self, s: Session, out: Outstanding, got) -> Optional[DraftResponse]:
        """Account for the answer `got` to `out`: round trips, errors, what the draft now holds.
        The DraftResponse, or None for an error."""
        msg, t_recv = got
        self._out = None
        self._misses = 0
        if out.fed <= SHORT_FEED:                  # a long feed (a prompt) is no round-trip sample
            self.deadline.sample(t_recv - out.sent, out.gamma, self.waits.per_token_s)
            self.stats.rtt_s.append(t_recv - out.sent)
        if isinstance(msg, Error):
            self._book_error(s, msg)
            return None
        assert isinstance(msg, DraftResponse)
        self.stats.answered += 1
        self._busy_backoff.reset()
        if self._grammar_sent is not None and msg.seq >= self._grammar_sent:
            self._grammar_known = True             # it has the text: the id alone from now on
        if out.fed <= SHORT_FEED:                  # round trip minus the draft's own time
            self.stats.overhead_s.append(max(0.0, t_recv - out.sent - msg.compute_us * 1e-6))
        self.stats.answered_since_join += 1
        if msg.tokens:
            self._held = DraftHeld(out.keep, out.length, tuple(msg.tokens))
        return msg

    def _book_error(self, s: Session, msg: Error) -> None:
        self.stats.errors += 1
        if msg.code == E_BAD_KEEP:
            self._held = DraftHeld()
        elif msg.code == E_UNKNOWN_SESSION:
            s.mark_lost()
        elif msg.code == E_BAD_GRAMMAR:
            self._grammar_refused = msg.message
        elif msg.code == E_OVERLOADED:
            self.stats.overloaded += 1
            self._busy_until = time.monotonic() + self._busy_backoff.failed()
        log.debug("draft error %s: %s", msg.code, msg.message)

    # ---- adaptive γ ----
    def gamma_policy(self, max_gamma: int) -> RemoteGamma:
        """γ from the running acceptance, the target's verify costs and the waits seen here."""
        self.policy = remote_gamma_policy(max_gamma, self.waits, self.pricing, self.sampling)
        return self.policy

    def observe(self, context: Sequence[int], gamma: int):
        """A background probe (edge.speculative.drafter.Drafter.observe): poll, never wait."""
        s = self._ready()
        if s is None:
            return None
        out, now = self._out, time.monotonic()
        if out is not None:
            self._poll_probe(s, out, now)
        elif gamma > 0 and self._probe is None and now >= self._busy_until:
            if self._send(s, list(context), gamma, now, background=True):
                self._out.background = True
                self.stats.probes += 1
        return self._score(context)

    def _poll_probe(self, s: Session, out: Outstanding, now: float) -> None:
        """Take the outstanding request's answer if it came (a probe's is kept to be scored)."""
        if out.primed:                             # primed: its clock starts now
            self._start_clock(out, now)
        got = s.wait(out.seq, 0.0)
        # a round's own request was already counted in the waits by draft(); a probe is here
        if got is not None:
            msg = self._book(s, out, got)
            if msg is not None and out.background:   # an empty answer too: a round would get nothing
                self.stats.probe_answers += 1
                self.waits.add(Wait(out.gamma, got[1] - out.sent, msg.compute_us * 1e-6,
                                    len(msg.tokens), short=out.fed <= SHORT_FEED))
            if msg is not None and msg.tokens:
                self._probe = (out.length, tuple(int(t) for t in msg.tokens[:out.gamma]), out.gamma)
        elif now >= out.give_up:
            if out.background:
                self.waits.add(Wait(out.gamma, now - out.sent, None))
            self._expire(s)

    def _score(self, context: Sequence[int]):
        """(asked, accepted) of the background answer once the target decoded past its drafts or
        a mismatch (edge/star/remote_probe.py); the probe is then scored and dropped."""
        scored = None if self._probe is None else score_probe(self._probe, context)
        if scored is not None:
            self._probe = None
        return scored

    # ---- one round ----
    def draft(self, context: Sequence[int], gamma: int, rng: np.random.Generator):
        t = time.monotonic()
        self._wait = None
        self.stats.rounds += 1
        try:
            return self._draft(list(context), gamma)
        finally:
            w = self._wait              # set only when this call sent a request and waited for it
            if w is not None:
                w.wall_s = time.monotonic() - t
                self.waits.add(w)

    def _draft(self, context: List[int], gamma: int):
        """Wait for an answer, book it, take its drafts. No drafts (the target decodes alone this
        round) without a session or an answer in time, on an error, or when the answer came late
        and the target went another way: then, once, when this round had not asked yet, ask now."""
        for may_retry in (True, False):
            s = self._ready()
            answer = self._answer(s, context, gamma) if s is not None else None
            if answer is None:
                self.stats.alone += 1
                break
            out, got = answer
            msg = self._book(s, out, got)
            if msg is None:
                break
            if self._wait is not None:
                self._wait.compute_s, self._wait.tokens = msg.compute_us * 1e-6, len(msg.tokens)
            skip = len(context) - out.length
            if skip and msg.tokens[:skip] != context[out.length:]:   # late, and the target went another way:
                if may_retry and self._wait is None:   # ask again now (after plain steps of γ auto: a probe)
                    continue
                break
            drafts = self._drafts(msg, skip, gamma, late=skip > out.ahead)
            if drafts is not None:
                return drafts
            break
        return [], []

    def _answer(self, s: Session, context: List[int], gamma: int) -> Optional[tuple]:
        """(request, (reply, time received)) for this round: the outstanding request's if it came,
        else a new request's within its deadline; None when there is none to use."""
        now = time.monotonic()
        out = self._out
        if out is not None and out.primed:         # primed: its clock starts now
            self._start_clock(out, now)
            self._wait = Wait(out.gamma, 0.0, None, short=out.fed <= SHORT_FEED)   # a round like any
        if out is not None and now >= out.give_up:
            got = s.wait(out.seq, 0.0)             # it may have come while this target decoded alone
            if got is not None:
                return out, got
            if self._expire(s):                    # a hub that forgot us answers nothing: rejoin
                return None
            out = None
        if out is None:
            out = self._request(s, context, gamma, now)
            if out is None:
                return None
        got = s.wait(out.seq, out.deadline)
        return None if got is None else (out, got)

    def _request(self, s: Session, context: List[int], gamma: int, now: float) -> Optional[Outstanding]:
        """Send this round's request, unless the draft said it is overloaded (leave it be)."""
        if now < self._busy_until or not self._send(s, context, gamma, now):
            return None
        self._wait = Wait(gamma, 0.0, None, short=self._out.fed <= SHORT_FEED)
        return self._out

    def _drafts(self, msg: DraftResponse, skip: int, gamma: int, late: bool) -> Optional[Tuple[list, list]]:
        """The answer's drafts past the `skip` tokens the target decoded meanwhile, each with its q;
        None when its q cannot be used exactly. late: the target decoded past what it was asked for."""
        if late:
            self.stats.late_used += 1
        # under a grammar the answer's forced tokens ride along its γ (the service does not count
        # them): all of it, the loop keeps γ drafts that had a choice (jump_forward.with_forced)
        end = len(msg.tokens) if self._grammar is not None else skip + gamma
        toks = [int(t) for t in msg.tokens[skip:end]]
        if msg.q is None:
            return toks, [SparseDist.one_hot(t) for t in toks]
        try:
            return toks, [SparseDist(i.astype(np.int64), p.astype(np.float64)) for i, p in msg.q[skip:end]]
        except ValueError as e:                    # a q we cannot use exactly: no speculation this round
            self.stats.errors += 1
            log.debug("unusable q from the draft: %s", e)
            return None
