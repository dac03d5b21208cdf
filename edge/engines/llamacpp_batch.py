"""LlamaCppEngine.forward_batch: several sequences' forwards in one llama_batch, one llama_decode.

Each call's tokens go in at its sequence's own positions and slot; logits are asked only for
the rows wanted (every fed token of a forward, the last of a forward_last, the last n of a
forward_tail). The sequences' slots are gathered onto one run first, as `step` does
(edge/engines/stream_placement.py), so that llama.cpp's ubatches span them. Calls that together
exceed the batch size (n_batch) go in several decodes, a call longer than it alone
(LlamaCppEngine._feed chunks it). All or nothing: on an error every sequence is cut back to where
it was.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from edge.engines.base import EngineError, batch_calls


def feed_batch(eng, calls: Sequence[tuple]) -> List[np.ndarray]:
    """eng: a LlamaCppEngine; calls as Engine.forward_batch takes them."""
    calls = batch_calls(calls)
    for seq, toks, _ in calls:
        eng._get(seq)
        eng._check_ids(toks)
        eng.check_room(seq, len(toks))
    starts = {seq: len(eng._tokens[seq]) for seq, _, _ in calls}
    out: List[np.ndarray] = [None] * len(calls)  # type: ignore[list-item]
    done: List[int] = []
    try:
        for group in _groups(calls, eng._n_batch):
            if len(group) == 1:
                i = group[0]
                seq, toks, rows = calls[i]
                out[i] = eng._feed(seq, toks, rows)
            else:
                _decode_group(eng, [calls[i] for i in group], out, group)
            done.extend(group)
    except BaseException:
        for i in done:
            seq = calls[i][0]
            eng.truncate(seq, starts[seq])
        raise
    return out


def _groups(calls, n_batch: int) -> List[List[int]]:
    """Indices of calls packed in order into groups of at most n_batch tokens (a longer call alone)."""
    groups: List[List[int]] = []
    cur, size = [], 0
    for i, (_, toks, _) in enumerate(calls):
        n = max(1, len(toks))
        if cur and size + n > n_batch:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        groups.append(cur)
    return groups


def _decode_group(eng, calls, out: list, index: List[int]) -> None:
    """One llama_decode over `calls` (their tokens fit one batch); their rows into out[index[k]]."""
    seqs = [c[0] for c in calls if c[1]]
    slots = [eng._get(s) for s in seqs]
    if eng.gather and len(slots) > 1:
        slots = eng._gather(seqs, slots)
    slot_of = dict(zip(seqs, slots))
    entries, want, spans = [], [], []
    order = sorted(range(len(calls)), key=lambda k: slot_of.get(calls[k][0], -1))
    for k in order:
        seq, toks, rows = calls[k]
        start, first_row = len(eng._tokens[seq]), len(want)
        for j, t in enumerate(toks):
            if not rows or j >= len(toks) - rows:
                want.append(len(entries))
            entries.append((t, start + j, slot_of[seq]))
        spans.append((k, first_row, len(want)))
    try:
        rows = eng._decode(entries, want) if entries else np.zeros((0, eng.vocab_size), np.float32)
    except EngineError:
        for seq in seqs:                     # ubatches that ran before the failure wrote their cells
            eng._lc.llama_memory_seq_rm(eng._mem, slot_of[seq], len(eng._tokens[seq]), -1)
        raise
    for k, a, b in spans:
        seq, toks, _ = calls[k]
        out[index[k]] = rows[a:b] if toks else np.zeros((0, eng.vocab_size), np.float32)
        eng._tokens[seq].extend(toks)
