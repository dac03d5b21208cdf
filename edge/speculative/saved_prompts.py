"""A prompt cache's second tier: conversations saved off the engine, in host memory.

An engine holds few sequences (llama.cpp: a fixed number, allocated at start), so a prompt cache
(prefix_cache.py) keeps only its last few conversations there. The one it evicts is saved here
instead of dropped (Engine.save_sequence: the engine's own KV bytes, no conversion), up to a bound
in bytes, the least recently used dropped first; a request sharing more with a saved conversation
than with any held one gets it back (Engine.restore_sequence: a copy, milliseconds, where a
prefill of the same tokens takes seconds), as llama-server's `--cache-ram` does. Lossless as the
held tier: the restored cells are the ones the engine computed for those tokens.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Optional, Sequence, Tuple

from edge.engines.base import SavedSequence
from edge.speculative.common_prefix import common_prefix

DEFAULT_RAM_MB = 512.0


class SavedPrompts:
    """Saved sequences, least recently used first, at most `max_bytes` of them in all."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"saved prompts' bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._saved: "OrderedDict[int, SavedSequence]" = OrderedDict()
        self._keys = itertools.count(1)
        self.dropped = 0                       # saved ones let go to stay within max_bytes

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def bytes(self) -> int:
        return sum(s.nbytes for s in self._saved.values())

    def add(self, saved: SavedSequence) -> bool:
        """Keep `saved` (False: larger than the whole bound, not kept); older ones go to make room."""
        if not saved.tokens or saved.nbytes > self.max_bytes:
            return False
        self._saved[next(self._keys)] = saved
        while self.bytes > self.max_bytes:
            self._saved.popitem(last=False)
            self.dropped += 1
        return True

    def best(self, prompt: Sequence[int], better_than: int) -> Tuple[Optional[int], int]:
        """(key, n): the saved conversation sharing the longest prefix with `prompt`, n of its tokens
        (at most all but the prompt's last), when n > better_than; else (None, 0)."""
        key, keep = None, better_than
        for k, s in self._saved.items():
            if s.tokens[0] != prompt[0]:
                continue
            n = min(common_prefix(s.tokens, prompt), len(prompt) - 1)
            if n > keep:
                key, keep = k, n
        return (key, keep) if key is not None else (None, 0)

    def tokens(self, key: int) -> Tuple[int, ...]:
        return self._saved[key].tokens

    def take(self, key: int) -> SavedSequence:
        """The saved conversation, out of the tier (it goes back to the engine)."""
        return self._saved.pop(key)

    def peek(self, key: int) -> SavedSequence:
        """The saved conversation, kept (a copy of its prefix goes back): now the most recently used."""
        self._saved.move_to_end(key)
        return self._saved[key]

    def put_back(self, key: int, saved: SavedSequence) -> None:
        """A taken one whose restore failed, as it was (most recently used)."""
        self._saved[key] = saved

    def clear(self) -> None:
        self._saved.clear()
