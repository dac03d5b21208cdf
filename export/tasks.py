"""Task data for SUN: (prompt ids, answer ids) pairs, plus the fast synthetic suite.

Every task yields `Example(prompt, answer)` token lists; the answer ends with
the stop token and is scored by exact match (real tasks may add a scorer, see
export/real_tasks.py).

The synthetic suite runs the whole SUN method in CI minutes on a tiny model
trained from scratch. Its *base* model is pretrained on one generic skill,
copying a string (tag C); the three specialist tasks are skills the base never
saw, each a different re-arrangement of the prompt: rotate (move the first
letter to the end), reverse, and sort. A specialist's prefill must learn to
hand the frozen copy-capable decoder a KV cache that makes it "copy" the right
answer. Re-arrangements (not letter re-mappings such as shift or mirror, also
defined here) are the suite because there a full-FT model's KV fed to the base
decoder fails reliably (measured <= 0.1 exact match), while for re-mappings the
base decoder sometimes still copies the re-mapped letters (up to 0.57).

Vocabulary (32 ids): 0 pad, 1 bos, 2 eos (stop), 3 '=', 4.. task tags,
16.. the letters (10 used, a..j). Strings are 3..5 letters: short enough that
a 2-layer model learns every task in a few hundred steps on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

PAD, BOS, EOS, SEP = 0, 1, 2, 3
TAGS = {"copy": 4, "reverse": 5, "sort": 6, "shift": 7, "rotate": 8, "mirror": 9}
LETTER0, N_LETTERS = 16, 10
VOCAB = 32
MIN_LEN, MAX_LEN = 3, 5


@dataclass(frozen=True)
class Example:
    prompt: List[int]
    answer: List[int]           # ends with the stop token


Scorer = Callable[[List[List[int]], Sequence[Example]], float]


@dataclass
class TaskData:
    """One task as the tuner and the accuracy table take it (export/real_tasks.py makes real ones)."""
    name: str
    train: Sequence[Example]
    eval: Sequence[Example]
    max_new: int
    stop_ids: tuple
    score: Optional[Scorer] = None     # default: exact match of ids (stop token included)


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[np.random.Generator, int], List[Example]]  # (rng, n) -> examples
    max_new: int                # generation budget that fits every answer
    stop_ids: tuple = (EOS,)


_OPS: Dict[str, Callable[[List[int]], List[int]]] = {
    "copy": lambda xs: list(xs),
    "reverse": lambda xs: xs[::-1],
    "sort": lambda xs: sorted(xs),
    "shift": lambda xs: [LETTER0 + (x - LETTER0 + 1) % N_LETTERS for x in xs],
    "rotate": lambda xs: xs[1:] + xs[:1],
    "mirror": lambda xs: [LETTER0 + N_LETTERS - 1 - (x - LETTER0) for x in xs],
}


def _synthetic(name: str) -> Task:
    op = _OPS[name]

    def make(rng: np.random.Generator, n: int) -> List[Example]:
        out = []
        for _ in range(n):
            k = int(rng.integers(MIN_LEN, MAX_LEN + 1))
            xs = [int(x) for x in rng.integers(LETTER0, LETTER0 + N_LETTERS, size=k)]
            out.append(Example([BOS, TAGS[name], *xs, SEP], [*op(xs), EOS]))
        return out

    return Task(name, make, max_new=MAX_LEN + 1)


SYNTHETIC: Dict[str, Task] = {n: _synthetic(n) for n in _OPS}
PRETRAIN_TASK = "copy"                          # what the synthetic base learns from scratch
SPECIALIST_TASKS = ("rotate", "reverse", "sort")  # the suite's three specialists


def split(task: Task, n_train: int, n_eval: int, seed: int):
    """Disjoint train / eval sets (eval prompts never appear in train)."""
    rng = np.random.default_rng(seed)
    ev = task.make(rng, n_eval)
    seen = {tuple(e.prompt) for e in ev}
    train: List[Example] = []
    while len(train) < n_train:
        train.extend(e for e in task.make(rng, n_train) if tuple(e.prompt) not in seen)
    return train[:n_train], ev


def render(ids: Sequence[int]) -> str:
    """Human-readable synthetic ids (for logs and reports)."""
    names = {PAD: "_", BOS: "^", EOS: ".", SEP: "="}
    names.update({v: k[0].upper() for k, v in TAGS.items()})
    return "".join(names.get(i, chr(ord("a") + i - LETTER0) if i >= LETTER0 else "?") for i in ids)
