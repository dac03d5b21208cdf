"""One batched engine step in which a bad sequence fails alone.

A batch mixes sequences of many sessions or tasks; one of them hitting its
context limit (or a llama.cpp slot running out) must cost only that one. An
engine that fails otherwise (a bug, memory, a broken library: not an EngineError)
fails the sequences it cannot step, said in the log, rather than the whole
service: the caller ends them with an error, and its other clients go on.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError

log = logging.getLogger(__name__)


def step_isolated(engine: Engine, seqs: Sequence[int], tokens: Sequence[int]) -> List[Optional[np.ndarray]]:
    """The rows of engine.step(seqs, tokens). When the batch fails, each sequence is
    stepped alone and those that fail again get None; the others' rows are as usual."""
    try:
        return list(engine.step(seqs, tokens))
    except Exception as e:                   # noqa: BLE001 -- see the module doc
        _say(e, len(seqs))
        if len(seqs) == 1:
            return [None]
    rows: List[Optional[np.ndarray]] = []
    for seq, tok in zip(seqs, tokens):
        try:
            rows.append(engine.step([seq], [tok])[0])
        except Exception as e:               # noqa: BLE001
            _say(e, 1)
            rows.append(None)
    return rows


def _say(e: Exception, n: int) -> None:
    if not isinstance(e, EngineError):       # an EngineError is the engine refusing: its caller counts it
        log.error("engine step over %d sequence(s) failed: %s: %s", n, type(e).__name__, e)
