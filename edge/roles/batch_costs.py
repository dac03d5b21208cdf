"""How many pending requests one batch of the draft service should take: all, unless one pays more.

A batched engine step over b sequences costs D(b). Serving n pending requests as one batch costs
γ·D(n); in chunks of c, one after another, (n/c)·γ·D(c), and the first chunk's answers leave
sooner. On a GPU D(b) is nearly flat, so one batch of all is best. On one CPU core it is not:
llama.cpp's Q4_0 0.5B measured D(2) = 2.5·D(1) (benchmarks/draft_formats.md), so two requests
served as one batch both wait longer than served one after the other. `BatchCosts` keeps the
measured D(b) and serves one at a time where that costs less per sequence.

Pure: fed with seconds, reads no clock.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Dict, Optional


class BatchCosts:
    """Measured seconds of one batched step by batch size; `chunk(n)` picks the batch to take.

    Two choices: all n pending in one batch, or one request at a time. One at a time only where a
    single step, measured at least `min_samples` times (as a step over n is), costs less than a
    step over n per sequence, D(1) < D(n)/n, by `margin`. Only these two are compared: the least
    of many noisy per-sequence costs would look cheaper by chance. Sizes are measured as they
    occur (a lone request; a session whose drafts end before the others'), and every `refresh`
    decisions all n are taken again, so D(n) follows the machine."""

    def __init__(self, window: int = 16, margin: float = 0.1, refresh: int = 32, min_samples: int = 3):
        self.window, self.margin, self.refresh, self.min_samples = window, margin, refresh, min_samples
        self._seconds: Dict[int, deque] = {}
        self._decisions = 0

    def record(self, batch: int, seconds: float) -> None:
        if batch < 1 or seconds < 0:
            raise ValueError(f"a step needs batch >= 1 and seconds >= 0, got {batch}, {seconds}")
        self._seconds.setdefault(batch, deque(maxlen=self.window)).append(seconds)

    def step_s(self, batch: int) -> Optional[float]:
        """Median measured seconds of a step over `batch` sequences (None: measured too few times)."""
        d = self._seconds.get(batch)
        return statistics.median(d) if d and len(d) >= self.min_samples else None

    def chunk(self, n: int) -> int:
        """How many of `n` pending requests to serve in the next batch (the oldest first)."""
        if n <= 1:
            return n
        self._decisions += 1
        all_s, one_s = self.step_s(n), self.step_s(1)
        if all_s is None or one_s is None or self._decisions % self.refresh == 0:
            return n
        return 1 if one_s < all_s / n * (1.0 - self.margin) else n
