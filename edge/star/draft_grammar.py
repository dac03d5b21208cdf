"""The draft service's side of constrained output: the grammar each session's drafts follow.

A DraftRequest names its grammar by id on every request and carries the text until the
service has answered one (edge/wire/protocol.py). The service compiles a text once (a few
recent grammars are kept: many targets ask for the same JSON schema), gives each session a
matcher that follows the tokens it has fed from `grammar_from` on, and masks the draft's row
with it before each proposal: the draft's q is then the masked, renormalised q, exactly what the
target's verification of a constrained generation wants (edge/speculative/constrained.py).

A service built without a tokenizer for grammars drafts unconstrained: the target keeps the legal
prefix of the proposals (still lossless, fewer accepted). A grammar the service cannot compile
is refused with E_BAD_GRAMMAR and the reason; the target then decodes that generation alone.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np

from edge.speculative.constrained import NoTokenAllowed, mask_logits
from edge.speculative.grammar import Grammar, GrammarError, grammar_id
from edge.star.draft_limits import DraftRefused
from edge.wire.protocol import E_BAD_GRAMMAR, DraftRequest

KEEP_COMPILED = 16      # grammars kept compiled (by id), most recently used first


class SessionGrammar:
    """One session's grammar: the matcher follows fed[start:]."""

    def __init__(self, grammar: Grammar, start: int):
        self.grammar, self.start = grammar, int(start)
        self.matcher = grammar.matcher()

    @property
    def id(self) -> str:
        return self.grammar.id

    def mask(self, fed, row: np.ndarray) -> Optional[np.ndarray]:
        """The draft's row masked by the grammar after `fed`; None when fed breaks the grammar
        or it allows nothing more (the session then drafts no further)."""
        if not self.matcher.sync(fed[self.start:]):
            return None
        try:
            return mask_logits(row, self.matcher.allowed())
        except NoTokenAllowed:
            return None

    def forced(self) -> bool:
        """The last mask allowed one token only: the draft's proposal there is sure, and rides
        along its request's γ drafts uncounted (edge/star/draft_chain.py DraftSession.end_after)."""
        return self.matcher.only_token() is not None

    def ends(self, token: int) -> bool:
        """The proposal ends the text: nothing after it is worth drafting."""
        return int(token) in self.grammar.stop_ids


class DraftGrammars:
    """Grammars for one draft service: compiled against its tokenizer, kept by id."""

    def __init__(self, tokenizer=None):
        """tokenizer: edge.speculative.grammar.grammar_tokenizer()'s, or a function making it at the first
        grammar (a large vocabulary takes a second), or None (draft unconstrained)."""
        self._make = tokenizer if callable(tokenizer) else None
        self.tokenizer = None if callable(tokenizer) else tokenizer
        self._compiled: "OrderedDict[str, Grammar]" = OrderedDict()

    def apply(self, s, req: DraftRequest, stats) -> None:
        """Set s.grammar for the request; DraftRefused(E_BAD_GRAMMAR) when it cannot be used."""
        if not req.grammar_id:
            s.grammar = None
            return
        if self.tokenizer is None and self._make is not None:
            self.tokenizer, self._make = self._make(), None
        if self.tokenizer is None:
            stats.count("grammar_unapplied")
            s.grammar = None
            return
        cur = s.grammar
        if cur is not None and cur.id == req.grammar_id and cur.start == req.grammar_from:
            return
        s.grammar = SessionGrammar(self._compile(req, stats), req.grammar_from)

    def _compile(self, req: DraftRequest, stats) -> Grammar:
        g = self._compiled.get(req.grammar_id)
        if g is not None:
            self._compiled.move_to_end(req.grammar_id)
            return g
        if not req.grammar:
            raise DraftRefused(f"grammar {req.grammar_id} is not known here: send its text",
                               E_BAD_GRAMMAR)
        if grammar_id(req.grammar) != req.grammar_id:
            raise DraftRefused("the grammar's text does not hash to its grammar_id", E_BAD_GRAMMAR)
        try:
            g = Grammar(req.grammar, self.tokenizer).check()
        except GrammarError as e:
            stats.count("bad_grammar")
            raise DraftRefused(str(e), E_BAD_GRAMMAR) from e
        stats.count("grammars_compiled")
        self._compiled[g.id] = g
        while len(self._compiled) > KEEP_COMPILED:
            self._compiled.popitem(last=False)
        return g
