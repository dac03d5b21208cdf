"""The StarSD system model: how many targets one draft service can feed.

A target's iteration is: wait for its draft (queue + batched service) and
then its return time R (verify γ+1 tokens on its own device + network round
trip). The draft service is work-conserving: whenever it is free and requests
are pending, it takes all of them as one batch, whose service time D(b) comes
from a measured table (batching amortises reading the weights, so D(b) grows
far slower than b). T_γ = N·S(d) + T_idle falls out of that: S(d) = D(b)/b is
the per-request service time at the batch size the load produces.

Instead of a closed-form queue approximation we run the model itself as a
small deterministic discrete-event simulation: fast (milliseconds), exact for
the model's assumptions, and it handles batch-size-dependent service times.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from edge.speculative.verify import expected_tokens


def interp_table(table: Dict[int, float], x: float) -> float:
    """Piecewise-linear in batch size; linear extrapolation past the last point."""
    ks = sorted(table)
    if len(ks) == 1:
        return table[ks[0]] * max(1.0, x / ks[0]) if x > ks[0] else table[ks[0]]
    if x >= ks[-1]:
        a, b = ks[-2], ks[-1]
        slope = (table[b] - table[a]) / (b - a)
        return table[b] + slope * (x - b)
    return float(np.interp(x, ks, [table[k] for k in ks]))


@dataclass
class SystemInputs:
    draft_step_ms: Dict[int, float]   # one batched draft step at batch size b (measured)
    draft_feed_ms: float              # feeding the `append` tokens of a request (per request)
    target_step_ms: float             # one target decode step on its device
    verify_cost: Dict[int, float]     # call over k tokens in target steps, k = γ+1
    rtt_ms: float                     # network + protocol round trip
    alpha: float                      # acceptance rate

    def draft_service_ms(self, batch: int, gamma: int) -> float:
        return self.draft_feed_ms * batch ** 0.5 + gamma * interp_table(self.draft_step_ms, batch)

    def return_ms(self, gamma: int) -> float:
        k = gamma + 1
        v = self.verify_cost.get(k) or interp_table(self.verify_cost, k)
        return self.target_step_ms * v + self.rtt_ms


@dataclass
class Prediction:
    n: int
    gamma: int
    system_tps: float
    per_target_tps: float
    standalone_tps: float
    busy_ratio: float
    mean_batch: float
    s_d_ms: float       # per-request service time at that load
    t_idle_ms: float    # draft idle time per target iteration
    iteration_ms: float


def simulate(inp: SystemInputs, n: int, gamma: int, iterations: int = 400) -> Prediction:
    """Closed loop of n targets around one work-conserving batching draft service."""
    R = inp.return_ms(gamma)
    # targets start staggered over one return time (they join at different moments)
    events = [(R * i / max(n, 1), i) for i in range(n)]
    heapq.heapify(events)
    t, busy, batches, served = 0.0, 0.0, [], 0
    free_at = 0.0
    while served < iterations * n:
        # the draft takes everything pending at the moment it becomes free
        arrival, tid = heapq.heappop(events)
        start = max(free_at, arrival)
        pending = [tid]
        while events and events[0][0] <= start:
            pending.append(heapq.heappop(events)[1])
        d = inp.draft_service_ms(len(pending), gamma)
        free_at = start + d
        busy += d
        batches.append(len(pending))
        for p in pending:
            served += 1
            heapq.heappush(events, (free_at + R, p))
        t = free_at
    horizon = t
    per_iter = horizon / iterations
    tokens = expected_tokens(inp.alpha, gamma)
    per_target = 1e3 * tokens * iterations / horizon
    busy_ratio = min(1.0, busy / horizon)
    mean_b = float(np.mean(batches))
    s_d = busy / (iterations * n)   # draft time per request, at the batch sizes the load produced
    return Prediction(n=n, gamma=gamma, system_tps=per_target * n, per_target_tps=per_target,
                      standalone_tps=1e3 / inp.target_step_ms, busy_ratio=busy_ratio,
                      mean_batch=mean_b, s_d_ms=s_d, t_idle_ms=max(0.0, (horizon - busy) / iterations),
                      iteration_ms=per_iter)


def sweep(inp: SystemInputs, ns: Sequence[int], gammas: Sequence[int]) -> List[Prediction]:
    """Best γ ≥ 1 per N; compare with `standalone` (γ = 0: every target decodes alone)."""
    out = []
    for n in ns:
        best = None
        for g in [g for g in gammas if g >= 1]:
            p = simulate(inp, n, g)
            if best is None or p.system_tps > best.system_tps:
                best = p
        out.append(best)
    return out


def standalone(inp: SystemInputs, n: int) -> Prediction:
    tps = 1e3 / inp.target_step_ms
    return Prediction(n=n, gamma=0, system_tps=tps * n, per_target_tps=tps, standalone_tps=tps,
                      busy_ratio=0.0, mean_batch=0.0, s_d_ms=0.0, t_idle_ms=0.0,
                      iteration_ms=inp.target_step_ms)


def n_full(preds: Sequence[Prediction], gain: float = 0.05, busy: float = 0.9) -> int:
    """Saturation: the first N whose draft is busy ≥ `busy` of the time, or past
    which doubling N adds less than `gain` of system throughput."""
    preds = sorted(preds, key=lambda p: p.n)
    for a, b in zip(preds, preds[1:]):
        if a.busy_ratio >= busy:
            return a.n
        if b.system_tps < a.system_tps * (1 + gain):
            return a.n
    return preds[-1].n


def format_table(preds: Sequence[Prediction]) -> str:
    nf = n_full(preds)
    rows = ["| N | γ | system tok/s | per-target tok/s | vs standalone | draft busy | mean batch | S(d) ms | T_idle ms | regime |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in preds:
        regime = "fully loaded" if p.n >= nf else "under-loaded"
        rows.append(f"| {p.n} | {p.gamma} | {p.system_tps:.1f} | {p.per_target_tps:.2f} | "
                    f"{p.per_target_tps / p.standalone_tps:.2f}x | {p.busy_ratio:.0%} | {p.mean_batch:.1f} | "
                    f"{p.s_d_ms:.1f} | {p.t_idle_ms:.1f} | {regime} |")
    rows.append(f"\nN_full = {nf}; standalone target: {preds[0].standalone_tps:.2f} tok/s each")
    return "\n".join(rows)
