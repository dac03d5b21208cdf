"""One batched engine step in which a bad sequence fails alone.

A batch mixes sequences of many sessions or tasks; one of them hitting its
context limit (or a llama.cpp slot running out) must cost only that one.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError


def step_isolated(engine: Engine, seqs: Sequence[int], tokens: Sequence[int]) -> List[Optional[np.ndarray]]:
    """The rows of engine.step(seqs, tokens). When the batch fails, each sequence is
    stepped alone and those that fail again get None; the others' rows are as usual."""
    try:
        return list(engine.step(seqs, tokens))
    except EngineError:
        if len(seqs) == 1:
            return [None]
    rows: List[Optional[np.ndarray]] = []
    for seq, tok in zip(seqs, tokens):
        try:
            rows.append(engine.step([seq], [tok])[0])
        except EngineError:
            rows.append(None)
    return rows
