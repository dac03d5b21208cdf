"""The StarSD target: verify locally, draft remotely (edge/star/remote_drafter.py), never
depend on the draft. The output is the target's alone (greedy: its exact greedy text)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine
from edge.engines.batched_calls import BatchedCalls, sharing_of
from edge.speculative.generate import GenResult, generate_speculative
from edge.speculative.prefix_cache import PrefixCache
from edge.speculative.remote_gamma import GammaPricing
from edge.star.remote_drafter import RemoteDrafter
from edge.star.remote_round import Deadline
from edge.star.session_reuse import KEEP_SESSION_S, KeptSession, best_kept, keep_session, resume
from edge.star.hub_client import HubClient, JoinRefused
from edge.speculative.sampling import GREEDY, SamplingParams
from edge.speculative.verify_costs import measure_verify_costs

__all__ = ["Deadline", "RemoteDrafter", "StarTarget"]
SHARED_KS = (12, 16, 24)      # verify-cost rows measured beside KS on an engine generations share
log = logging.getLogger(__name__)


class StarTarget:
    """A target device: its engine, its link to the hub, and generation.

    Several generations may run at once, each in its own thread (the HTTP endpoint admits
    --parallel N: edge/api/admission.py), on an engine they can share (edge/engines/batched_calls.py
    batches their verify calls). Each generation has its own hub session, or, with a prompt
    cache, a kept one while it is fresh (edge/star/session_reuse.py): the draft keeps its KV too.
    Up to keep_sessions are kept (the last to end; --parallel N keeps N), and a generation takes its
    own conversation's (session_reuse.best_kept), joins anew while there is room, else takes the
    longest shared prefix: sessions held stay <= N.
    """

    def __init__(self, engine: Engine, hub: HubClient, gamma: int = 4, join_timeout: float = 3.0,
                 adaptive: bool = False, prefix_cache: Optional[PrefixCache] = None,
                 keep_session_s: float = KEEP_SESSION_S, keep_sessions: int = 1):
        """gamma: drafted tokens per round; with adaptive=True the largest γ, each round choosing
        one in 0..gamma (edge/speculative/remote_gamma.py). prefix_cache: the KV of recent
        conversations, reused by the next request sharing a prefix (edge/speculative/prefix_cache.py)."""
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 for a StarSD target, got {gamma}")
        self.engine, self.hub, self.gamma, self.adaptive = engine, hub, gamma, adaptive
        self.join_timeout = join_timeout
        self.verify_costs: Optional[dict] = None    # measured at the first adaptive generation
        self.stop_aware = True      # γ=auto's pricing (GammaPricing.stop_aware; False: A/B runs)
        self.lock = threading.Lock()                  # calibration; the counters and the kept session
        self.active = 0                               # generations running now
        self.last_drafter: Optional[RemoteDrafter] = None
        self.prefix_cache, self.keep_session_s = prefix_cache, keep_session_s
        self.keep_sessions = max(1, int(keep_sessions))
        self._kept: List[KeptSession] = []            # ended generations' sessions, kept open, oldest first
        # a join no hub answered: later generations decode alone at once (their drafters join in
        # the background) until a hub is heard from (its status) or one of them joins
        # hub.spoken when the last join got no answer (None: answered). With several hubs there is no
        # one status to compare (hub.status stays None): a target cut off from its broker waited for a
        # status that never came and drafted again only if a background join beat its generation's end
        self._unanswered: Optional[int] = None
        # telemetry (edge/telemetry/readings.py): tokens as they are committed, acceptance per generation
        self.counts = {"generations": 0, "tokens": 0, "accepted": 0, "drafted": 0, "busy_s": 0.0}
        self._t0 = time.monotonic()
        hub.start()
        if adaptive:
            self.calibrate()

    def telemetry(self) -> dict:
        return {**self.counts, "sessions": self.active, "wall_s": time.monotonic() - self._t0,
                "dropped": dict(self.hub.keys.dropped)}

    def calibrate(self) -> dict:
        """Measure this engine's verify-cost curve now (seconds per call over k tokens), so that
        the first adaptive generation does not pay for it; an adaptive target does at start."""
        with self.lock:
            return self._calibrate()

    def _calibrate(self) -> dict:
        c = measure_verify_costs(self.engine)    # k = 1..8 (KS): γ up to 8 reads them
        if isinstance(self.engine, BatchedCalls):
            # rounds shared with other generations hold their rows too: a verify over 12 to 24 rows is
            # priced from a measure, not a line from k = 6..8 (flat on one core for the 0.5B: 2.29 vs 2.44
            # steps, then 3.14 at 12)
            c.update(measure_verify_costs(self.engine, SHARED_KS, repeats=1))
        self.verify_costs = c
        log.info("verify cost over k tokens, in one-token steps (%.1f ms): %s", 1e3 * c[1],
                 " ".join(f"{k}:{v / c[1]:.2f}" for k, v in sorted(c.items())))
        return c

    def check_join(self, params: SamplingParams = GREEDY) -> None:
        """Join once and leave: raises JoinRefused (with the hub's reason) or TimeoutError."""
        d = RemoteDrafter(self.hub, params.to_wire(), self.gamma)
        try:
            if not self._connect(d):
                raise TimeoutError("no hub answered the last join, and none has spoken since")
        finally:
            d.close()

    def _connect(self, drafter: RemoteDrafter) -> bool:
        """Join, waiting up to join_timeout (TimeoutError, JoinRefused), unless the last join got no
        answer and no hub has spoken since: then False at once, and the drafter joins in the
        background (RemoteDrafter._ready) while the target decodes alone -- not every request
        waiting join_timeout for a hub that is not there."""
        if self._unanswered is not None and self._unanswered == self.hub.spoken:
            return False
        try:
            drafter.connect(self.join_timeout)
        except TimeoutError:
            self._unanswered = self.hub.spoken
            raise
        self._unanswered = None
        return True

    def generate(self, prompt_ids: Sequence[int], max_new: int, params: SamplingParams = GREEDY,
                 stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int], None]] = None,
                 deadline: Optional[Deadline] = None,
                 on_logits: Optional[Callable[[int, np.ndarray], None]] = None,
                 grammar=None) -> GenResult:
        """Speculative generation through the star. on_logits(token, row): the target's own row
        each committed token was chosen from (generate_speculative), drafted or not. grammar: an
        edge.speculative.grammar.Grammar the output follows; the draft service proposes under it too."""
        with self.lock:
            if self.adaptive and self.verify_costs is None:
                self._calibrate()
            room = len(self._kept) + self.active < self.keep_sessions    # for one more session
            kept = best_kept(self._kept, prompt_ids, room)     # a kept session no other generation took
            self.active += 1
        try:
            return self._generate(kept, prompt_ids, max_new, params, stop_ids, on_token, deadline, on_logits,
                                  grammar)
        finally:
            with self.lock:
                self.active -= 1

    def _generate(self, kept, prompt_ids, max_new, params, stop_ids, on_token, deadline, on_logits,
                  grammar) -> GenResult:
        """One generation on its own session (`kept`: the kept one it took, or None: join)."""
        pricing = GammaPricing((self.verify_costs or {}) if self.adaptive else {}, self.stop_aware, self._sharing)
        drafter = RemoteDrafter(self.hub, params.to_wire(), self.gamma, deadline, pricing=pricing)
        self.last_drafter = drafter
        drafter.constrain(grammar, len(prompt_ids))     # before the primed first request
        committed = list(prompt_ids)
        try:
            if not resume(kept, drafter, prompt_ids, self.keep_session_s):
                self._connect(drafter)
            first = drafter.gamma_policy(self.gamma).first_gamma if self.adaptive else self.gamma
            # drafts for the round after the first token (the target's own, from its prefill)
            drafter.prime(prompt_ids, min(first, max(0, max_new - 2)))
        except JoinRefused as e:
            log.warning("%s; decoding without a draft", e)
            drafter.refusal = e.reason
        except TimeoutError as e:
            log.warning("%s; decoding without a draft until the hub answers", e)
        def counted(t: int) -> None:
            with self.lock:
                self.counts["tokens"] += 1
            committed.append(t)
            if on_token is not None:
                on_token(t)
        t0 = time.monotonic()
        try:
            res = generate_speculative(self.engine, drafter, prompt_ids, max_new, self.gamma,
                                       params=params, stop_ids=stop_ids, on_token=counted,
                                       adaptive=self.adaptive, on_logits=on_logits, grammar=grammar,
                                       cache=self.prefix_cache)
            with self.lock:
                self.counts["accepted"] += res.n_accepted
                self.counts["drafted"] += res.n_drafted
                self.counts["generations"] += 1
            return res
        finally:
            self._end(drafter, committed, time.monotonic() - t0)

    def _sharing(self) -> int:
        """Generations sharing the engine's rounds (adaptive γ prices them): those joined to its rounds,
        or those running here when more (requests that came together, some still before their prefill)."""
        return max(sharing_of(self.engine)(), self.active)

    def _end(self, drafter: RemoteDrafter, committed: list, busy_s: float) -> None:
        """A generation's end: its session kept for the next ones (the last keep_sessions to end), or closed."""
        if drafter.session is not None:
            self._unanswered = None                   # a hub answered (a background join)
        new = keep_session(drafter, committed) if self.prefix_cache is not None else drafter.close()
        with self.lock:
            self.counts["busy_s"] += busy_s
            if new is not None:
                self._kept.append(new)
            gone, self._kept = self._kept[:-self.keep_sessions], self._kept[-self.keep_sessions:]
        for old in gone:
            old.session.close()
