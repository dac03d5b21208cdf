"""plan_moves puts a batch's llama.cpp KV streams on one run of consecutive slots
(edge/engines/stream_placement.py): llama.cpp runs a batch as one ubatch per run."""
from __future__ import annotations

import random

from edge.engines.stream_placement import plan_moves, runs


def _apply(moves, where, capacity):
    """where: sequence -> slot. Applies the moves as the engine does; every move must land on a
    free slot and leave from an occupied one."""
    by_slot = {v: k for k, v in where.items()}
    for src, dst in moves:
        assert 0 <= dst < capacity
        assert src in by_slot, f"move from empty slot {src}"
        assert dst not in by_slot, f"move onto occupied slot {dst}"
        seq = by_slot.pop(src)
        by_slot[dst] = seq
        where[seq] = dst
    return where


def test_runs_counts_consecutive_blocks():
    assert runs([]) == 0
    assert runs([3]) == 1
    assert runs([2, 0, 1]) == 1
    assert runs([0, 2, 4, 6]) == 4
    assert runs([0, 1, 5, 6, 9]) == 3


def test_one_run_needs_no_move():
    assert plan_moves([4, 5, 6], {0, 4, 5, 6}, 8) == []
    assert plan_moves([3], {3}, 8) == []


def test_free_holes_are_filled_with_one_move_each():
    moves = plan_moves([0, 2], {0, 2}, 4)
    assert moves == [(2, 1)]                 # window [0, 2): slot 1 is free


def test_an_occupied_hole_moves_its_sequence_out_first():
    # slots 0..3 all used, the batch is {0, 2}; slot 4 is the only free one
    moves = plan_moves([0, 2], {0, 1, 2, 3}, 5)
    where = _apply(moves, {"a": 0, "x": 1, "b": 2, "y": 3}, 5)
    assert runs([where["a"], where["b"]]) == 1
    assert len(moves) == 2


def test_no_free_slot_and_no_free_hole_means_no_plan():
    assert plan_moves([0, 2], {0, 1, 2, 3}, 4) == []


def test_random_batches_end_on_one_run_and_keep_every_sequence():
    rnd = random.Random(7)
    for _ in range(500):
        cap = rnd.randint(2, 24)
        n_used = rnd.randint(1, cap)
        used = rnd.sample(range(cap), n_used)
        where = {f"s{i}": slot for i, slot in enumerate(used)}
        batch = rnd.sample(sorted(where), rnd.randint(1, n_used))
        moves = plan_moves([where[s] for s in batch], set(used), cap)
        after = _apply(moves, dict(where), cap)
        assert sorted(after) == sorted(where)            # nobody lost
        assert len(set(after.values())) == len(after)    # nobody shares a slot
        if moves or runs(where[s] for s in batch) == 1:
            assert runs(after[s] for s in batch) == 1
        else:                                            # only when nothing can be cleared
            assert n_used == cap
