"""The verify service's side of constrained output and logprobs (the reverse star, #46).

A drafting device's endpoint may serve a response_format or a forced tool_choice: a grammar the
TARGET's output must follow. Only the hub sees the target's logits, so the hub applies it, exactly as
a target's own loop does (edge/speculative/constrained.py): the drafts are cut just after the first
one the grammar refuses (`legal_drafts`: it has p = 0 and is rejected for sure), and every row of the
verify call is masked with the grammar's state after the drafts before it (`mask_rows`), so
verify_greedy / verify_stochastic decide on the constrained distribution and the correction or bonus
token is drawn from it. The device drafts under the same grammar (ModelDrafter.constrain) only so that
its drafts are accepted more often, and sends the tokens the grammar forces as drafts with one-hot q
(probability 1 under the mask, so accepted once reached); neither is needed for correctness.

A request names its grammar by id and carries the text while the session has not had it
(edge/wire/reverse_messages.py); compiled grammars are kept by id (edge/star/draft_grammar.py's
DraftGrammars). A verify service built without a tokenizer for grammars refuses a grammar with
`bad_grammar` (the device answers its client 400): it never verifies a constrained request
unconstrained.

Logprobs come from the same rows, after the grammar's mask and before temperature, top-k and top-p
(edge/api/logprobs.py: what a target's endpoint reports), one entry per committed token.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.constrained import legal_drafts, mask_rows
from edge.speculative.sampling import top_logprobs
from edge.star.draft_grammar import DraftGrammars
from edge.star.draft_limits import DraftRefused
from edge.wire.protocol import E_BAD_GRAMMAR

NO_GRAMMARS = ("this hub's verify service follows no grammars (it was started without its target's tokenizer), "
               "so a response_format or a forced tool_choice cannot be served through it")


class VerifyGrammars:
    """The grammars of one verify service, compiled against its target's tokenizer."""

    def __init__(self, tokenizer=None):
        """tokenizer: edge.speculative.grammar.grammar_tokenizer()'s, a function making it at the first
        grammar, or None (a request with a grammar is refused bad_grammar)."""
        self.grammars = DraftGrammars(tokenizer) if tokenizer is not None else None

    def apply(self, s, req, stats) -> None:
        """Set s.grammar for the request (None: unconstrained); DraftRefused(E_BAD_GRAMMAR) when the
        grammar cannot be followed here."""
        if not req.grammar_id:
            s.grammar = None
            return
        if self.grammars is None:
            stats.count("bad_grammar")
            raise DraftRefused(NO_GRAMMARS, E_BAD_GRAMMAR)
        self.grammars.apply(s, req, stats)


def legal_for(grammar, context: List[int], drafts: List[int], qs: list) -> Tuple[List[int], list, Optional[list]]:
    """(drafts, qs, one mask per row of the verify call or None): unchanged without a grammar; with
    one, the drafts cut after the first the grammar refuses after `context`. DraftRefused
    (E_BAD_GRAMMAR) when the committed context itself breaks the grammar."""
    if grammar is None:
        return drafts, qs, None
    matcher = grammar.matcher
    if not matcher.sync(context[grammar.start:]):
        raise DraftRefused("the session's committed text breaks its grammar: start the generation again",
                           E_BAD_GRAMMAR)
    return legal_drafts(matcher, drafts, qs)


def masked(rows, masks: Optional[list]) -> np.ndarray:
    """The verify call's rows masked row by row (NoTokenAllowed when the grammar allows nothing)."""
    return rows if masks is None else mask_rows(rows, masks)


def entries(rows, tokens: Sequence[int], top_n: Optional[int]) -> list:
    """Each committed token's (logprob, [(id, logprob), ...]) from its row; [] when none were asked."""
    if top_n is None:
        return []
    return [top_logprobs(rows[i], int(t), top_n) for i, t in enumerate(tokens)]
