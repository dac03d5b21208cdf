"""What the draft service and the verify service (edge/star/draft_service.py, verify_service.py)
share as cores over one engine's sequences: a session count no larger than the sequences the
engine holds, the KV memory limit (--max-kv-mb) reserved per request, closed sessions' sequences
freed between steps, a session cut back to the prefix it shares with a new context, and the
requests a step takes prepared with their refusals answered.

Each service makes its own sessions (at least `seq`, `fed`, `kv` and DraftSessions' fields) and
its own `_prepare(session, request, arrival)` and `_reset(session)`.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, List, Optional

from edge.engines.base import Engine, EngineError
from edge.speculative.common_prefix import common_prefix
from edge.star.draft_limits import DraftLimits, DraftRefused
from edge.star.draft_sessions import DraftSessions
from edge.wire.protocol import E_INTERNAL, E_OVERLOADED, Error


class EngineSessions(DraftSessions):
    service_kind = "draft"          # in refusals: "<kind> service"
    engine_role = "draft"           # in engine errors: "<role> engine: ..."

    def __init__(self, engine: Engine, limits: DraftLimits, clock: Callable[[], float], name: str):
        cap = getattr(engine, "capacity", None)
        if cap is not None and cap < limits.max_sessions:
            # an engine that holds a fixed number of sequences (llama.cpp's n_seq_max): a session
            # past it would fail mid-request, so the service refuses it at open (and its hello says so)
            limits = dataclasses.replace(limits, max_sessions=int(cap))
        super().__init__(limits, clock, name, engine.vocab_size)
        self.engine = engine
        self.fingerprint = getattr(engine, "fingerprint", "")
        self._to_free: List[int] = []
        self._freeing = 0                       # bytes of those, held until step frees them
        self._streams = itertools.count()       # stream numbers: no two sessions' streams coincide

    # ---- KV memory ----
    def kv_bytes(self) -> int:
        """What --max-kv-mb counts: the KV the engine holds (allocated, not only live tokens) for
        every session, reservations of the requests being served and closed ones not yet freed."""
        with self._lock:
            return sum(s.kv for s in self._sessions.values()) + self._freeing

    def _kv_limit(self) -> float:
        return self.limits.max_kv_mb * 1e6

    def _check_open(self) -> None:
        if self.kv_bytes() >= self._kv_limit():
            self.stats.count("refused_sessions")
            raise DraftRefused(f"{self.service_kind} service {self.name!r} has used its KV memory limit of "
                               f"{self.limits.max_kv_mb:g} MB; raise --max-kv-mb or add a "
                               f"{self.service_kind} service")

    def _reserve(self, s, need: int, refusal: str) -> None:
        """Reserve `need` bytes for s now, so the next request of the step is checked against this
        one's growth too; past the limit, DraftRefused(refusal)."""
        with self._lock:
            if need > s.kv and self.kv_bytes() + need - s.kv > self._kv_limit():
                self.stats.count("refused_kv")
                raise DraftRefused(refusal, E_OVERLOADED)
            s.kv = max(s.kv, need)

    def _release(self, s) -> None:
        if s.seq is not None:
            self._to_free.append(s.seq)            # freed by step, between batches
            self._freeing += s.kv

    def _free_closed(self) -> None:
        with self._lock:
            seqs, self._to_free, self._freeing = self._to_free, [], 0
        for q in seqs:
            self.engine.free(q)

    # ---- a session's sequence ----
    def _cut_back(self, s, context: List[int], start: int = 0) -> int:
        """Truncate s's KV to the prefix it shares with context (searched from `start`), keeping at
        least the last token to feed again, for its logits. Returns the length kept."""
        cut = min(common_prefix(s.fed, context, start=start), len(context) - 1)
        if cut < len(s.fed):
            self.engine.truncate(s.seq, cut)
            del s.fed[cut:]
        return cut

    def _tile_cut(self, s, cut: int, n_prefill: int) -> int:
        """`cut` moved back where a prefill of the `n_prefill` tokens after it costs more than one
        longer call (Engine.prefill_refeed: llama.cpp's CPU flash attention tiles 64 rows)."""
        back = self.engine.prefill_refeed(cut, n_prefill)
        if back:
            self.engine.truncate(s.seq, cut - back)
            del s.fed[cut - back:]
        return cut - back

    def _empty_sequence(self, s) -> None:
        """After an engine error: nothing of s's sequence is trusted any more."""
        if s.seq is not None:
            try:
                self.engine.truncate(s.seq, 0)
            except EngineError:
                pass

    # ---- a step's requests ----
    def _prepare_taken(self, busy=frozenset()) -> list:
        """Prepare every pending request (those of sessions in `busy` stay pending); a refused one
        is answered with its Error here. Returns the items `_prepare` made."""
        items = []
        for s, req, t_in in self._take(busy=busy):
            try:
                w = self._prepare(s, req, t_in)
            except DraftRefused as e:
                self._reply(s.sid, Error(s.sid, req.seq, e.code, e.reason))
                continue
            except EngineError as e:
                self._reset(s)
                self._reply(s.sid, Error(s.sid, req.seq, E_INTERNAL, f"{self.engine_role} engine: {e}"))
                continue
            if w is not None:
                items.append(w)
        return items

    def _prepare(self, s, req, t_in: float) -> Optional[object]:
        raise NotImplementedError

    def _reset(self, s) -> None:
        raise NotImplementedError
