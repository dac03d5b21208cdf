"""Constrained decoding that stays lossless under speculation. Pure functions over token masks.

With a grammar the target's distribution is the *constrained* one: its logits with every token
the grammar forbids set to -inf, then temperature, top-k and top-p as usual (the mask comes
first, as in vLLM and llama.cpp), so greedy is the argmax over allowed tokens and sampling
draws from the renormalised allowed mass. Speculation keeps exactly that distribution:

* the draft proposes under the same mask, advancing its own matcher through its proposals
  (`ConstrainedProposer`), so its q is the masked, renormalised q;
* before the target's call the proposals are cut just after the first token the grammar
  refuses (`legal_drafts`): that token has p = 0 and is rejected for sure (its correction drawn
  from the residual, as verification demands); nothing after it is ever reached;
* every row of the target's call is masked with the grammar's state after the drafts before
  it (`mask_rows`), so verify_greedy / verify_stochastic see the constrained p.

Greedy output therefore equals plain constrained decoding, and sampled output has exactly the
constrained distribution (tests/unit/test_constrained_lossless.py measures both).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


class NoTokenAllowed(ValueError):
    """The grammar allows no token here (it was left in an error state): nothing can be drawn."""


def _keep(allowed: np.ndarray, width: int) -> np.ndarray:
    """The mask as wide as a logits row: past a shorter mask nothing is allowed."""
    n = min(allowed.size, width)
    if n == width:
        return allowed[:width]
    keep = np.zeros(width, dtype=bool)
    keep[:n] = allowed[:n]
    return keep


_FORBIDDEN = np.float64(-np.inf)     # float64: np.where's result is then float64 whatever the row's dtype


def mask_logits(logits, allowed: np.ndarray) -> np.ndarray:
    """One logits row [V] -> float64 copy with -inf wherever `allowed` is False. A mask shorter
    than the row (a tokenizer narrower than the model's logits) forbids the tokens past it.
    One pass (np.where): after an engine step has flushed the caches, a float64 copy and then a
    boolean-indexed write cost ~4x as much (benchmarks/star/constrained_speed.py)."""
    row = np.asarray(logits)
    keep = _keep(allowed, row.shape[-1])
    if not keep.any():
        raise NoTokenAllowed("the grammar allows no token at this position")
    return np.where(keep, row, _FORBIDDEN)


def mask_rows(logits, masks: Sequence[np.ndarray]) -> np.ndarray:
    """A target call's rows [k, V] masked row by row (masks[i]: the grammar after drafts[:i])."""
    rows = np.asarray(logits)
    if rows.shape[0] != len(masks):
        raise ValueError(f"{rows.shape[0]} logits rows but {len(masks)} masks")
    keep = np.stack([_keep(m, rows.shape[-1]) for m in masks])
    if not keep.any(axis=-1).all():
        raise NoTokenAllowed("the grammar allows no token at this position")
    return np.where(keep, rows, _FORBIDDEN)


def legal_drafts(matcher, drafts: Sequence[int], qs: Sequence) -> Tuple[List[int], list, List[np.ndarray]]:
    """The drafts the target verifies under the grammar, their q's, and one mask per row of the
    target's call over them (len(drafts) + 1), the matcher left as it was.

    Kept: the longest prefix the grammar allows, AND the first token it refuses (if any). That
    token has p = 0 and is rejected for sure, the correction drawn from norm(max(0, p - q)), as
    verification demands: dropping it instead would decide on the drawn token itself, and the
    tokens still proposed would no longer be distributed as their q (not lossless; the test's
    negative control shows it). What follows it is never reached and is dropped. The row after a
    refused token is never read; it gets the mask before it."""
    masks = [matcher.allowed()]
    n = 0
    refused = False
    for x in drafts:
        x = int(x)
        allowed_here = masks[-1]
        if x >= allowed_here.size or not allowed_here[x] or not matcher.consume(x):
            refused = True
            break
        n += 1
        masks.append(matcher.allowed())
    matcher.rollback(n)
    if refused:
        masks.append(masks[-1])
        n += 1
    return [int(x) for x in drafts[:n]], list(qs[:n]), masks


def grammar_matcher(grammar, stops: set):
    """A generation's matcher for `grammar` (None: unconstrained); the grammar's end tokens join
    `stops` (the end of the grammar is the end of the generation)."""
    if grammar is None:
        return None
    matcher = grammar.matcher()
    stops |= matcher.stop_ids
    return matcher


class ConstrainedProposer:
    """A draft's grammar state, following the contexts it is asked to draft after.

    `begin(context)` syncs the draft's own matcher with the generated part of the context
    (context[start:]); then, per proposal, `mask(row)` masks the draft's row and `advance(x)`
    consumes the proposal (False: stop proposing, the grammar ended or refused it), `forced(n)` takes
    the stretch the grammar forces next (proposed as it is, not counted against γ); `end()`
    rolls the proposals back, so the next `begin` only consumes what the target committed."""

    def __init__(self, grammar, start: int):
        self.matcher = grammar.matcher()
        self.start = int(start)
        self._proposed = 0

    def begin(self, context: Sequence[int]) -> bool:
        """False when the context breaks the grammar (then propose nothing)."""
        self._proposed = 0
        return self.matcher.sync(list(context[self.start:]))

    def mask(self, logits) -> np.ndarray:
        return mask_logits(logits, self.matcher.allowed())

    def advance(self, token: int) -> bool:
        if int(token) in self.matcher.stop_ids or not self.matcher.consume(token):
            return False
        self._proposed += 1
        return True

    def forced(self, limit: int) -> List[int]:
        """The tokens the grammar forces next (at most `limit`; an end token never), consumed as
        proposals: a draft proposes them as they are and does not count them against γ."""
        run: List[int] = []
        while len(run) < limit:
            token = self.matcher.only_token()
            if token is None or token in self.matcher.stop_ids or not self.matcher.consume(token):
                break
            run.append(token)
        self._proposed += len(run)
        return run

    def end(self) -> None:
        self.matcher.rollback(self._proposed)
        self._proposed = 0
