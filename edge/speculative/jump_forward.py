"""Jump-forward: tokens a grammar forces are committed without a target call of their own.

Where the grammar's mask allows exactly one token (a JSON key with its quotes and colon, a
tool call's fixed frame, the end when only it may come), that token has probability 1 under the
masked distribution the target decodes from, whatever the logits: greedy picks it, sampling
draws it, verification accepts it. So the loops commit it at once, asking neither the target
nor the draft (GrammarMatcher.take_forced). The output is unchanged, token for token and in
distribution: lossless by construction.

The target's KV must still hold it: a forced token is fed with the NEXT target call, ahead of
that round's drafts (`_Run.pending`), so the calls drop, not the KV. A draft learns it as it
learns any committed token: its next request's context carries it (the star's DraftRequest
`append`), and it drafts what comes after.

Forced tokens among the drafts (`with_forced`): γ counts the drafts where the grammar leaves a
choice -- the ones that may be wrong. A draft walks through a forced stretch (it needs the
tokens in its KV to go on) without counting it against γ (edge/star/draft_chain.py, ModelDrafter),
and the target appends the stretch the grammar forces after the last draft itself, one-hot q:
under the masked distribution each has probability 1, so it is accepted once its position is
reached. One target call then verifies [pending, drafts, the forced tokens among and after them].

Logprobs: the row reported for a token is the masked one, whose log-softmax for a forced token
is 0.0 with no alternative (every other token is -inf): `ForcedRows` hands exactly that.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from edge.speculative.sampling import SparseDist


FORCED_EXTRA = 32      # forced tokens a draft call may propose on top of its γ (a draft walks them)


class ForcedRows:
    """The masked rows of forced tokens, made only when asked for (on_logits: logprobs)."""

    def __init__(self, tokens: List[int], width: int):
        self.tokens, self.width = tokens, width

    def __getitem__(self, i: int) -> np.ndarray:
        row = np.full(self.width, -np.inf)
        row[self.tokens[i]] = 0.0
        return row


def jump_forward(run, matcher) -> int:
    """Commit the tokens the grammar forces after `run`'s context (edge/speculative/generate.py's
    _Run), as many as max_new and the target's room for the pending tokens allow; how many."""
    if matcher is None or run.done:
        return 0
    room = run.target.max_len - run.target.length(run.seq) - len(run.pending())
    forced = matcher.take_forced(min(run.max_new - run.res.n_generated, room))
    if forced:
        run.res.n_forced += len(forced)
        run.commit(forced, ForcedRows(forced, run.target.vocab_size))
    return len(forced)


def is_forced(mask: np.ndarray) -> bool:
    """The grammar allows exactly one token under this mask (legal_drafts' masks)."""
    return int(np.count_nonzero(mask)) == 1


def with_forced(matcher, drafts: List[int], qs: list, masks: List[np.ndarray], unforced: int,
                limit: int) -> Tuple[List[int], list, List[np.ndarray], List[bool]]:
    """A round's legal drafts (edge/speculative/constrained.py legal_drafts: drafts, qs, one mask
    per row) cut after `unforced` drafts the grammar left a choice at, the tokens it forces after
    the last one appended (one-hot q), `limit` drafts in all; and which drafts are forced. The
    matcher is left as it was. Nothing is appended after a refused draft (it is rejected for
    sure), nor an end token (the target's own row takes it as the round's last token)."""
    n, free = 0, 0
    for i in range(min(len(drafts), limit)):
        if not is_forced(masks[i]):
            if free == unforced:
                break
            free += 1
        n += 1
    drafts, qs, masks = list(drafts[:n]), list(qs[:n]), list(masks[:n + 1])
    refused = n > 0 and not (drafts[-1] < masks[n - 1].size and masks[n - 1][drafts[-1]])
    if n < limit and not refused and is_forced(masks[n]):
        _append_forced(matcher, drafts, qs, masks, limit)
    return drafts, qs, masks, [is_forced(masks[i]) for i in range(len(drafts))]


def _append_forced(matcher, drafts: List[int], qs: list, masks: List[np.ndarray], limit: int) -> None:
    """Append the tokens the grammar forces after `drafts` (at most up to `limit` drafts)."""
    before = len(matcher.tokens)
    try:
        if matcher.consume_all(drafts) != len(drafts):
            return
        while len(drafts) < limit:
            token = matcher.only_token()
            if token is None or token in matcher.stop_ids or not matcher.consume(token):
                break
            drafts.append(token)
            qs.append(SparseDist.one_hot(token))
            masks.append(matcher.allowed())
    finally:
        matcher.rollback(len(matcher.tokens) - before)


def verified_rows(run, pending: List[int], drafts: List[int]) -> np.ndarray:
    """A round's target call over the pending tokens and the drafts, and the rows that decide:
    from the last pending token's on (it predicts the first draft). The forced tokens' rows
    before it would predict tokens already committed: not computed (Engine.forward_tail)."""
    return run.forward(pending + drafts, rows=len(drafts) + 1 if len(pending) > 1 else 0)
