"""What the draft costs in memory: N co-located pairs (a draft on every device) vs one star.

A co-located pair keeps a draft model beside each target, so N devices hold N drafts; the star
keeps one, at the hub, holding N sessions' KV. Both from edge/memory/fit.py's estimate (weights
as the backend holds them, KV as allocated, compute buffers, runtime), as `edge-agent plan` says.
"""
from __future__ import annotations

from typing import List


def draft_memory(draft: str, backend: str, n: int, context: int) -> dict:
    """Bytes: one co-located draft (one sequence), N of them, and the star's one draft (N sequences)."""
    from edge.memory.fit import Workload, estimate
    from edge.memory.model_shape import read_shape
    shape = read_shape(draft, role="draft", backend=backend)
    one = estimate(shape, Workload("draft", backend, context=context, sequences=1)).total
    star = estimate(shape, Workload("draft", backend, context=context, sequences=n)).total
    return {"n": n, "context": context, "per_pair_bytes": one, "colocated_bytes": n * one, "star_bytes": star}


def memory_lines(m: dict, name: str) -> List[str]:
    mib = 2 ** 20
    return [f"draft memory: {m['n']} co-located pairs would hold {m['n']} x {m['per_pair_bytes'] / mib:.0f} MiB = "
            f"{m['colocated_bytes'] / mib:.0f} MiB of {name} (one per device); the star holds one, "
            f"{m['star_bytes'] / mib:.0f} MiB with {m['n']} sessions' KV at {m['context']} tokens each "
            f"({m['colocated_bytes'] / m['star_bytes']:.1f}x less)"]
