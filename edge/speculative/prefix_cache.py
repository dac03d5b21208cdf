"""A target's prompt cache: the KV of its recent conversations, reused by the next request.

A chat's next turn resends the whole conversation; prefilling it again costs as much as the
first time (Qwen2.5-Coder-1.5B, 2 CPU threads: ~30 s for 2,000 tokens). `PrefixCache` keeps
the engine sequences of the last few generations instead of freeing them, and hands a new
request the held sequence that shares the longest token prefix with its prompt, truncated to
that prefix: only the rest of the prompt is fed.

* Bounded in sequences (`slots`) and in KV bytes as the engine allocates them
  (Engine.seq_kv_bytes: torch keeps its grown chunks after a truncate); the least recently
  used sequence goes first.
* At least one prompt token is always fed (a prompt held whole is cut to all but its last
  token): its logits are the first step's. Where one longer call costs less than the short rest
  (llama.cpp's CPU flash attention tiles 64 rows: Engine.prefill_refeed), a few held tokens are
  fed again with it, and are not counted as reused.
* A held sequence is taken out of the cache while a generation uses it: never two at once.
* It is reused when the prompt covers at least half of what it holds, or SHARED_ENOUGH tokens
  of it; a shorter match (two conversations sharing a short system prompt) gets a fresh
  sequence, so that the held conversation survives for its own next turn -- on an engine that
  forks (Engine.fork: llama.cpp copies the KV), a fresh sequence holding a copy of the shared
  prefix when it is at least FORK_ENOUGH tokens and a sequence is free, as llama-server's slots
  reuse a common prefix.
* An engine with a fixed number of sequences (llama.cpp's n_seq_max) counts the held ones:
  when a fresh sequence is refused, held ones are freed, least recently used first.
* With `ram_bytes` an evicted conversation is saved to host memory first (saved_prompts.py: the
  engine's own KV bytes, up to ram_bytes in all) and restored when a request shares more with it
  than with any held one: the whole of it (taken out of the tier) under the reuse rule above, else
  a copy of its prefix when that is FORK_ENOUGH tokens (the saved one stays).

Lossless: a held sequence's tokens are the engine's own record of its KV (Engine.tokens), so
what is reused is exactly the KV a cold prefill of those tokens computes (up to the rounding
of how the tokens were batched into calls: llama.cpp's one-token and many-token calls differ in
the last bits, torch float64 agrees token for token).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from edge.engines.base import Engine, EngineError
from edge.speculative.common_prefix import common_prefix
from edge.speculative.saved_prompts import SavedPrompts

DEFAULT_SLOTS = 4
DEFAULT_MB = 1024.0
SHARED_ENOUGH = 64      # a prefix this long is worth reusing whatever else the sequence holds
FORK_ENOUGH = 16        # a shorter shared prefix is copied (Engine.fork) from this long on


@dataclass
class _Held:
    tokens: Tuple[int, ...]
    nbytes: int


class PrefixCache:
    """Sequences of one engine held between generations (module doc)."""

    def __init__(self, engine: Engine, slots: int = DEFAULT_SLOTS, max_bytes: Optional[int] = None,
                 ram_bytes: int = 0):
        """ram_bytes: the most KV bytes of evicted conversations saved to host memory (0: none; an
        engine that cannot save keeps none)."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"prompt cache slots must be an integer >= 0, got {slots!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"prompt cache bytes must be >= 0, got {max_bytes!r}")
        self.engine, self.slots, self.max_bytes = engine, slots, max_bytes
        self._held: "OrderedDict[int, _Held]" = OrderedDict()     # least recently used first
        self._lock = threading.Lock()                            # guards the table, not the engine
        self.saved = SavedPrompts(int(ram_bytes)) if ram_bytes and slots and engine.saves else None
        self.stats = {"requests": 0, "hits": 0, "reused_tokens": 0, "evicted": 0, "forks": 0,
                      "saved": 0, "restored": 0}

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(h.nbytes for h in self._held.values())

    def held(self) -> list:
        """The token lists held, least recently used first (tests, reports)."""
        with self._lock:
            return [list(h.tokens) for h in self._held.values()]

    # ---- a generation takes a sequence ... ----
    def acquire(self, prompt: Sequence[int]) -> Tuple[int, int]:
        """(a sequence for a generation of `prompt`, how many of its first tokens it holds already).
        The sequence holds exactly prompt[:n]; feed the rest."""
        prompt = [int(t) for t in prompt]
        with self._lock:
            self.stats["requests"] += 1
            seq, keep = self._best(prompt)
            if self.saved is not None:
                restored = self._restore(prompt, max(keep, self._shared(prompt)))
                if restored is not None:
                    return restored
            if seq is not None and seq in self._held:     # (a failed restore may have evicted it)
                del self._held[seq]
                keep -= self.engine.prefill_refeed(keep, len(prompt) - keep)
                try:
                    if self.engine.length(seq) != keep:
                        self.engine.truncate(seq, keep)
                except EngineError:
                    self.engine.free(seq)
                else:
                    return self._hit(seq, keep)
            forked = self._fork(prompt)
            return forked if forked is not None else (self._fresh(), 0)

    def _hit(self, seq: int, keep: int) -> Tuple[int, int]:
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += keep
        return seq, keep

    def _shared(self, prompt: list) -> int:
        """The longest prefix a held sequence shares with `prompt` (what a fork would copy), from FORK_ENOUGH."""
        n = max((min(common_prefix(h.tokens, prompt), len(prompt) - 1) for h in self._held.values()), default=0)
        return n if n >= FORK_ENOUGH and self.engine.forks else 0

    def _restore(self, prompt: list, better_than: int) -> Optional[Tuple[int, int]]:
        """(a sequence restored from the saved tier, its usable prefix) when a saved conversation
        shares more than `better_than` tokens with `prompt` (and at least FORK_ENOUGH); else None."""
        key, n = self.saved.best(prompt, max(better_than, FORK_ENOUGH - 1))
        if key is None:
            return None
        whole = _reusable(n, len(self.saved.tokens(key)))
        saved = self.saved.take(key) if whole else self.saved.peek(key)
        keep = n - self.engine.prefill_refeed(n, len(prompt) - n)
        try:
            if keep < 1:
                raise EngineError("nothing left to reuse")
            seq = self._fresh(lambda: self.engine.restore_sequence(saved))
        except EngineError:
            if whole:
                self.saved.put_back(key, saved)
            return None
        try:
            self.engine.truncate(seq, keep)
        except EngineError:
            self.engine.free(seq)
            return None
        self.stats["restored"] += 1
        return self._hit(seq, keep)

    def _fork(self, prompt: list) -> Optional[Tuple[int, int]]:
        """(a new sequence holding a copy of the longest prefix a held one shares with `prompt`, its
        length), or None: none shares FORK_ENOUGH tokens, the engine cannot fork, or no sequence is free."""
        eng = self.engine
        if not eng.forks or (eng.capacity is not None and eng.active_sequences >= eng.capacity):
            return None
        best, keep = None, FORK_ENOUGH - 1
        for seq, h in self._held.items():
            n = min(common_prefix(h.tokens, prompt), len(prompt) - 1)
            if n > keep:
                best, keep = seq, n
        if best is None:
            return None
        keep -= eng.prefill_refeed(keep, len(prompt) - keep)
        if keep < 1:
            return None
        try:
            forked = eng.fork(best, keep)
        except EngineError:
            return None
        self._held.move_to_end(best)            # it served a request: recently used
        self.stats["hits"] += 1
        self.stats["forks"] += 1
        self.stats["reused_tokens"] += keep
        return forked, keep

    def _best(self, prompt: list) -> Tuple[Optional[int], int]:
        """The held sequence to reuse for `prompt` (still in the table) and its usable prefix."""
        best, keep = None, 0
        for seq, h in self._held.items():
            n = min(common_prefix(h.tokens, prompt), len(prompt) - 1)
            if n > keep and _reusable(n, len(h.tokens)):
                best, keep = seq, n
        return best, keep

    def _fresh(self, make=None) -> int:
        """A new sequence (`make`: engine.new_sequence); held ones make room where the engine holds a
        fixed number."""
        eng = self.engine
        make = make or eng.new_sequence
        while self._held and eng.capacity is not None and eng.active_sequences >= eng.capacity:
            self._evict()
        while True:
            try:
                return make()
            except EngineError:
                if not self._held:
                    raise
                self._evict()

    # ---- ... and gives it back ----
    def release(self, seq: int) -> None:
        """Take back a generation's sequence: held for the next request (or freed when it does not
        fit the bounds, or its record is not one to trust)."""
        eng = self.engine
        try:
            tokens = eng.tokens(seq)
            usable = self.slots > 0 and tokens and len(tokens) == eng.length(seq) and min(tokens) >= 0
            nbytes = eng.seq_kv_bytes(seq) if usable else 0
        except EngineError:
            return                                      # not the engine's (any more)
        if not usable or (self.max_bytes is not None and nbytes > self.max_bytes):
            eng.free(seq)
            return
        with self._lock:
            self._held[seq] = _Held(tuple(tokens), nbytes)
            while len(self._held) > self.slots or (self.max_bytes is not None and self.held_bytes > self.max_bytes):
                self._evict()

    def discard(self, seq: int) -> None:
        """Free a generation's sequence instead of keeping it."""
        self.engine.free(seq)

    def clear(self) -> None:
        """Free every held sequence and forget the saved ones."""
        with self._lock:
            while self._held:
                self._evict(save=False)
            if self.saved is not None:
                self.saved.clear()

    def _evict(self, save: bool = True) -> None:
        """Free the least recently used held sequence, saved to host memory first where there is a tier."""
        seq, _ = self._held.popitem(last=False)
        self.stats["evicted"] += 1
        if save and self.saved is not None:
            try:
                self.stats["saved"] += self.saved.add(self.engine.save_sequence(seq))
            except EngineError:
                pass                            # not saved: dropped, as without a tier
        self.engine.free(seq)


def _reusable(n: int, held: int) -> bool:
    """A sequence holding `held` tokens is worth reusing whole for a prompt sharing n of them."""
    return 2 * n >= held or n >= SHARED_ENOUGH


def take_sequence(engine: Engine, cache: Optional[PrefixCache], prompt: Sequence[int]) -> Tuple[int, int]:
    """(the sequence a generation of `prompt` runs on, the prompt tokens it holds already)."""
    if cache is None:
        return engine.new_sequence(), 0
    if cache.engine is not engine:
        raise ValueError("the prompt cache holds another engine's sequences")
    return cache.acquire(prompt)


def give_back(engine: Engine, cache: Optional[PrefixCache], seq: int, error: Optional[BaseException] = None) -> None:
    """End a generation's use of `seq`: kept by the cache, else freed. After an `error` the
    sequence is kept only when the error is an ordinary exception (a client gone, a stop text):
    its KV still matches the tokens the engine records for it (PrefixCache.release checks)."""
    if cache is None or (error is not None and not isinstance(error, Exception)):
        engine.free(seq)
    else:
        cache.release(seq)
