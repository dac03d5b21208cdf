"""Grammars for constrained decoding, over llguidance (a well-kept grammar engine: JSON schema,
Lark, regex), and the stateful matcher the generation loops and the draft service advance.

A `Grammar` is immutable and shareable: the grammar text (llguidance's JSON form, what the wire
carries), its id (a hash of that text) and the tokenizer it is compiled against. A
`GrammarMatcher` is one generation's state: the tokens consumed so far, the mask of tokens
allowed next (`allowed`), and `sync(tokens)`, which rolls back to the common prefix and consumes
the rest, so a draft or a target can follow any context cheaply.

Everything that decides *which* token comes out lives in edge/speculative/constrained.py (pure
functions over masks); this module only answers "which tokens may come next".
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, List, Optional, Sequence

import numpy as np

from edge.wire.field_types import MAX_GRAMMAR_BYTES   # one cap: the API's, the wire's, the draft's

__all__ = ["MAX_GRAMMAR_BYTES", "Grammar", "GrammarError", "GrammarMatcher", "grammar_from_json_schema",
           "grammar_from_lark", "grammar_id", "grammar_tokenizer"]


class GrammarError(ValueError):
    """A grammar that cannot be used: malformed, too large, or refused by the engine."""


def _llg():
    import llguidance   # local: a process that never constrains never loads the grammar engine
    return llguidance


def grammar_tokenizer(tokenizer, vocab_size: Optional[int] = None):
    """llguidance's tokenizer for an edge.model.tokenizer.Tokenizer. vocab_size: the model's
    logits width when it exceeds the tokenizer's (padding rows are never allowed). Its end of
    grammar tokens are every end-of-generation id of the tokenizer."""
    eos = sorted(tokenizer.eos_ids)
    if not eos:
        raise GrammarError("the tokenizer names no end-of-generation token: a grammar could never end")
    return _llg().LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size or tokenizer.vocab_size,
                              eos_token=eos)


# JSON laid out as Python's json.dumps does, no free whitespace: a small model cannot wander off
# into blank runs (the schema's own "x-guidance" options may still change it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_from_json_schema(schema) -> str:
    """llguidance's grammar text for a JSON schema (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        text = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be compiled: {e}") from e
    return _capped(text)


def grammar_from_lark(lark: str) -> str:
    """llguidance's grammar text for a Lark grammar (llguidance's syntax)."""
    return _capped(_llg().LLMatcher.grammar_from_lark(lark))


JSON_OBJECT = {"type": "object"}     # OpenAI's response_format json_object: any JSON object


def _capped(text: str) -> str:
    n = len(text.encode("utf-8"))
    if n > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {n} bytes, over the limit of {MAX_GRAMMAR_BYTES}; "
                           f"send a smaller schema")
    return text


def grammar_id(text: str) -> str:
    """The id of a grammar text: 16 hex digits of its sha256 (the wire names a grammar by it)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Grammar:
    """A grammar compiled against one tokenizer: `matcher()` starts a generation under it."""

    def __init__(self, text: str, tokenizer):
        """text: llguidance's grammar text (grammar_from_*); tokenizer: grammar_tokenizer()'s.
        Raises GrammarError for a grammar over the size cap or one the engine refuses."""
        if not isinstance(text, str):
            raise GrammarError("a grammar is a text (llguidance's JSON form)")
        self.text = _capped(text)
        self.id = grammar_id(text)
        self.tokenizer = tokenizer
        llg = _llg()
        error = llg.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            raise GrammarError(f"the grammar is refused: {error.strip()[:500]}")
        self.vocab_size = int(tokenizer.vocab_size)
        self.stop_ids = frozenset(int(t) for t in tokenizer.eos_tokens)
        self._start = None           # a matcher in the start state, never advanced: each generation's is a copy

    def _fresh(self):
        """llguidance's matcher in the start state: a deep copy of one compiled once (~1 µs)
        instead of compiling the text again for every generation (~0.5-2 ms). The start state's
        mask is computed once too: a grammar the engine gives up on at once (a 100,000-item
        array of short items: "Too many items") is refused here, not in the middle of a reply."""
        if self._start is None:
            m = _llg().LLMatcher(self.tokenizer, self.text, log_level=0)
            if not m.is_error():
                m.compute_bitmask()
            if m.is_error():
                raise GrammarError(f"the grammar is refused: {m.get_error().splitlines()[0][:500]}")
            self._start = m
        return self._start.deep_copy()

    def check(self) -> "Grammar":
        """Compile it now and walk the tokens it forces from the start (GrammarError as the
        constructor's): the API does, to refuse at the door what the engine gives up on as soon
        as it starts (a 100,000-item array of short items fails on its "[")."""
        m = self.matcher()
        m.take_forced(64)
        if m._m.is_error():
            raise GrammarError(f"the grammar is refused: {m._m.get_error().splitlines()[0][:500]}")
        return self

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"Grammar(id={self.id}, {len(self.text)} bytes)"


class GrammarMatcher:
    """One generation's grammar state: the tokens consumed (`tokens`), what may come next."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._m = grammar._fresh()
        self.tokens: List[int] = []
        self._bits: Optional[np.ndarray] = None     # llguidance's packed mask here, until the state moves
        self._allowed: Optional[np.ndarray] = None  # the same unpacked (a loop asks for it more than once)

    @property
    def stop_ids(self) -> frozenset:
        return self.grammar.stop_ids

    def allowed(self) -> np.ndarray:
        """A bool mask [grammar vocab]: the tokens the grammar allows next (only the stop ids once
        it is complete). All False in an error state (a token it refused was consumed)."""
        if self._m.is_error():
            return np.zeros(self.grammar.vocab_size, dtype=bool)
        if self._allowed is None:
            self._allowed = np.unpackbits(self._packed(), bitorder="little")[:self.grammar.vocab_size].astype(bool)
            self._allowed.flags.writeable = False       # shared by every caller until the state moves
        return self._allowed

    def _packed(self) -> np.ndarray:
        if self._bits is None:
            self._bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return self._bits

    def _moved(self) -> None:
        self._bits = self._allowed = None

    def only_token(self) -> Optional[int]:
        """The token the grammar allows next when it allows exactly one (None otherwise): under
        the masked distribution it has probability 1, whatever the model's logits."""
        if self._m.is_error():
            return None
        bits = self._packed()
        nz = np.flatnonzero(bits)
        if nz.size != 1 or bits[nz[0]] & (bits[nz[0]] - 1):     # one byte, one bit in it
            return None
        token = int(nz[0]) * 8 + int(bits[nz[0]]).bit_length() - 1
        return token if token < self.grammar.vocab_size else None

    def take_forced(self, limit: int) -> List[int]:
        """Consume the tokens the grammar forces from here, at most `limit`: while its mask allows
        exactly one token, that token (a JSON key, punctuation, a call's fixed frame; the end
        token when only it may come). llguidance's mask over a forced stretch allows only its
        canonical tokens (its fast-forward tokens), so a stretch is taken a token at a time;
        the tokens stop after an end token."""
        taken: List[int] = []
        while len(taken) < limit and not self._m.is_error():
            token = self.only_token()
            if token is None or not self.consume(token):
                break
            taken.append(token)
            if token in self.stop_ids:
                break
        return taken

    def consume(self, token: int) -> bool:
        """Advance by one token; False (and nothing consumed) when the grammar refuses it."""
        token = int(token)
        if self._m.is_error() or self._m.validate_tokens([token]) != 1:
            return False
        self._moved()
        if not self._m.consume_token(token):
            return False
        self.tokens.append(token)
        return True

    def consume_all(self, tokens: Iterable[int]) -> int:
        """Advance through tokens up to the first one refused; returns how many were consumed."""
        n = 0
        for t in tokens:
            if not self.consume(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""
        if n <= 0:
            return
        self._moved()
        if n > len(self.tokens) or not self._m.rollback(n):
            raise GrammarError(f"cannot roll the grammar back {n} tokens ({len(self.tokens)} consumed)")
        del self.tokens[len(self.tokens) - n:]

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the consumed tokens exactly `tokens` (roll back to the common prefix, consume the
        rest). False when the grammar refuses one of them: it then holds the legal prefix."""
        mine = self.tokens
        if len(tokens) >= len(mine) and list(tokens[:len(mine)]) == mine:   # the usual case: it grew
            keep = len(mine)
        else:
            keep = 0
            for a, b in zip(mine, tokens):
                if a != int(b):
                    break
                keep += 1
            self.rollback(len(mine) - keep)
        rest = [int(t) for t in tokens[keep:]]
        return self.consume_all(rest) == len(rest)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but a stop id (or it is in error)."""
        return self._m.is_stopped()
