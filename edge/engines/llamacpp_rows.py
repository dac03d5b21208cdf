"""Exact rows: llama.cpp calls padded so that a row rounds alike whatever call computes it.

ggml-cpu picks its kernels by a call's shape, and they round differently, so the same position's
logits differ between a one-row decode, a verify of γ+1 rows and a batch of several sequences
(Qwen2.5-Coder-0.5B Q4_K_M, 300 tokens cached, two threads: max logit difference ~0.3):

* one query row over 512 or more cached cells with more than one thread: flash attention splits
  the cache between the threads and sums the parts (ops.cpp, use_split_kv_path);
* 8 rows or more: K-quant weights not repacked go through the tiled matmul (tiled/tiled.cpp);
* repacked weights (Q4_K, Q4_0 on x86): rows in groups of 4 through the gemm, the rest one by one
  through the gemv (repack.cpp, forward_mul_mat_one_chunk);
* 64 query rows or more of one sequence: tiled flash attention (a prefill's; a verify stays under).

So with `exact_rows` a call that computes fewer than 64 rows of a sequence is padded, each sequence
alike (llama.cpp's split_equal puts an equal share of every sequence in a ubatch), to at least
MIN_ROWS rows in all and a multiple of ROW_GROUP, and asks as many logits rows (the last layer's
FFN runs on those only): every row then takes the split-free attention, the tiled matmul and the
gemm. Measured: rows equal bit for bit between calls of 1 (padded), 3, 5, 8, 12, 16 and 24 rows,
repacked or not, one or two threads (tests/engines/test_exact_rows.py). The padding repeats a
sequence's last token at the following positions; its cells are removed after the call. What it
costs is the padding's compute: a lone decode step computes 8 rows (docs/models.md, exact rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

MIN_ROWS = 8         # the tiled matmul's floor (ggml_tiled_min_batch), above split attention's one row
ROW_GROUP = 4        # the repacked gemm's rows at a time
ROOM = MIN_ROWS      # cells past max_len each sequence keeps for a call's padding

Entry = Tuple[int, int, int]          # (token, position, slot) as LlamaCppEngine._decode takes them


@dataclass(frozen=True)
class PaddedCall:
    entries: List[Entry]              # the call's rows, each slot's padded at its end
    want: List[int]                   # logits rows asked of llama.cpp (the wanted ones first, in order)
    n_wanted: int                     # how many of `want` the caller asked for
    pads: Dict[int, int]              # slot -> its first padding position (cells to remove after)


def padded_rows(n_slots: int, longest: int) -> int:
    """Rows per slot so that n_slots * rows >= MIN_ROWS, is a multiple of ROW_GROUP, rows >= longest."""
    rows = max(1, longest)
    while n_slots * rows < MIN_ROWS or (n_slots * rows) % ROW_GROUP:
        rows += 1
    return rows


def wanted_rows(n: int) -> int:
    """Logits rows to ask for when n are wanted: at least MIN_ROWS, a multiple of ROW_GROUP."""
    return max(MIN_ROWS, -(-n // ROW_GROUP) * ROW_GROUP)


def pad_call(entries: Sequence[Entry], want: Sequence[int], room: int = ROOM):
    """The call padded (PaddedCall), or None when a slot would need more than `room` cells of
    padding (then decode_exact decodes the slots one at a time). entries: each slot's rows together,
    fewer than 64 a slot."""
    groups: Dict[int, List[int]] = {}
    for i, (_, _, slot) in enumerate(entries):
        groups.setdefault(slot, []).append(i)
    longest = max(len(g) for g in groups.values())
    rows = padded_rows(len(groups), longest)
    if rows - min(len(g) for g in groups.values()) > room:
        return None
    out: List[Entry] = []
    index: Dict[int, int] = {}
    pads: Dict[int, int] = {}
    extra: List[int] = []
    for slot, idx in groups.items():
        for i in idx:
            index[i] = len(out)
            out.append(tuple(entries[i]))
        tok, pos, _ = entries[idx[-1]]
        if rows > len(idx):
            pads[slot] = pos + 1
        for k in range(1, rows - len(idx) + 1):
            extra.append(len(out))
            out.append((tok, pos + k, slot))
    asked = [index[i] for i in want]
    taken = set(asked) | set(extra)
    spare = extra + [j for j in range(len(out)) if j not in taken]
    asked += spare[:wanted_rows(len(asked)) - len(asked)]
    return PaddedCall(out, asked, len(want), pads)


def decode_exact(eng, entries: Sequence[Entry], want: Sequence[int]):
    """LlamaCppEngine._decode with exact rows: the call padded as pad_call says, its padding's
    cells removed after; the wanted rows' logits in `want`'s order."""
    per_slot: Dict[int, List[int]] = {}
    for i, (_, _, slot) in enumerate(entries):
        per_slot.setdefault(slot, []).append(i)
    if max(len(v) for v in per_slot.values()) >= 64:        # a prefill: tiled whatever its shape
        return eng._decode_raw(entries, want)
    call = pad_call(entries, want)
    if call is None or len(call.entries) > eng._n_batch:    # too ragged to pad: one slot at a time
        if len(per_slot) == 1:                               # a batch smaller than the padding: as it is
            return eng._decode_raw(entries, want)
        return _slot_by_slot(eng, entries, want, per_slot)
    try:
        rows = eng._decode_raw(call.entries, call.want)
    finally:
        for slot, first in call.pads.items():
            eng._lc.llama_memory_seq_rm(eng._mem, slot, first, -1)
    return rows[:call.n_wanted]


def _slot_by_slot(eng, entries, want, per_slot):
    import numpy as np
    row_of: Dict[int, np.ndarray] = {}
    for idx in per_slot.values():
        mine = [w for w in want if w in set(idx)]
        local = {i: k for k, i in enumerate(idx)}
        rows = decode_exact(eng, [entries[i] for i in idx], [local[w] for w in mine])
        row_of.update(zip(mine, rows))
    if not want:
        return np.zeros((0, eng.vocab_size), dtype=np.float32)
    return np.stack([row_of[w] for w in want])
