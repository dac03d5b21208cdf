"""The target's verify-cost curve, measured once per engine: seconds of one call over k tokens.

Adaptive γ needs v(k) = cost of a call over k tokens in single steps for every k it may choose.
Learnt only from live rounds it knows v(1) and v(2) after exploring, and extrapolating a line
through them is wrong both ways: on one AVX-512 core Qwen2.5-Coder-1.5B Q4_K_M costs
v(2)≈1.2, v(4)≈3.7 (compute-bound) while the same weights as F16 cost v(2)≈1.5, v(4)≈1.7
(memory-bound, a kernel switch between 2 and 4). So a StarTarget times its engine once, on a
scratch sequence, for k in KS (medians of `repeats`, after a warm-up call), and seeds every
generation's CostTracker with it; live rounds then replace the seeds as they come.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Sequence

from edge.engines.base import Engine

KS = (1, 2, 3, 4, 6, 8)
CONTEXT = 32          # tokens in the scratch sequence: attention at a short, typical context


def measure_verify_costs(engine: Engine, ks: Sequence[int] = KS, repeats: int = 3,
                         token: int = 0) -> Dict[int, float]:
    """{k: median seconds of engine.forward over k tokens} on a scratch sequence, freed after."""
    top = max(ks)
    seq = engine.new_sequence()
    try:
        engine.check_room(seq, CONTEXT + top + 1)
        engine.forward_last(seq, [token] * CONTEXT)
        engine.forward(seq, [token] * top)             # warm-up: first calls of a size pay setup
        engine.truncate(seq, CONTEXT)
        out: Dict[int, float] = {}
        for k in ks:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                engine.forward(seq, [token] * k)
                times.append(time.perf_counter() - t)
                engine.truncate(seq, CONTEXT)
            out[int(k)] = statistics.median(times)
        return out
    finally:
        engine.free(seq)
