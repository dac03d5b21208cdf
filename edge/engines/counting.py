"""An Engine wrapper that counts verification rounds and greedy acceptance (demos, benchmarks).

Every forward call on a sequence that already holds tokens is one round of the
target's loop: its first token is the committed one, the rest are drafts; a
draft counts as accepted while it equals the argmax of the logits before it
(greedy acceptance, what the live tables show). Prefills (the first call on a
sequence, or forward_last) are not rounds.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edge.engines.base import Engine


class CountingEngine(Engine):
    def __init__(self, inner: Engine):
        self.inner = inner
        self.vocab_size, self.max_len = inner.vocab_size, inner.max_len
        self.fingerprint, self.name = inner.fingerprint, inner.name
        self.cfg, self.capacity, self.kv_itemsize = inner.cfg, inner.capacity, inner.kv_itemsize
        self.calls = 0          # rounds: target calls after prefill (plain steps included)
        self.drafted = 0
        self.accepted = 0
        self.plain = 0          # rounds without drafts (draft late, or decoding alone)

    @property
    def rounds(self) -> int:
        return self.calls

    def new_sequence(self) -> int:
        return self.inner.new_sequence()

    def free(self, seq: int) -> None:
        self.inner.free(seq)

    def length(self, seq: int) -> int:
        return self.inner.length(seq)

    def truncate(self, seq: int, n: int) -> None:
        self.inner.truncate(seq, n)

    def tokens(self, seq: int) -> list:
        return self.inner.tokens(seq)

    def prefill_refeed(self, held: int, new: int) -> int:
        return self.inner.prefill_refeed(held, new)

    @property
    def active_sequences(self) -> int:
        return self.inner.active_sequences

    def seq_kv_bytes(self, seq, length=None) -> int:
        return self.inner.seq_kv_bytes(seq, length)

    def step(self, seqs, tokens) -> np.ndarray:
        return self.inner.step(seqs, tokens)

    def forward_last(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        return self.inner.forward_last(seq, tokens)

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        fresh = self.inner.length(seq) == 0
        out = self.inner.forward(seq, tokens)
        if not fresh:
            self.count(out.argmax(axis=-1), tokens)
        return out

    def count(self, best: np.ndarray, tokens: Sequence[int]) -> None:
        """Book one round: `best` the argmax after each fed token, `tokens` the fed ones."""
        n = 0
        while n < len(tokens) - 1 and int(best[n]) == int(tokens[n + 1]):
            n += 1
        self.calls += 1
        self.drafted += len(tokens) - 1
        self.accepted += n
        self.plain += len(tokens) == 1
