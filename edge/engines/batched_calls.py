"""Concurrent generations on one engine: their forwards go to the engine as ONE call per round.

A device's endpoint with --parallel N runs each admitted request's generation loop in its own
thread, on its own sequence (edge/speculative/generate.py, edge/star/target.py: the loops are
unchanged). `BatchedCalls` wraps the engine those threads share. A forward or forward_last
goes into a queue; a thread that finds the engine idle runs the round: it takes every call
pending, runs the other queued operations in order (new_sequence, free, step, KV transfer),
then all the forwards as one `Engine.forward_batch` (llama.cpp: one llama_decode over their
sequences), and hands each thread its rows.

Which forwards a round waits for: a generation loop joins the rounds (`join_rounds`, from
edge/speculative/generate.py's _Run) and a round's forwards start once every joined generation
has one pending, as llama-server's slots all go into one batch. Without that wait a round was
whatever was pending when the engine freed: the threads still picking their last token missed it,
and 4 generations ran as rounds of ~1 and ~3 (on the 0.5B at one thread a 4-row llama_decode costs
1.6x a 1-row one, so every split round nearly doubles the cost of its tokens). A generation busy
elsewhere (a draft on its way from the hub, a slow client's socket) is waited for at most about one
round's time (`linger_s`), then the round goes without it. Other operations (new_sequence, free,
KV transfer) never wait: they run whenever the engine is idle.

What a round cost (its rows, all generations', and its seconds) is told to each thread it served
(`served_round`), with how many generations share the rounds (`sharing_of`): adaptive γ prices
a round of N generations verifying γ+1 rows each, not one alone (edge/speculative/remote_gamma.py).

truncate (a rejection's rollback) never waits for a round: with the engine idle it runs at
once, else it is recorded and applied before the next round's forwards; length and tokens see
it at once. Reads of a sequence (length, tokens) go straight to the engine: only the thread
that owns a sequence feeds it.

Lossless: a round's forwards are each sequence's own tokens at its own positions. An engine
whose batched pass computes each row as its one-sequence pass does (the default forward_batch,
torch) gives every request exactly its output served alone; llama.cpp's batched rows differ
from its single ones in the last bits (docs/models.md). An error in a batched call is retried
call by call (forward_batch is all or nothing), so only the failing call's thread sees it.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError, tail_rows

__all__ = ["BatchedCalls", "join_rounds", "served_round", "shared_engine", "sharing_of"]

MAX_LINGER_S = 0.25        # the longest a round waits for a joined generation that is busy elsewhere
MIN_LINGER_S = 0.002


class _Op:
    """One queued operation: a forward (call = (seq, tokens, n_rows)) or any other (fn)."""
    __slots__ = ("call", "fn", "result", "error", "done", "thread")

    def __init__(self, call: Optional[tuple] = None, fn: Optional[Callable] = None):
        self.call, self.fn = call, fn
        self.result, self.error, self.done = None, None, False
        self.thread = threading.get_ident()

    def get(self):
        if self.error is not None:
            raise self.error
        return self.result


class BatchedCalls(Engine):
    """`inner`, safe to share between generation threads, its forwards batched (module doc)."""

    def __init__(self, inner: Engine, linger_s: Optional[float] = None):
        """linger_s: how long a round's forwards wait for a joined generation that has none pending;
        None: the last round's seconds, within MIN_LINGER_S..MAX_LINGER_S (a fixed bound: tests)."""
        self.inner, self.linger_s = inner, linger_s
        self.vocab_size, self.max_len = inner.vocab_size, inner.max_len
        self.fingerprint, self.name, self.cfg = inner.fingerprint, inner.name, inner.cfg
        self.capacity, self.kv_itemsize, self.forks = inner.capacity, inner.kv_itemsize, inner.forks
        self.saves = inner.saves
        self._cv = threading.Condition()
        self._pending: List[_Op] = []
        self._busy = False                     # a round is running (outside the lock)
        self._cut: Dict[int, int] = {}         # truncations waiting for the engine to be idle
        self._members: Dict[int, int] = {}     # joined generations: thread id -> joins
        self._idle_since = time.monotonic()    # the last round's end (or the first forward's arrival)
        self._round_s = 0.0                    # the last forward round's seconds
        self._served: Dict[int, tuple] = {}    # thread id -> (rows, seconds) of the round that served its last forward
        # rounds: forward_batch calls; forwards: the calls they served; largest: most in one round;
        # lingered: rounds that went without a joined generation (busy elsewhere past linger_s)
        self.stats = {"rounds": 0, "forwards": 0, "largest": 0, "lingered": 0}

    def where(self) -> str:
        return self.inner.where()

    def prefill_refeed(self, held: int, new: int) -> int:
        return self.inner.prefill_refeed(held, new)

    # ---- reads: straight to the engine (a pending truncation applied to what they say) ----
    def length(self, seq: int) -> int:
        with self._cv:
            n, cut = self.inner.length(seq), self._cut.get(seq)
        return n if cut is None else min(n, cut)

    def tokens(self, seq: int) -> list:
        with self._cv:
            toks, cut = self.inner.tokens(seq), self._cut.get(seq)
        return toks if cut is None else toks[:cut]

    @property
    def active_sequences(self) -> int:
        return self.inner.active_sequences

    def seq_kv_bytes(self, seq: Optional[int], length: Optional[int] = None) -> int:
        if seq is not None and length is None:
            length = self.length(seq)
        return self.inner.seq_kv_bytes(seq, length)

    # ---- writes ----
    def truncate(self, seq: int, n: int) -> None:
        have = self.length(seq)
        if not 0 <= n <= have:
            raise EngineError(f"cannot truncate to {n}: the sequence holds {have} tokens")
        with self._cv:
            if self._busy:
                self._cut[seq] = n
            else:
                self.inner.truncate(seq, n)

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        return self._submit(_Op(call=(seq, [int(t) for t in tokens], False)))

    def forward_last(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        return self._submit(_Op(call=(seq, [int(t) for t in tokens], True)))

    def forward_tail(self, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        return self._submit(_Op(call=(seq, [int(t) for t in tokens], tail_rows(n_rows))))

    def forward_batch(self, calls: Sequence[tuple]) -> List[np.ndarray]:
        return self._exclusive(lambda: self.inner.forward_batch(calls))

    def new_sequence(self) -> int:
        return self._exclusive(self.inner.new_sequence)

    def free(self, seq: int) -> None:
        def free() -> None:
            self._cut.pop(seq, None)
            self.inner.free(seq)
        self._exclusive(free)

    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self._exclusive(lambda: self.inner.step(seqs, tokens))

    def fork(self, seq: int, n: int) -> int:
        return self._exclusive(lambda: self.inner.fork(seq, n))

    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        return self._exclusive(lambda: self.inner.export_kv(seq, dtype, meta))

    def import_kv(self, blob: bytes) -> int:
        return self._exclusive(lambda: self.inner.import_kv(blob))

    def check_kv(self, blob: bytes) -> dict:
        return self.inner.check_kv(blob)

    def save_sequence(self, seq: int):
        return self._exclusive(lambda: self.inner.save_sequence(seq))

    def restore_sequence(self, saved) -> int:
        return self._exclusive(lambda: self.inner.restore_sequence(saved))

    # ---- rounds ----
    def sharing(self) -> int:
        """Generations a round of this thread's would serve now: those joined, and this thread's own
        when it has not joined yet (a generation pricing its first request before its prefill)."""
        with self._cv:
            return len(self._members) + (threading.get_ident() not in self._members)

    def served_round(self) -> Optional[tuple]:
        """(rows, seconds) of the whole round that served this thread's last forward: what its call
        cost the engine, other generations' rows included (its own wall time also counts the queue)."""
        with self._cv:
            return self._served.get(threading.get_ident())

    def join(self) -> Callable[[], None]:
        """This thread's generation joins the rounds: they wait for its forwards; -> leave()."""
        me, left = threading.get_ident(), []

        def leave() -> None:
            with self._cv:
                if not left:
                    left.append(True)
                    self._members[me] -= 1
                    if not self._members[me]:
                        del self._members[me]
                        self._served.pop(me, None)
                    self._cv.notify_all()     # a round may have been waiting for this one
        with self._cv:
            self._members[me] = self._members.get(me, 0) + 1
        return leave

    def _exclusive(self, fn: Callable):
        """fn() with the engine to itself: at once when it is idle, else in the next round."""
        with self._cv:
            if not self._busy:
                self._apply_cuts()
                return fn()
        return self._submit(_Op(fn=fn))

    def _submit(self, op: _Op):
        with self._cv:
            if op.call is not None and not any(o.call is not None for o in self._pending):
                self._idle_since = max(self._idle_since, time.monotonic())   # linger counts from here
            self._pending.append(op)
            self._cv.notify_all()             # the round joined generations wait for may be whole now
        while True:
            with self._cv:
                batch = self._next_round(op)
                if batch is None:
                    return op.get()
            self._run_round(batch)

    def _next_round(self, op: _Op) -> Optional[List[_Op]]:
        """Wait until `op` is done (-> None) or this thread may run a round (-> its ops; the lock held)."""
        while not op.done:
            if not self._busy:
                batch = self._take()
                if batch:
                    self._busy = True
                    self._apply_cuts()
                    return batch
            self._cv.wait(self._wait_s())
        return None

    def _take(self) -> List[_Op]:
        """The ops a round may run now: every pending one once the forwards are ready, else the
        non-forward ones (they never wait)."""
        fwd = [o for o in self._pending if o.call is not None]
        missing = set(self._members) - {o.thread for o in fwd}
        if fwd and (not missing or self._lingered()):
            self.stats["lingered"] += bool(missing)
            batch, self._pending = self._pending, []
            return batch
        batch = [o for o in self._pending if o.call is None]
        self._pending = fwd
        return batch

    def _linger(self) -> float:
        if self.linger_s is not None:
            return self.linger_s
        return min(max(self._round_s, MIN_LINGER_S), MAX_LINGER_S)

    def _lingered(self) -> bool:
        return time.monotonic() - self._idle_since >= self._linger()

    def _wait_s(self) -> Optional[float]:
        """How long the condition wait may sleep: until linger runs out when forwards wait for a
        round, else until notified."""
        if self._busy or not any(o.call is not None for o in self._pending):
            return None
        return max(0.0, self._idle_since + self._linger() - time.monotonic())

    def _run_round(self, batch: List[_Op]) -> None:
        try:
            self._run(batch)
        except BaseException as e:          # KeyboardInterrupt and the like: every caller hears it
            for o in batch:
                if o.result is None and o.error is None:
                    o.error = e
            raise
        finally:
            with self._cv:
                for o in batch:
                    o.done = True
                self._busy = False
                self._idle_since = time.monotonic()
                self._cv.notify_all()

    def _apply_cuts(self) -> None:
        """The recorded truncations, now that the engine is this thread's (the lock held)."""
        cuts, self._cut = self._cut, {}
        for seq, n in cuts.items():
            self.inner.truncate(seq, n)

    def _run(self, batch: List[_Op]) -> None:
        fwd = [o for o in batch if o.call is not None]
        for o in batch:
            if o.fn is not None:
                _settle(o, o.fn)
        if not fwd:
            return
        self.stats["rounds"] += 1
        self.stats["forwards"] += len(fwd)
        self.stats["largest"] = max(self.stats["largest"], len(fwd))
        t = time.monotonic()
        try:
            rows = self.inner.forward_batch([o.call for o in fwd])
            self._round_s = time.monotonic() - t
            served = (sum(len(o.call[1]) for o in fwd), self._round_s)
            with self._cv:
                self._served.update((o.thread, served) for o in fwd)
        except Exception as e:
            if len(fwd) == 1:
                fwd[0].error = e
                return
            for o in fwd:                   # all or nothing: find which call failed, alone
                _settle(o, lambda o=o: self.inner.forward_batch([o.call])[0])
            return
        for o, r in zip(fwd, rows):
            o.result = r


def _settle(op: _Op, fn: Callable) -> None:
    try:
        op.result = fn()
    except Exception as e:
        op.error = e


def join_rounds(engine: Engine) -> Callable[[], None]:
    """A generation on `engine` joins its rounds when it is shared (BatchedCalls); -> leave()."""
    return engine.join() if isinstance(engine, BatchedCalls) else _stay


def served_round(engine: Engine) -> Optional[tuple]:
    """(rows, seconds) of the round that served this thread's last forward on a shared engine (every
    generation's rows, the round's own time, no queue wait); None for an engine not shared."""
    return engine.served_round() if isinstance(engine, BatchedCalls) else None


def sharing_of(engine: Engine) -> Callable[[], int]:
    """How many generations share `engine`'s rounds now (1 for an engine not shared)."""
    return engine.sharing if isinstance(engine, BatchedCalls) else _alone


def _alone() -> int:
    return 1


def _stay() -> None:
    pass


def shared_engine(engine: Engine, parallel: int) -> Engine:
    """The engine `parallel` concurrent generations use: itself for one, else wrapped in BatchedCalls."""
    return engine if parallel <= 1 or isinstance(engine, BatchedCalls) else BatchedCalls(engine)
