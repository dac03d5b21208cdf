"""Prompt-lookup drafting: no model, just copy what followed the last n-gram
the last time it appeared (Saxena 2023, "prompt lookup decoding").

Good on code edits, summaries and chat that quote their input; nearly free to
run, so even a modest acceptance rate pays (c ~ 0 in the cost model).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from edge.speculative.drafter import Drafter
from edge.speculative.sampling import SparseDist


class NgramDrafter(Drafter):
    name = "ngram"
    vocab_size: Optional[int] = None   # works with any vocabulary

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context_tokens: Sequence[int], gamma: int) -> List[int]:
        """Up to gamma tokens that followed the most recent earlier occurrence
        of the context's last n tokens, trying the longest n first; [] if none."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        ctx = np.asarray(context_tokens, dtype=np.int64)
        size = ctx.size
        if gamma == 0 or size < 2:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            pattern = ctx[size - n:]
            # Windows starting at 0 .. size-n-1: every earlier occurrence that
            # is followed by at least one token.
            windows = sliding_window_view(ctx[: size - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ctx[start: start + gamma].tolist()
        return []

    def draft(self, context_tokens: Sequence[int], gamma: int,
              rng: Optional[np.random.Generator] = None) -> Tuple[List[int], List[SparseDist]]:
        """Drafter interface used by edge.speculative.generate: tokens and the q they were
        "sampled" from. A deterministic proposal is a sample from the one-hot
        q at that token, so stochastic verification stays exactly lossless."""
        tokens = self.propose(context_tokens, gamma)
        return tokens, [SparseDist.one_hot(t) for t in tokens]
