"""The one interface every backend implements (torch, onnxruntime, llama.cpp).

An engine holds one model and many *sequences*. A sequence is an int handle
that owns its KV cache. Logits come back as numpy arrays so the verification
math (edge/speculative/verify.py) never depends on a backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from edge.model.errors import EngineError  # noqa: F401  (every engine raises it; callers import it from here)


class Engine(ABC):
    """What every caller may use: the attributes below and the methods of this class.

    cfg holds the model's dimensions (num_layers, num_heads, num_kv_heads, head_dim) that KV
    blobs and memory plans need; capacity is the number of sequences the engine can hold at
    once (None: as many as memory allows; llama.cpp fixes it when the context is made);
    kv_itemsize is the bytes of one cached K or V element as this engine stores them.
    """
    vocab_size: int          # width of the logits rows
    max_len: int             # most tokens one sequence may hold
    fingerprint: str         # names the weights; KV blobs carry it
    cfg: Any                 # model dimensions (see above)
    name: str = "engine"     # backend name for reports
    capacity: Optional[int] = None
    kv_itemsize: int = 4
    forks: bool = False      # fork() copies a sequence's KV (else it raises)
    saves: bool = False      # save_sequence() / restore_sequence() keep a sequence off the engine (else they raise)

    @abstractmethod
    def new_sequence(self) -> int:
        """A new empty sequence."""

    @abstractmethod
    def free(self, seq: int) -> None:
        """Release a sequence and its KV memory."""

    @abstractmethod
    def length(self, seq: int) -> int:
        """Tokens held in the sequence's KV cache."""

    @abstractmethod
    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Feed tokens after the current end; logits[len(tokens), vocab].

        Used for prefill and for verifying gamma drafted tokens in one call.
        """

    def forward_last(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Like forward, but only the last token's logits ([1, vocab]). Prefills use it: engines
        that can skip the other rows' lm_head (vocab x hidden each) override it."""
        return self.forward(seq, tokens)[-1:]

    def forward_tail(self, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        """Like forward, but only the last n_rows tokens' logits ([n_rows, vocab]): a speculative
        round feeds tokens a grammar forced ahead of its drafts, whose rows nobody reads. Engines
        that can skip those rows' lm_head override it. n_rows >= 1."""
        return self.forward(seq, tokens)[-tail_rows(n_rows):]

    def forward_rows(self, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        """forward (n_rows 0: every row), forward_last (1) or forward_tail (more)."""
        if n_rows == 0:
            return self.forward(seq, tokens)
        return self.forward_last(seq, tokens) if n_rows == 1 else self.forward_tail(seq, tokens, n_rows)

    def forward_batch(self, calls: Sequence[tuple]) -> List[np.ndarray]:
        """Several sequences' forwards as one call: calls = [(seq, tokens) or (seq, tokens, n_rows)],
        each seq once; -> each call's logits (forward's rows; with n_rows, the last n_rows only:
        True is forward_last's one row). All or nothing: on an error no sequence has changed.
        Default: one call after another (rolled back on an error); engines that batch sequences
        in one pass override it."""
        calls = batch_calls(calls)
        before = [self.length(seq) for seq, _, _ in calls]
        out: List[np.ndarray] = []
        try:
            for seq, toks, rows in calls:
                out.append(self.forward_rows(seq, toks, rows))
        except BaseException:
            for (seq, _, _), n in zip(calls[:len(out)], before):
                self.truncate(seq, n)
            raise
        return out

    @abstractmethod
    def tokens(self, seq: int) -> list:
        """The tokens the sequence's KV cache holds, in order."""

    @property
    @abstractmethod
    def active_sequences(self) -> int:
        """Sequences held now."""

    def where(self) -> str:
        """Where the model runs, in words, for the role's start line (engines on a GPU say so)."""
        return "the CPU"

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token of one sequence costs (K and V of every layer)."""
        c = self.cfg
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.kv_itemsize

    def seq_kv_bytes(self, seq: Optional[int], length: Optional[int] = None) -> int:
        """KV bytes the engine holds for `seq` (None: a new sequence) now, or once it has held
        `length` tokens: what a memory limit must count. Default: the tokens' own bytes; engines
        that allocate ahead (torch: chunks, never given back on truncate) say more."""
        n = (self.length(seq) if seq is not None else 0) if length is None else length
        return n * self.kv_bytes_per_token()

    def fork(self, seq: int, n: int) -> int:
        """A new sequence holding a copy of `seq`'s first n tokens' KV (`seq` unchanged): a prompt
        cache gives a request the prefix it shares with a held conversation without prefilling it
        again, and keeps the conversation. Engines that can copy KV override it (forks = True)."""
        raise EngineError(f"the {self.name} engine cannot fork a sequence")

    def prefill_refeed(self, held: int, new: int) -> int:
        """How many of `held` cached tokens a prefill of `new` tokens after them had better feed
        again, because one longer call costs less than the short one (llama.cpp's CPU flash
        attention: edge/engines/llamacpp_tiles.py). Only a speed matter; 0 by default."""
        return 0

    @abstractmethod
    def truncate(self, seq: int, n: int) -> None:
        """Keep the first n tokens (rollback after a rejection)."""

    @abstractmethod
    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each of many sequences (ragged lengths); logits[len(seqs), vocab]."""

    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        """The sequence's KV cache as a blob (edge/model/kv.py) in `dtype`, with `meta` in its header."""
        raise EngineError(f"the {self.name} engine cannot export KV caches")

    def import_kv(self, blob: bytes) -> int:
        raise EngineError(f"the {self.name} engine cannot import KV caches")

    def save_sequence(self, seq: int) -> "SavedSequence":
        """A copy of `seq`'s KV and tokens in host memory, as the engine holds them (no conversion:
        restore_sequence gives back the same cells bit for bit); `seq` unchanged. A prompt cache keeps
        conversations this way beyond the sequences an engine holds (edge/speculative/saved_prompts.py)."""
        raise EngineError(f"the {self.name} engine cannot save a sequence")

    def restore_sequence(self, saved: "SavedSequence") -> int:
        """A new sequence holding what save_sequence saved (an EngineError when none is free)."""
        raise EngineError(f"the {self.name} engine cannot restore a sequence")

    def _check_step(self, seqs: Sequence[int], tokens: Sequence[int]) -> bool:
        """Validate a step's arguments (clear errors); False when there is nothing to step."""
        if len(seqs) != len(tokens):
            raise EngineError(f"step got {len(seqs)} sequences but {len(tokens)} tokens")
        if len(set(seqs)) != len(seqs):
            raise EngineError("step got the same sequence twice")
        return bool(seqs)

    # KV blobs (edge/model/kv_blob.py) are written and read with numpy, so the llama.cpp and onnxruntime
    # engines never import torch; only the torch engine reads them into torch tensors (TorchEngine._read_kv).
    def _blob(self, data: np.ndarray, tokens, dtype: str, meta) -> bytes:
        """A KV blob of this engine's model from float data [layers, 2, kv_heads, length, head_dim]."""
        from edge.model.kv_blob import KVError, encode
        try:
            return encode(data, self.fingerprint, dtype=dtype, tokens=tokens, meta=meta)
        except KVError as e:
            raise EngineError(str(e)) from None

    def check_kv(self, blob: bytes) -> dict:
        """The header of a KV blob this engine would import (fingerprint, shapes, length, checksum
        all checked), without importing it; an EngineError says why it would be refused."""
        from edge.model.kv_blob import KVError, unpack
        try:
            return unpack(blob, **self._kv_expect())[0]
        except KVError as e:
            raise EngineError(f"KV blob refused: {e}") from None

    def _kv_expect(self) -> dict:
        c = self.cfg
        return dict(fingerprint=self.fingerprint, layers=c.num_layers, kv_heads=c.num_kv_heads,
                    head_dim=c.head_dim, max_len=self.max_len)

    def _read_kv_array(self, blob: bytes):
        """(float32 numpy [layers, 2, kv_heads, length, head_dim], header) of a KV blob made for
        this engine's model, or an EngineError saying why it is refused."""
        from edge.model.kv_blob import KVError, decode
        try:
            return decode(blob, **self._kv_expect())
        except KVError as e:
            raise EngineError(f"KV blob refused: {e}") from None

    @staticmethod
    def _known(table: dict, seq: int):
        """table[seq], or a clear error for a sequence this engine does not hold."""
        try:
            return table[seq]
        except KeyError:
            raise EngineError(f"unknown sequence {seq}") from None

    def check_room(self, seq: int, n: int) -> None:
        """Raise a clear error when n more tokens would overflow the context."""
        have = self.length(seq)
        if have + n > self.max_len:
            raise EngineError(
                f"context full: sequence holds {have} tokens, {n} more would exceed "
                f"the model's context of {self.max_len}; use a shorter prompt or fewer new tokens")


@dataclass(frozen=True)
class SavedSequence:
    """Engine.save_sequence's copy: the tokens, the engine's own bytes for their KV, their size."""
    tokens: Tuple[int, ...]
    data: Any
    nbytes: int
    engine: str                # the engine's fingerprint: restored only where the same weights computed it


def tail_rows(n_rows: int) -> int:
    """forward_tail's n_rows, checked."""
    if isinstance(n_rows, bool) or int(n_rows) != n_rows or n_rows < 1:
        raise EngineError(f"forward_tail wants at least one row, got n_rows={n_rows!r}")
    return int(n_rows)


def batch_calls(calls: Sequence[tuple]) -> List[Tuple[int, List[int], int]]:
    """forward_batch's calls as (seq, tokens, n_rows), checked: each sequence at most once.
    n_rows: the last rows wanted, 0 for all (a bool: True is forward_last's one, False all)."""
    out = []
    for c in calls:
        if len(c) not in (2, 3) or (len(c) == 3 and int(c[2]) < 0):
            raise EngineError(f"a forward_batch call is (seq, tokens) or (seq, tokens, n_rows), got {c!r}")
        out.append((c[0], [int(t) for t in c[1]], min(int(c[2]), len(c[1])) if len(c) == 3 else 0))
    seqs = [c[0] for c in out]
    if len(set(seqs)) != len(seqs):
        raise EngineError("forward_batch got the same sequence twice")
    return out
