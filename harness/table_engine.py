"""A deterministic toy model for the speculative-decoding tests (test_speculative, test_lossless).

Any deterministic function of the context is a legitimate autoregressive model
for the verification math; a hash-indexed table of random logits is one that
costs nothing and has no structure a drafter could exploit by accident.
"""
from types import SimpleNamespace

import numpy as np

from edge.engines.base import Engine


class TableEngine(Engine):
    """logits = table[hash(last `window` tokens) % rows]; window=None: whole context.
    A small window makes greedy text loop, which the n-gram drafter can catch."""
    name = "table"

    def __init__(self, vocab=16, rows=4099, seed=0, window=None, max_len=256):
        self.table = np.random.default_rng(seed).normal(0.0, 1.0, (rows, vocab))
        self.vocab_size, self.max_len, self.fingerprint = vocab, max_len, f"table-{seed}"
        self.window = window
        self.cfg = SimpleNamespace(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1)   # "KV": tokens
        self._seqs, self._next = {}, 0
        self.calls = []   # tokens per forward call, to check the loop's bookkeeping

    def row(self, ctx):
        key = tuple(ctx[-self.window:]) if self.window else tuple(ctx)
        return self.table[hash(key) % len(self.table)]

    def new_sequence(self):
        self._next += 1
        self._seqs[self._next] = []
        return self._next

    def free(self, seq):
        self._seqs.pop(seq, None)

    def length(self, seq):
        return len(self._seqs[seq])

    def forward(self, seq, tokens):
        self.check_room(seq, len(tokens))
        self.calls.append(len(tokens))
        ctx = self._seqs[seq]
        out = []
        for t in tokens:
            ctx.append(int(t))
            out.append(self.row(ctx))
        return np.array(out).reshape(len(out), self.vocab_size)

    def truncate(self, seq, n):
        del self._seqs[seq][n:]

    def tokens(self, seq):
        return list(self._seqs[seq])

    @property
    def active_sequences(self):
        return len(self._seqs)

    def step(self, seqs, tokens):
        return np.stack([self.forward(s, [t])[0] for s, t in zip(seqs, tokens)])
