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

Logprobs: the row reported for a token is the masked one, whose log-softmax for a forced token
is 0.0 with no alternative (every other token is -inf): `ForcedRows` hands exactly that.
"""
from __future__ import annotations

from typing import List

import numpy as np


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


def verified_rows(run, pending: List[int], drafts: List[int]) -> np.ndarray:
    """A round's target call over the pending tokens and the drafts, and the rows that decide:
    from the last pending token's on (it predicts the first draft). The forced tokens' rows
    before it would predict tokens already committed: not computed (Engine.forward_tail)."""
    return run.forward(pending + drafts, rows=len(drafts) + 1 if len(pending) > 1 else 0)
