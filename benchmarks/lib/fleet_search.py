"""N targets over K hubs and M draft services: the sweep, and the smallest M (and K) at which a
target still gains the goal's speedup.

Hubs are identical and share nothing (M a multiple of K, targets spread evenly, no round crosses
broker nodes: benchmarks/lib/fleet_des.py), so a fleet of K hubs is K copies of one hub with
N/K targets and M/K services; one copy is simulated and stands for each.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from benchmarks.lib.fleet_des import FleetInputs, FleetPoint, simulate


def fleet_point(inp: FleetInputs, n: int, k: int, m: int, warmup_ms: float, window_ms: float,
                seed: int = 0) -> FleetPoint:
    """One (N, K, M) point from one simulated hub."""
    if n % k or m % k:
        raise ValueError(f"N ({n}) and M ({m}) must be multiples of K ({k}) for identical hubs")
    one = simulate(inp, n // k, 1, m // k, warmup_ms=warmup_ms, window_ms=window_ms, seed=seed)
    one.n, one.k, one.m = n, k, m
    return one


def good(p: FleetPoint, goal: float) -> bool:
    return p.speedup >= goal and p.broker_load < 1.0 and p.fits


def smallest_m(inp: FleetInputs, n: int, k: int, goal: float, per_hub: Iterable[int], warmup_ms: float,
               window_ms: float, tried: List[FleetPoint]) -> Optional[FleetPoint]:
    """The fewest draft services (M = K x services per hub) with which a target gains `goal`x."""
    for r in per_hub:
        p = fleet_point(inp, n, k, k * r, warmup_ms, window_ms)
        tried.append(p)
        if good(p, goal):
            return p
        if p.broker_load >= 1.0 and p.draft_busy < 0.5:
            return None              # the broker, not the drafts, is what fails: more M cannot help
        if p.draft_busy < 0.9 and p.broker_load < 0.9 and p.fits:
            return None              # neither is saturated: the draft is too slow per request, at any M
    return None


def search(inp: FleetInputs, n: int, ks: Iterable[int], goal: float, per_hub: Iterable[int],
           warmup_ms: float = 1000.0, window_ms: float = 3000.0) -> dict:
    """Per K: the smallest M that meets the goal (None: none tried does); every point tried."""
    tried: List[FleetPoint] = []
    best = {}
    for k in ks:
        p = smallest_m(inp, n, k, goal, list(per_hub), warmup_ms, window_ms, tried)
        best[k] = p
    found = [p for p in best.values() if p is not None]
    answer = min(found, key=lambda p: (p.m, p.k)) if found else None
    return {"per_k": {k: (p.as_dict() if p else None) for k, p in best.items()},
            "answer": answer.as_dict() if answer else None,
            "min_k": min((p.k for p in found), default=None),
            "tried": [p.as_dict() for p in tried]}
