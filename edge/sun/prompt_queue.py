"""The queue of prompts a SUN prefill worker holds before it prefills them (full copy or adapters)."""
from __future__ import annotations

import itertools
from collections import deque
from typing import Deque, Dict, Optional

from edge.sun.token_rules import RowRules, SunGrammars, compile_grammar


class QueueFull(RuntimeError):
    """A prefill worker already holds max_queue prompts: the caller retries or goes elsewhere."""


class PromptQueue:
    """FIFO of (request id, ...) items, bounded by max_queue; a base of the prefill workers."""

    def __init__(self, name: str, max_queue: int, grammars: Optional[SunGrammars] = None):
        """grammars: the base tokenizer's (edge/sun/token_rules.py); None: a grammar is refused."""
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.name, self.max_queue, self.grammars = name, max_queue, grammars
        self._ids = itertools.count(1)
        self._queue: Deque[tuple] = deque()
        self._rules: Dict[str, RowRules] = {}     # rid -> its grammar and logprobs, for those with either

    def _admit(self, request_id: Optional[str], item: tuple, elsewhere: str, grammar: str = "",
               logprobs: Optional[int] = None) -> str:
        """Queue (rid, *item) and return rid; past max_queue raise QueueFull naming `elsewhere`;
        a grammar this worker cannot follow raises GrammarRefused (a ValueError)."""
        if len(self._queue) >= self.max_queue:
            raise QueueFull(f"{self.name}: {self.max_queue} prompts are queued already, its limit; "
                            f"retry later or add {elsewhere}")
        rules = None
        if grammar or logprobs is not None:
            rules = RowRules.of(compile_grammar(self.grammars, grammar, self.name), logprobs)
        rid = request_id or f"{self.name}#{next(self._ids)}"
        self._queue.append((rid, *item))
        if rules is not None:
            self._rules[rid] = rules
        return rid

    def take_rules(self, request_id: str) -> Optional[RowRules]:
        """The grammar and logprobs a queued prompt's token 0 follows (None: neither), forgotten here."""
        return self._rules.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued prompt; False if it is not queued (unknown, or prefilled already)."""
        for item in self._queue:
            if item[0] == request_id:
                self._queue.remove(item)
                self._rules.pop(request_id, None)
                return True
        return False

    @property
    def load(self) -> int:
        """Prompts queued."""
        return len(self._queue)

    def has_work(self) -> bool:
        return bool(self._queue)
