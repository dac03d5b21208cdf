"""Concurrent generations on one engine: their forwards go to the engine as ONE call per round.

A device's endpoint with --parallel N runs each admitted request's generation loop in its own
thread, on its own sequence (edge/speculative/generate.py, edge/star/target.py: the loops are
unchanged). `BatchedCalls` wraps the engine those threads share. A forward or forward_last
goes into a queue; a thread that finds the engine idle runs the round: it takes every call
pending, runs the other queued operations in order (new_sequence, free, step, KV transfer),
then all the forwards as one `Engine.forward_batch` (llama.cpp: one llama_decode over their
sequences), and hands each thread its rows. No timer: a round is whatever is pending when the
engine frees, as in the draft service's loop (edge/runtime/loop.py); while one round runs the
next one gathers.

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
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError, tail_rows

__all__ = ["BatchedCalls", "shared_engine"]


class _Op:
    """One queued operation: a forward (call = (seq, tokens, n_rows)) or any other (fn)."""
    __slots__ = ("call", "fn", "result", "error", "done")

    def __init__(self, call: Optional[tuple] = None, fn: Optional[Callable] = None):
        self.call, self.fn = call, fn
        self.result, self.error, self.done = None, None, False

    def get(self):
        if self.error is not None:
            raise self.error
        return self.result


class BatchedCalls(Engine):
    """`inner`, safe to share between generation threads, its forwards batched (module doc)."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.vocab_size, self.max_len = inner.vocab_size, inner.max_len
        self.fingerprint, self.name, self.cfg = inner.fingerprint, inner.name, inner.cfg
        self.capacity, self.kv_itemsize = inner.capacity, inner.kv_itemsize
        self._cv = threading.Condition()
        self._pending: List[_Op] = []
        self._busy = False                     # a round is running (outside the lock)
        self._cut: Dict[int, int] = {}         # truncations waiting for the engine to be idle
        # rounds: forward_batch calls; forwards: the calls they served; largest: most in one round
        self.stats = {"rounds": 0, "forwards": 0, "largest": 0}

    def where(self) -> str:
        return self.inner.where()

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

    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        return self._exclusive(lambda: self.inner.export_kv(seq, dtype, meta))

    def import_kv(self, blob: bytes) -> int:
        return self._exclusive(lambda: self.inner.import_kv(blob))

    def check_kv(self, blob: bytes) -> dict:
        return self.inner.check_kv(blob)

    # ---- rounds ----
    def _exclusive(self, fn: Callable):
        """fn() with the engine to itself: at once when it is idle, else in the next round."""
        with self._cv:
            if not self._busy:
                self._apply_cuts()
                return fn()
        return self._submit(_Op(fn=fn))

    def _submit(self, op: _Op):
        with self._cv:
            self._pending.append(op)
            while self._busy and not op.done:
                self._cv.wait()
            if op.done:
                return op.get()
            batch, self._pending, self._busy = self._pending, [], True    # this thread runs the round
            self._apply_cuts()
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
                self._cv.notify_all()
        return op.get()

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
        try:
            rows = self.inner.forward_batch([o.call for o in fwd])
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


def shared_engine(engine: Engine, parallel: int) -> Engine:
    """The engine `parallel` concurrent generations use: itself for one, else wrapped in BatchedCalls."""
    return engine if parallel <= 1 or isinstance(engine, BatchedCalls) else BatchedCalls(engine)
