"""How far two token lists agree: what a drafter keeps of its KV, what a target may `keep`."""
from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of a and b; the first `start` items are taken as agreeing."""
    n, end = start, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n
