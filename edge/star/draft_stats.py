"""Busy/idle accounting of a draft service, for the StarSD system model.

T_γ = N·S(d) + T_idle (docs/architecture.md): S(d) is measured per batch size (one
batch serves every pending request), T_idle as the gaps in which the service
had nothing to do, and the busy ratio as busy / (busy + idle + draft-ahead).
Fed with seconds from the service's clock; reads no clock itself except
`clock` for the age of the current idle gap.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Dict, List

import numpy as np


class DraftStats:
    def __init__(self, clock: Callable[[], float], window: int = 4096):
        self.clock = clock
        self._lock = threading.Lock()
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Start a new measurement window (benchmarks call this after warm-up)."""
        with getattr(self, "_lock", threading.Lock()):
            self.busy_s = 0.0
            self.idle_s = 0.0
            self.ahead_s = 0.0
            self.counters: Dict[str, int] = {}
            self.batches: Dict[int, List[float]] = {}     # size -> [count, steps, seconds]
            self.batch_sizes: deque = deque(maxlen=self.window)
            self.steps_of_b: Dict[int, List[float]] = {}  # engine step's batch size -> [count, seconds]
            self.latencies: deque = deque(maxlen=self.window)   # arrival -> reply, seconds
            self.idle_gaps: deque = deque(maxlen=self.window)
            self._gap = 0.0
            self.requests = 0
            self.drafted = 0
            self.ahead_tokens = 0

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def add_idle(self, seconds: float) -> None:
        with self._lock:
            self.idle_s += seconds
            self._gap += seconds

    def add_batch(self, size: int, steps: int, seconds: float) -> None:
        with self._lock:
            self.busy_s += seconds
            b = self.batches.setdefault(size, [0, 0, 0.0])
            b[0] += 1
            b[1] += steps
            b[2] += seconds
            self.batch_sizes.append(size)
            if self._gap > 0:
                self.idle_gaps.append(self._gap)
                self._gap = 0.0

    def add_step(self, size: int, seconds: float) -> None:
        """One batched engine step over `size` requests' sequences: D(b) per step, whether a
        batch is served to completion or requests join it step by step."""
        with self._lock:
            b = self.steps_of_b.setdefault(size, [0, 0.0])
            b[0] += 1
            b[1] += seconds

    def add_request(self, drafted: int, latency: float) -> None:
        with self._lock:
            self.requests += 1
            self.drafted += drafted
            self.latencies.append(latency)

    def add_ahead(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.ahead_s += seconds
            self.ahead_tokens += tokens

    def snapshot(self) -> dict:
        """A plain dict (JSON-ready) of everything measured so far."""
        with self._lock:
            total = self.busy_s + self.idle_s + self.ahead_s
            lat = np.array(self.latencies) if self.latencies else np.zeros(0)
            s_of_d = {str(k): {"batches": int(v[0]), "mean_s": v[2] / v[0], "steps": int(v[1]),
                               "per_request_s": v[2] / (v[0] * k)}
                      for k, v in sorted(self.batches.items())}
            return {
                "requests": self.requests,
                "drafted_tokens": self.drafted,
                "busy_s": self.busy_s, "idle_s": self.idle_s, "ahead_s": self.ahead_s,
                "busy_ratio": self.busy_s / total if total > 0 else 0.0,
                "t_idle_mean_s": float(np.mean(self.idle_gaps)) if self.idle_gaps else 0.0,
                "batch_size_mean": float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0,
                "batch_size_max": int(max(self.batch_sizes)) if self.batch_sizes else 0,
                "s_of_d": s_of_d,
                "step_of_b": {str(k): {"steps": int(v[0]), "mean_s": v[1] / v[0]}
                              for k, v in sorted(self.steps_of_b.items())},
                "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else 0.0,
                "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else 0.0,
                "ahead_tokens": self.ahead_tokens,
                "counters": dict(self.counters),
            }
