"""The llama.cpp engine: a GGUF run by llama-cpp-python's low-level API behind the Engine interface.

One context holds several sequences (llama.cpp seq ids): `step` decodes a token for many in one
`llama_decode`, one ubatch when their slots are consecutive (stream_placement.py gathers them).
Logits only for the rows asked for; rollback is `llama_memory_seq_rm`. export_kv/import_kv (SUN)
and save_sequence/restore_sequence (a prompt cache's host-memory tier) go through llama.cpp's own
sequence state (llamacpp_kv.py, llamacpp_saved.py); llama and qwen2. Kernels round a row by the
call's shape unless exact_rows pads the calls (llamacpp_rows.py), and never as torch's fp32 does.
"""
from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError, tail_rows
from edge.engines.llamacpp_rows import ROOM, decode_exact
from edge.engines.llamacpp_saved import restore_state, save_state
from edge.engines.llamacpp_tiles import FITTED, chunk_sizes, refeed
from edge.engines.llamacpp_twin import open_twin
from edge.engines.llamacpp_load import (KV_ITEMSIZE, amx_compiled, init_backend, layers_on_gpu, llama_lib, load_model,
                                        new_context)
from edge.engines.stream_placement import plan_moves

__all__ = ["LlamaCppEngine", "amx_compiled"]   # amx_compiled: read by benchmarks/engines/llamacpp_amx_fix.py


class LlamaCppEngine(Engine):
    name = "llamacpp"
    forks = saves = True
    exact_rows = False                       # pad calls so rows round alike (llamacpp_rows.py; __init__)
    twin = None                              # --repack both's unrepacked copy (llamacpp_twin.py; __init__)

    def __init__(self, path: str | os.PathLike, max_len: int = 1024, n_seq_max: int = 8,
                 threads: Optional[int] = None, fingerprint: Optional[str] = None, n_batch: int = 512,
                 n_gpu_layers: int = 0, verbose: bool = False, kv_type: str = "f16",
                 flash_attn: Optional[bool] = None, extra_bufts: Optional[bool] = None,
                 mmap: Optional[bool] = None, exact_rows: bool = False, prefill_twin: bool = False):
        """max_len: context per sequence; n_seq_max: sequences one context holds at once; kv_type: the
        KV cache's precision (f16, llama.cpp's default, or f32); flash_attn: None lets llama.cpp choose
        (off is faster over a long cache: docs/models.md; exact_rows needs it on); extra_bufts: CPU
        weight repacking (`--repack`; None = llama.cpp's default, on; an AMX build keeps it off:
        llamacpp_repack.py; `self.repack` says what was chosen and why); mmap: None lets
        llamacpp_load.load_model decide; exact_rows: pad every call so that a row rounds alike
        whatever call computes it (llamacpp_rows.py, `--exact-rows`); prefill_twin: long prefills on
        an unrepacked copy of the weights (`--repack both`, llamacpp_twin.py)."""
        self._lc = lc = llama_lib()
        init_backend(lc, verbose)
        path = str(path)
        if not os.path.isfile(path):
            raise EngineError(f"no GGUF file at {path}")
        self._model, self.mmap, self.model_params, self.repack = load_model(lc, path, n_gpu_layers, extra_bufts, mmap)
        self._ctx = self._batch = None
        self.flash_attn, self.threads = flash_attn, threads
        self.tile_costs = FITTED             # a target with a prompt cache measures its own (tile_calibration.py)
        self.exact_rows = bool(exact_rows)
        room = ROOM if self.exact_rows else 0      # the last cells are kept for a call's padding
        self._ctx = new_context(lc, self._model, path, max_len, n_seq_max, n_batch, kv_type, flash_attn, threads)
        self.kv_itemsize = KV_ITEMSIZE[kv_type]
        self._mem = lc.llama_get_memory(self._ctx)
        self._n_batch = int(n_batch)
        self._batch = lc.llama_batch_init(self._n_batch, 0, 1)
        vocab = lc.llama_model_get_vocab(self._model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.max_len = (int(lc.llama_n_ctx_seq(self._ctx)) if hasattr(lc, "llama_n_ctx_seq") else int(max_len)) - room
        self.n_seq_max = int(n_seq_max)
        self.capacity = self.n_seq_max       # sequences held at once (SharedDecoder queues the rest)
        from edge.model.checkpoint_files import file_fingerprint  # not edge.model.checkpoint: it imports torch
        self.fingerprint = fingerprint if fingerprint is not None else file_fingerprint(Path(path))
        self.path = path
        self._free_slots = list(range(self.n_seq_max))   # a heap: the lowest free slot first
        self.gather = True                   # keep a batch on one run of slots (off: benchmarks only)
        self.moves = 0                       # stream moves made to keep batches on one run
        self._copies_queued = False          # moves llama.cpp copies at its next decode (_gather)
        self._slot: Dict[int, int] = {}
        self._tokens: Dict[int, List[int]] = {}
        self._ids = itertools.count(1)
        self._read_shape()
        self._kv_layout = None
        # what llama.cpp was told (its llama_model_params) and what that puts on the GPU
        self.n_gpu_layers = int(self.model_params.n_gpu_layers)
        self.gpu_layers = layers_on_gpu(lc, self.n_gpu_layers, self.cfg.num_layers)
        self.twin = open_twin(self, LlamaCppEngine, prefill_twin, max_len, n_batch, kv_type)

    def where(self) -> str:
        """Where the model runs, for the start line: layers on the GPU / CPU, and whether its weights
        are repacked for the CPU (and why: llamacpp_repack.py)."""
        n, asked = self.cfg.num_layers, f"(n_gpu_layers={self.n_gpu_layers})"
        where = f"all {n} layers on the CPU" if self.gpu_layers == 0 else f"{self.gpu_layers} of {n} layers on the GPU"
        return f"{where} {asked}; {self.repack.describe()}{self.twin.describe() if self.twin else ''}"

    def _read_shape(self) -> None:
        """The architecture, and the dimensions a KV blob must have (Engine._read_kv_array checks them)."""
        lc, m = self._lc, self._model
        heads = int(lc.llama_model_n_head(m))
        self.arch = self._meta("general.architecture") or "?"
        head_dim = int(self._meta(f"{self.arch}.attention.key_length") or int(lc.llama_model_n_embd(m)) // heads)
        self.cfg = SimpleNamespace(num_layers=int(lc.llama_model_n_layer(m)), num_heads=heads,
                                   num_kv_heads=int(lc.llama_model_n_head_kv(m)), head_dim=head_dim)

    def _meta(self, key: str) -> Optional[str]:
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def close(self) -> None:
        if getattr(self, "twin", None):
            self.twin.close()
        if self._free_context() and self._model:
            self._lc.llama_model_free(self._model)
            self._model = None

    def _free_context(self) -> bool:
        """Free the batch and the context (not the model); False if nothing was ever opened."""
        lc = getattr(self, "_lc", None)
        if lc is None:
            return False
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        return True

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- sequences ---------------------------------------------------------------
    def _get(self, seq: int) -> int:
        return self._known(self._slot, seq)

    def new_sequence(self) -> int:
        if not self._free_slots:
            raise EngineError(f"all {self.n_seq_max} llama.cpp sequence slots are in use; free a "
                              "sequence or load the engine with a larger n_seq_max")
        sid = next(self._ids)
        self._slot[sid] = heapq.heappop(self._free_slots)   # the lowest: batches stay on few runs
        self._tokens[sid] = []
        return sid

    def free(self, seq: int) -> None:
        slot = self._slot.pop(seq, None)
        if slot is None:
            return
        self._lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._tokens.pop(seq, None)
        heapq.heappush(self._free_slots, slot)

    def length(self, seq: int) -> int:
        self._get(seq)
        return len(self._tokens[seq])

    def fork(self, seq: int, n: int) -> int:
        """A new sequence with a copy of `seq`'s first n tokens (Engine.fork). Between slots (streams)
        llama.cpp copies a whole stream at its next decode (queued, as _gather's moves), then the
        copy is cut to n: the copied cells are exactly `seq`'s."""
        src = self._get(seq)
        if not 0 < n <= len(self._tokens[seq]) or min(self._tokens[seq][:n]) < 0:
            raise EngineError(f"cannot fork {n} tokens of sequence {seq} (it holds {len(self._tokens[seq])})")
        sid = self.new_sequence()
        dst = self._slot[sid]
        self._lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
        self._lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._lc.llama_memory_seq_rm(self._mem, dst, n, -1)
        self._copies_queued = True
        self._tokens[sid] = self._tokens[seq][:n]
        return sid

    def tokens(self, seq: int) -> list:
        self._get(seq)
        return list(self._tokens[seq])

    def save_sequence(self, seq: int):          # Engine.save_sequence: llamacpp_saved.py
        return save_state(self, seq)

    def restore_sequence(self, saved) -> int:
        return restore_state(self, saved)

    def prefill_refeed(self, held: int, new: int) -> int:
        """Engine.prefill_refeed: on the CPU with flash attention, where it pays (llamacpp_tiles.py)."""
        return 0 if self.flash_attn is False or self.gpu_layers else refeed(held, new, self.tile_costs)

    def truncate(self, seq: int, n: int) -> None:
        slot = self._get(seq)
        have = len(self._tokens[seq])
        if not 0 <= n <= have:
            raise EngineError(f"cannot truncate to {n}: the sequence holds {have} tokens")
        if n < have and not self._lc.llama_memory_seq_rm(self._mem, slot, n, -1):
            raise EngineError(f"llama.cpp refused to remove positions {n}.. of sequence {seq}")
        del self._tokens[seq][n:]

    @property
    def active_sequences(self) -> int:
        return len(self._slot)

    # -- compute -----------------------------------------------------------------
    def _check_ids(self, tokens):
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _decode(self, entries, want) -> np.ndarray:
        """entries: (token, pos, slot) in order, each slot's together; want: indices whose logits come
        back. With exact_rows the call is padded first (edge/engines/llamacpp_rows.py)."""
        if self.exact_rows and entries:
            return decode_exact(self, entries, want)
        return self._decode_raw(entries, want)

    def _decode_raw(self, entries, want) -> np.ndarray:
        b, lc = self._batch, self._lc
        b.n_tokens = len(entries)
        for i, (tok, pos, slot) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = slot
            b.logits[i] = 0
        for i in want:
            b.logits[i] = 1
        rc = lc.llama_decode(self._ctx, b)
        if rc in (0, 1):         # past llama.cpp's batch checks, where it applies queued stream copies
            self._copies_queued = False
        if rc != 0:
            raise EngineError(f"llama_decode failed (code {rc}: "
                              f"{'no KV slot: context full' if rc == 1 else 'invalid batch or fatal error'})")
        out = np.empty((len(want), self.vocab_size), dtype=np.float32)
        for r, i in enumerate(want):
            ptr = lc.llama_get_logits_ith(self._ctx, i)
            out[r] = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
        return out

    def _feed(self, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        """Feed tokens; the logits of the last n_rows of them (0: of every one)."""
        slot = self._get(seq)
        tokens = [int(t) for t in tokens]
        if not tokens:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        self._check_ids(tokens)
        self.check_room(seq, len(tokens))
        if self.twin and self.twin.takes(len(tokens)):
            return self.twin.feed(self, seq, tokens, n_rows)
        start = len(self._tokens[seq])
        first = len(tokens) - min(n_rows, len(tokens)) if n_rows else 0     # the first row wanted
        parts, c0 = [], 0
        for size in chunk_sizes(len(tokens), self._n_batch):    # no short last call (llamacpp_tiles.py)
            chunk = tokens[c0: c0 + size]
            entries = [(t, start + c0 + i, slot) for i, t in enumerate(chunk)]
            try:
                logits = self._decode(entries, list(range(max(0, first - c0), len(chunk))))
            except EngineError:
                self._lc.llama_memory_seq_rm(self._mem, slot, start, -1)  # leave the sequence as it was
                raise
            parts.append(logits)
            c0 += size
        self._tokens[seq].extend(tokens)
        return np.concatenate(parts)

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        return self._feed(seq, tokens, 0)

    def forward_last(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Like forward, but only the last token's logits ([1, vocab]): a prefill computes one row."""
        return self._feed(seq, tokens, 1)

    def forward_tail(self, seq: int, tokens: Sequence[int], n_rows: int) -> np.ndarray:
        """Like forward, but only the last n_rows tokens' logits: the others' lm_head is skipped."""
        return self._feed(seq, tokens, tail_rows(n_rows))

    def forward_batch(self, calls) -> List[np.ndarray]:
        from edge.engines.llamacpp_batch import feed_batch   # one llama_decode for several sequences
        return feed_batch(self, calls)

    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if not self._check_step(seqs, tokens):
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        if len(seqs) > self._n_batch:
            raise EngineError(f"step over {len(seqs)} sequences exceeds the batch size {self._n_batch}")
        tokens = [int(t) for t in tokens]
        self._check_ids(tokens)
        slots = [self._get(s) for s in seqs]
        for s in seqs:
            self.check_room(s, 1)
        # llama.cpp splits a batch where the slots stop being consecutive (stream_placement.py)
        if self.gather and len(slots) > 1:
            slots = self._gather(seqs, slots)
        order = sorted(range(len(seqs)), key=lambda i: slots[i]) if self.gather else list(range(len(seqs)))
        entries = [(tokens[i], len(self._tokens[seqs[i]]), slots[i]) for i in order]
        try:
            rows = self._decode(entries, list(range(len(seqs))))
        except EngineError:                  # ubatches that ran before the failure wrote their cells
            for _, pos, slot in entries:
                self._lc.llama_memory_seq_rm(self._mem, slot, pos, -1)
            raise
        out = np.empty_like(rows)
        out[order] = rows
        for s, t in zip(seqs, tokens):
            self._tokens[s].append(t)
        return out

    def _gather(self, seqs: Sequence[int], slots: List[int]) -> List[int]:
        """Move sequences so that this batch's slots are one run: one ubatch, not several."""
        moves = plan_moves(slots, set(self._slot.values()), self.n_seq_max)
        if not moves:
            return slots
        by_slot = {v: k for k, v in self._slot.items()}
        for src, dst in moves:            # copied in this order at the next decode
            self._lc.llama_memory_seq_rm(self._mem, dst, -1, -1)
            self._lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            self._lc.llama_memory_seq_rm(self._mem, src, -1, -1)
            seq = by_slot.pop(src)
            self._slot[seq], by_slot[dst] = dst, seq
        self._free_slots = sorted(set(range(self.n_seq_max)) - set(self._slot.values()))
        self.moves += len(moves)
        self._copies_queued = True
        return [self._slot[s] for s in seqs]

    # -- KV transfer (SUN prefill / shared decoder) ----------------------------------
    def _check_kv_arch(self) -> bool:
        from edge.engines.llamacpp_kv import KV_ARCHS, PERMUTED_ARCHS
        if self.arch not in KV_ARCHS:
            raise EngineError(f"KV transfer with llama.cpp supports {sorted(KV_ARCHS)} GGUFs, not {self.arch!r}")
        return self.arch in PERMUTED_ARCHS

    def _state(self, slot: int) -> memoryview:
        """The sequence state of `slot`, as llama.cpp writes it (llamacpp_kv.py), not copied again."""
        n = self._lc.llama_state_seq_get_size(self._ctx, slot)
        buf = (ctypes.c_uint8 * n)()
        got = self._lc.llama_state_seq_get_data(self._ctx, buf, n, slot)
        if got != n:
            raise EngineError(f"llama.cpp wrote {got} of {n} bytes of sequence state")
        return memoryview(buf).cast("B")

    def _parse(self, slot: int):
        from edge.engines.llamacpp_kv import StateError, parse_state
        c = self.cfg
        try:
            return parse_state(self._state(slot), c.num_layers, c.num_kv_heads, c.head_dim, self._check_kv_arch())
        except StateError as e:
            raise EngineError(f"cannot read llama.cpp's KV cache: {e}") from None

    def _apply_queued_copies(self, slot: int, pos: int) -> None:
        """Before a stream's buffer is read or written directly (sequence state): a decode that failed
        llama.cpp's batch checks right after a move left the copy queued, and a queued copy would
        read the buffer only later. A one-token decode at `pos` in `slot` applies it; then removed."""
        if not self._copies_queued:
            return
        try:
            self._decode_raw([(0, pos, slot)], [])
        except EngineError:
            if self._copies_queued:
                raise
        finally:
            self._lc.llama_memory_seq_rm(self._mem, slot, pos, -1)

    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        self._apply_queued_copies(self._get(seq), len(self._tokens[seq]))
        data, self._kv_layout = self._parse(self._get(seq))
        toks = self._tokens[seq]
        return self._blob(data, toks if min(toks, default=0) >= 0 else None, dtype, meta)

    def _layout(self, slot: int):
        """How this context writes sequence state, learned once from a one-token probe in `slot`."""
        if self._kv_layout is None:
            self._decode_raw([(0, 0, slot)], [])
            try:
                self._kv_layout = self._parse(slot)[1]
            finally:
                self._lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
        return self._kv_layout

    def import_kv(self, blob: bytes) -> int:
        from edge.engines.llamacpp_kv import build_state
        permuted = self._check_kv_arch()
        data, head = self._read_kv_array(blob)
        length = head["length"]
        sid = self.new_sequence()
        slot = self._slot[sid]
        try:
            self._apply_queued_copies(slot, 0)   # this slot may be a queued copy's source
            raw = build_state(data, self._layout(slot), slot, permuted)
            buf = (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw)
            if length and self._lc.llama_state_seq_set_data(self._ctx, buf, len(raw), slot) != len(raw):
                raise EngineError("llama.cpp refused the KV state (no room in its cache, or a layout it "
                                  "does not expect); the sequence was not admitted")
        except BaseException:
            self.free(sid)
            raise
        toks = list(head.get("tokens") or [])
        # positions are what llama.cpp needs; a blob without its tokens gets -1 placeholders
        self._tokens[sid] = toks if len(toks) == length else [-1] * length
        return sid
