"""Where a batch's sequences sit in llama.cpp's per-sequence KV streams (pure, no I/O).

With `kv_unified` off every llama.cpp sequence id is its own KV stream, and
`llama_decode` splits a batch into ubatches of *consecutive* sequence ids in the
batch's order (llama-batch.cpp, `split_equal(n_ubatch, sequential=true)`): a
batch over slots {0, 2, 4, 6} runs as four ubatches, four passes over the
weights instead of one. Measured here (Qwen2.5-Coder-0.5B Q4_0, one core, 8
sequences): one run 128-141 ms a step, two runs 154-180, eight runs 236-307; the
same slots in descending order cost as much as eight runs.

So the engine (1) hands out the lowest free slot, (2) orders a batch by slot and
(3) before a batch whose slots form more than one run, moves sequences into one
window of consecutive slots. A move is a cross-stream `llama_memory_seq_cp` (the
whole stream buffer, copied at the next decode: ~3-5 ms for the 0.5B at 1536
tokens a stream here), far less than a ubatch.
"""
from __future__ import annotations

from typing import Iterable, List, Set, Tuple


def runs(slots: Iterable[int]) -> int:
    """The number of maximal runs of consecutive slots (the ubatches a sorted batch takes)."""
    s = sorted(set(slots))
    return (1 + sum(b != a + 1 for a, b in zip(s, s[1:]))) if s else 0


def plan_moves(members: Iterable[int], occupied: Set[int], capacity: int) -> List[Tuple[int, int]]:
    """(src, dst) stream moves, in order, that put `members` (a batch's slots) on one run.

    occupied: every slot in use (members included); capacity: the number of slots. A window
    hole that is free costs one move; one that holds another sequence costs two (that one
    moves out to a free slot first). The cheapest window wins, the lowest on a tie. Returns []
    when the members already form one run or no window can be cleared (no free slot)."""
    m = set(members)
    b = len(m)
    if b < 2 or runs(m) == 1:
        return []
    free = [s for s in range(capacity) if s not in occupied]
    best = None
    for lo in range(capacity - b + 1):
        holes = [s for s in range(lo, lo + b) if s not in m]
        evict = sum(1 for s in holes if s in occupied)
        if evict and not free:
            continue
        cost = len(holes) + evict
        if best is None or cost < best[0]:
            best = (cost, lo)
    if best is None:
        return []
    window = set(range(best[1], best[1] + b))
    outside = sorted(s for s in m if s not in window)
    holes = sorted((s for s in window if s not in m), key=lambda s: (s in occupied, s))  # free first
    spare = [s for s in free if s not in window]
    moves: List[Tuple[int, int]] = []
    for src, dst in zip(outside, holes):
        if dst in occupied:                  # another sequence sits there: it moves out first
            moves.append((dst, spare.pop(0)))
        moves.append((src, dst))
        spare.append(src)                    # the member's old slot is free now
    return moves
