"""The PyTorch engine: edge/model/transformer.py + per-sequence KV caches behind the Engine interface.

By default it runs `Transformer.forward_cached` over `edge.model.kv.BatchCache`: new
K/V are written in place into each sequence's preallocated cache and attention
reads views of it, so a step costs the weights read plus each sequence's own
KV, not a copy of every past. `fast=False` keeps the functional reference path
(`Transformer.forward` + padded gather), for comparisons (benchmarks/
torch_engine_costs.py) and tests.

Threads: every call sets its own thread count and restores the process
setting afterwards. Calls over <= 5 rows (a decode step, a verify call, a small
batch) are memory-bound and run at one thread, where the skinny kernel of
`edge.model.transformer.fast_linear` applies; larger calls (prefill, big batches) run at
`threads`. Its default is one thread on small machines (<= 4 cores): they are
shared by several roles, and an OpenMP team whose other thread is descheduled
stalls at every barrier. Measured on the 2-core box (benchmarks/results/
torch_engine_costs.md): under load (load average ~8) two threads made a
SmolLM2 step 5x (batch 1) to 50x (2..16 rows) slower than one thread; idle,
two threads made 16-row steps and prefills ~1.4x faster. Pass threads=2 on a
machine the engine has to itself.

Device: `device` (cpu, cuda, cuda:N) holds the weights, every sequence's preallocated KV and
the batched step / verify calls; only the logits rows come back to the host (as numpy, for
sampling and the lossless verify math, which never change). `dtype` (float32, bfloat16,
float16) converts the weights; the KV is kept in the weights' dtype. KV blobs are host bytes:
export copies the cache to the host in the blob's dtype (float16 by default), import converts
the blob's values to this engine's dtype on its device (round to nearest even), so a blob made
on a GPU imports on a CPU engine and back, and between float32 and bfloat16 engines.
"""
from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from edge.engines.base import Engine, EngineError, SavedSequence, batch_calls
from edge.model.kv import INITIAL_CAPACITY, BatchCache, KVError, SequenceKV, gather, scatter_new
from edge.model.transformer import SKINNY_MAX_ROWS, Transformer


_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def default_threads() -> int:
    """Threads an engine uses when not told: 1 on machines with <= 4 cores, else torch's default."""
    return 1 if (os.cpu_count() or 1) <= 4 else torch.get_num_threads()


class TorchEngine(Engine):
    name = "torch"
    saves = True

    def __init__(self, model: Transformer, fingerprint: str = "", max_len: Optional[int] = None,
                 threads: Optional[int] = None, fast: bool = True, device=None, dtype=None):
        """device: where the weights, KV and calls live (None: where the model already is);
        dtype: convert the weights (a torch dtype or float32 / bfloat16 / float16)."""
        if dtype is not None:
            inv_freq = getattr(model, "inv_freq", None)
            model = model.to(dtype=_DTYPE_NAMES.get(dtype, dtype))
            if inv_freq is not None:      # RoPE frequencies stay float32, as the checkpoint loaders keep them
                model.inv_freq = inv_freq
        if device is not None:
            model = model.to(device=device)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.fast = fast
        cfg = model.cfg
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.max_len = int(max_len or cfg.max_position)
        self.fingerprint = fingerprint
        self.dtype = next(model.parameters()).dtype
        self.kv_itemsize = self.dtype.itemsize     # the cache is kept in the weights' dtype
        self.threads = int(threads) if threads else default_threads()
        self._seqs: Dict[int, SequenceKV] = {}
        self._tokens: Dict[int, list] = {}
        self._ids = itertools.count(1)

    def where(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "the CPU"
        return f"torch device {self.device} ({name}), {str(self.dtype).replace('torch.', '')}"

    # -- sequences ---------------------------------------------------------------
    def _get(self, seq: int) -> SequenceKV:
        return self._known(self._seqs, seq)

    def new_sequence(self) -> int:
        sid = next(self._ids)
        c = self.cfg
        self._seqs[sid] = SequenceKV(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.max_len,
                                     device=self.device)
        self._tokens[sid] = []
        return sid

    def free(self, seq: int) -> None:
        self._seqs.pop(seq, None)
        self._tokens.pop(seq, None)

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def tokens(self, seq: int) -> list:
        """Tokens fed so far (the draft service uses it to honour `keep`)."""
        self._get(seq)
        return list(self._tokens[seq])

    def truncate(self, seq: int, n: int) -> None:
        try:
            self._get(seq).truncate(n)
        except KVError as e:
            raise EngineError(str(e)) from None
        del self._tokens[seq][n:]

    @property
    def active_sequences(self) -> int:
        return len(self._seqs)

    def save_sequence(self, seq: int):
        """Engine.save_sequence: the used cells copied (not the grown capacity)."""
        kv, tokens = self._get(seq), tuple(self._tokens[seq])
        data = kv.data[:, :, :, : kv.length].clone()
        return SavedSequence(tokens, data, data.numel() * data.element_size(), self._weights_id())

    def _weights_id(self) -> str:
        return self.fingerprint or f"unnamed weights {id(self.model)}"

    def restore_sequence(self, saved) -> int:
        if saved.engine != self._weights_id() or saved.data.dtype != self.dtype:
            raise EngineError("a saved sequence goes back only to the model that computed it")
        sid = self.new_sequence()
        kv = self._seqs[sid]
        kv.append(saved.data.to(self.device))
        self._tokens[sid] = list(saved.tokens)
        return sid

    def kv_bytes(self) -> int:
        return sum(s.data.numel() * s.data.element_size() for s in self._seqs.values())

    def seq_kv_bytes(self, seq: Optional[int], length: Optional[int] = None) -> int:
        """Allocated, not used: a cache starts at INITIAL_CAPACITY tokens and doubles (edge/model/kv.py)."""
        cap = self._get(seq).capacity if seq is not None else min(INITIAL_CAPACITY, self.max_len)
        if length is not None:
            cap = SequenceKV.grown(cap, length, self.max_len)
        return cap * self.kv_bytes_per_token()

    # -- compute -----------------------------------------------------------------
    def _out(self, logits: torch.Tensor) -> np.ndarray:
        # float64 models keep float64 so exactness tests are not blurred by a cast
        # the one host copy of a call: its logits rows
        return logits.cpu().numpy() if logits.dtype == torch.float64 else logits.float().cpu().numpy()

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        return self._feed(seq, tokens, last_only=False)

    def forward_last(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Like forward, but only the last token's logits ([1, vocab]): a prefill computes one row."""
        return self._feed(seq, tokens, last_only=True)

    @contextmanager
    def _threads(self, rows: int):
        """Run a call over `rows` at its thread count (module doc); restore the process setting."""
        n = 1 if (self.fast and rows <= SKINNY_MAX_ROWS) else self.threads
        old = torch.get_num_threads()
        if old != n:
            torch.set_num_threads(n)
        try:
            yield
        finally:
            if old != n:
                torch.set_num_threads(old)

    @torch.inference_mode()
    def _feed(self, seq: int, tokens: Sequence[int], last_only: bool) -> np.ndarray:
        kv = self._get(seq)
        tokens = [int(t) for t in tokens]
        if not tokens:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        self._check_ids(tokens)
        self.check_room(seq, len(tokens))
        t = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with self._threads(len(tokens)):
            if self.fast:
                logits = self._cached([kv], t, last_only)
            else:
                past = kv.past() if kv.length else None
                logits, present = self.model(t, past=past, logits_last_only=last_only)
                scatter_new([kv], present, kv.length)
        self._tokens[seq].extend(tokens)
        return self._out(logits[0])

    def _cached(self, kvs, t: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        cache = BatchCache(kvs, t.shape[1])
        logits = self.model.forward_cached(t, cache, last_only=last_only)
        cache.commit()
        return logits

    @torch.inference_mode()
    def forward_batch(self, calls: Sequence[tuple]) -> List[np.ndarray]:
        """Several sequences' forwards in one pass, so the weights are read once for all of them
        (a verify service joining its sessions' drafts). Shorter calls are padded at their end to
        the longest with their own last token: causal attention keeps the real rows unchanged,
        and the padding's rows and KV entries are dropped after. All or nothing: the cache's
        lengths move only when the pass completed (BatchCache.commit)."""
        calls = batch_calls(calls)
        T = max((len(toks) for _, toks, _ in calls), default=0)
        if (not self.fast or len(calls) < 2 or any(not toks for _, toks, _ in calls)
                or any(self.length(seq) + T > self.max_len for seq, _, _ in calls)):
            return super().forward_batch(calls)      # one call after another (errors said there)
        for _, toks, _ in calls:
            self._check_ids(toks)
        kvs = [self._get(seq) for seq, _, _ in calls]
        padded = [toks + [toks[-1]] * (T - len(toks)) for _, toks, _ in calls]
        t = torch.tensor(padded, dtype=torch.long, device=self.device)
        with self._threads(len(calls) * T):
            logits = self._cached(kvs, t)             # [B, T, V]; every length moved by T
        out = []
        for b, (seq, toks, rows) in enumerate(calls):
            n = len(toks)
            kvs[b].truncate(kvs[b].length - (T - n))  # the padding's entries
            self._tokens[seq].extend(toks)
            out.append(self._out(logits[b, n - (rows or n):n]))
        return out

    @torch.inference_mode()
    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if not self._check_step(seqs, tokens):
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        kvs = [self._get(s) for s in seqs]
        tokens = [int(t) for t in tokens]
        self._check_ids(tokens)
        for s in seqs:
            self.check_room(s, 1)
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        with self._threads(len(tokens)):
            if self.fast:
                logits = self._cached(kvs, t)
            else:
                past, lengths = gather(kvs)
                P = past[0][0].shape[2]
                logits, present = self.model(t, past=past if P else None, past_lengths=lengths)
                scatter_new(kvs, present, P)
        for s, tok in zip(seqs, tokens):
            self._tokens[s].append(tok)
        return self._out(logits[:, 0])

    def _check_ids(self, tokens):
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    # -- KV transfer ---------------------------------------------------------------
    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        return self._get(seq).to_bytes(self.fingerprint, dtype=dtype, tokens=self._tokens[seq], meta=meta)

    def _read_kv(self, blob: bytes, dtype):
        """(SequenceKV, header) of a KV blob made for this engine's model (torch tensors in `dtype`),
        or an EngineError saying why it is refused."""
        from edge.model.kv import KVError, SequenceKV
        try:
            return SequenceKV.from_bytes(blob, dtype=dtype, device=self.device, **self._kv_expect())
        except KVError as e:
            raise EngineError(f"KV blob refused: {e}") from None

    def import_kv(self, blob: bytes) -> int:
        kv, head = self._read_kv(blob, self.dtype)
        sid = next(self._ids)
        self._seqs[sid] = kv
        self._tokens[sid] = list(head.get("tokens") or [])
        return sid
