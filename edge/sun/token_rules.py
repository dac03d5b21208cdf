"""What a SUN worker applies to one request's rows beyond sampling: its grammar and its logprobs.

A request may carry a grammar (llguidance's text, compiled at the hub's endpoint for
response_format or a forced tool_choice, edge/api/structured.py) and ask for logprobs. Each
worker compiles the text against its own tokenizer (`SunGrammars`, kept by id: agents repeat
their schemas) and gives the request a `RowRules`: a matcher and how many alternatives to
report. `choose` then draws one token from one row as a target's endpoint would
(edge/speculative/generate.py, generate_plain): the row masked by the grammar first (forbidden
tokens -inf), then temperature / top-k / top-p; the logprob entry is read from that masked row.
A row whose request has no grammar and no logprobs is drawn exactly as before: the decoder's
other rows never see another row's grammar.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from edge.speculative.constrained import mask_logits
from edge.speculative.grammar import Grammar, GrammarError, GrammarMatcher, grammar_id, grammar_tokenizer
from edge.speculative.sampling import SamplingParams, pick, top_logprobs

KEEP_COMPILED = 32       # grammars kept compiled per worker


class GrammarRefused(ValueError):
    """A request's grammar this worker cannot follow (no tokenizer, or llguidance refuses it)."""


class SunGrammars:
    """A worker's grammars: compiled against its tokenizer (llguidance's, built at the first grammar:
    about a second for a 150k vocabulary), kept by id."""

    def __init__(self, tokenizer=None, vocab_size: Optional[int] = None, llg=None, make: Optional[Callable] = None):
        """tokenizer: the base model's edge.model.tokenizer.Tokenizer; vocab_size: the engine's logits
        width when it exceeds the tokenizer's (padding rows are never allowed); llg: llguidance's
        tokenizer itself instead (a test's own vocabulary); make: what builds llguidance's tokenizer at
        the first grammar instead (it raises GrammarError when it cannot: that request is refused)."""
        self._make: Optional[Callable] = make or (None if llg is not None else
                                                  lambda: grammar_tokenizer(tokenizer, vocab_size))
        self._llg = llg
        self._compiled: "OrderedDict[str, Grammar]" = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self) -> "SunGrammars":
        """Build llguidance's tokenizer now, in a background thread (a worker's start), so that the
        first request with a grammar does not wait for it in the worker's loop."""
        def build() -> None:
            with self._lock:
                if self._llg is None:
                    try:
                        self._llg, self._make = self._make(), None
                    except GrammarError:
                        pass                              # compile() raises it again, for the request
        threading.Thread(target=build, name="sun-grammar-tokenizer", daemon=True).start()
        return self

    def compile(self, text: str) -> Grammar:
        """The grammar of `text`, compiled once; GrammarRefused (with llguidance's reason) if it cannot be."""
        gid = grammar_id(text)
        with self._lock:
            g = self._compiled.get(gid)
            if g is not None:
                self._compiled.move_to_end(gid)
                return g
            try:
                if self._llg is None:
                    self._llg, self._make = self._make(), None
                g = Grammar(text, self._llg)
                g.matcher()                               # its start state now: refused here, not mid-reply
            except GrammarError as e:
                raise GrammarRefused(str(e)) from None
            self._compiled[gid] = g
            while len(self._compiled) > KEEP_COMPILED:
                self._compiled.popitem(last=False)
            return g


def compile_grammar(grammars: Optional[SunGrammars], text: str, worker: str) -> Optional[Grammar]:
    """A request's grammar on `worker` (None for none); GrammarRefused when it has no tokenizer."""
    if not text:
        return None
    if grammars is None:
        raise GrammarRefused(f"{worker} follows no grammars (it was started without the base model's "
                             "tokenizer: give it --tokenizer)")
    return grammars.compile(text)


@dataclass
class RowRules:
    """One request's rules on a worker: the grammar's state after the tokens drawn so far (None:
    unconstrained) and the alternatives per token to report (None: no logprobs)."""
    matcher: Optional[GrammarMatcher] = None
    logprobs: Optional[int] = None

    @classmethod
    def of(cls, grammar: Optional[Grammar], logprobs: Optional[int]) -> "RowRules":
        return cls(None if grammar is None else grammar.matcher(), logprobs)

    @property
    def stop_ids(self) -> frozenset:
        """The grammar's end tokens: they end the answer (none without a grammar)."""
        return frozenset() if self.matcher is None else self.matcher.stop_ids

    def follow(self, token: int) -> bool:
        """Feed a token drawn elsewhere (the prefill's token 0) to the matcher; False if it breaks the grammar."""
        if self.matcher is None or int(token) in self.matcher.stop_ids:
            return True
        return self.matcher.consume(int(token))


Entry = Tuple[float, list]     # (the token's logprob, [(alternative id, logprob), ...])


def choose(row: np.ndarray, params: SamplingParams, rng, rules: Optional[RowRules]) -> Tuple[int, Optional[Entry]]:
    """One token from one logits row under the request's rules, and its logprob entry (None when
    not asked). Raises edge.speculative.constrained.NoTokenAllowed when the grammar allows nothing."""
    if rules is None or (rules.matcher is None and rules.logprobs is None):
        return pick(row, params, rng)[0], None
    if rules.matcher is not None:
        row = mask_logits(row, rules.matcher.allowed())
    token = pick(row, params, rng)[0]
    entry = None if rules.logprobs is None else top_logprobs(row, token, rules.logprobs)
    rules.follow(token)
    return token, entry
