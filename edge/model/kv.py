"""Per-sequence KV cache: preallocated, a length pointer, rollback, ragged batching, bytes.

A sequence's cache is one tensor [layers, 2 (k/v), kv_heads, capacity, head_dim]
plus `length`. Rollback after a rejected draft is `truncate(n)`: it only moves
the pointer. Capacity grows by doubling (amortised O(1) per token) up to the
model's context. The cache lives on its engine's device (CPU or CUDA); its bytes leave it
only as a blob (to_bytes copies to the host), so a blob made on one device imports on another.
Many sequences of different lengths are batched by padding
their caches to the longest one (`gather`), which is what lets one draft or
one shared decoder step many clients with one read of the weights.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from edge.model import kv_blob
from edge.model.kv_blob import MAGIC, VERSION, KVError  # noqa: F401  (the blob format lives in kv_blob)

INITIAL_CAPACITY = 64      # tokens a new sequence's cache is allocated for
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16}


class SequenceKV:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 max_len: int = 2048, capacity: int = INITIAL_CAPACITY, device=None):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.length = 0
        self.data = torch.zeros(layers, 2, kv_heads, min(capacity, max_len), head_dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @staticmethod
    def grown(cap: int, need: int, max_len: int) -> int:
        """The capacity `reserve` leaves for `need` tokens from capacity `cap` (it never shrinks)."""
        if need <= cap:
            return cap
        while cap < need:
            cap *= 2
        return min(cap, max_len)

    def reserve(self, n: int) -> None:
        """Make room for n more tokens (doubling), or fail if past max_len."""
        need = self.length + n
        if need > self.max_len:
            raise KVError(f"KV cache full: {self.length} + {n} tokens exceeds the context of {self.max_len}")
        if need <= self.capacity:
            return
        cap = self.grown(self.capacity, need, self.max_len)
        grown = torch.zeros(*self.data.shape[:3], cap, self.head_dim, dtype=self.dtype, device=self.data.device)
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown

    def append(self, new: torch.Tensor) -> None:
        """new: [layers, 2, kv_heads, T, head_dim] for the next T positions."""
        T = new.shape[3]
        self.reserve(T)
        self.data[:, :, :, self.length: self.length + T] = new
        self.length += T

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise KVError(f"cannot truncate to {n}: the sequence holds {self.length} tokens")
        self.length = n

    def past(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Views [1, kv_heads, length, head_dim] per layer (no copy)."""
        d = self.data[:, :, :, : self.length]
        return [(d[i, 0][None], d[i, 1][None]) for i in range(self.layers)]

    # -- bytes (edge/model/kv_blob.py's format; torch converts the payload, as it always did) ----------
    def to_bytes(self, fingerprint: str, dtype: str = "float16", tokens: Optional[Sequence[int]] = None,
                 meta: Optional[dict] = None) -> bytes:
        """Header (JSON) + raw KV in `dtype` (fp16 default) + crc32 of the payload."""
        kv_blob.check_dtype(dtype)
        payload = self.data[:, :, :, : self.length].to(_DTYPES[dtype]).cpu().contiguous()   # host copy
        raw = payload.view(torch.uint8).numpy().tobytes() if dtype == "bfloat16" else payload.numpy().tobytes()
        return kv_blob.pack(raw, fingerprint, self.layers, self.kv_heads, self.head_dim, dtype, self.length,
                            tokens, meta)

    read_header = staticmethod(kv_blob.read_header)

    @classmethod
    def from_bytes(cls, blob: bytes, fingerprint: Optional[str] = None, layers: Optional[int] = None,
                   kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                   dtype=torch.float32, max_len: int = 2048, device=None) -> Tuple["SequenceKV", dict]:
        """Parse and validate a blob; expected values, when given, must match. The cache is made on
        `device` in `dtype`: the blob's values converted as torch's .to() does (bfloat16 / float16:
        round to nearest even)."""
        h, raw = kv_blob.unpack(blob, fingerprint=fingerprint, layers=layers, kv_heads=kv_heads,
                                head_dim=head_dim, max_len=max_len)
        shape = kv_blob.shape_of(h)
        if h["dtype"] == "bfloat16":
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(raw, dtype=h["dtype"]).copy())
        kv = cls(shape[0], shape[2], shape[4], dtype=dtype, max_len=max_len, capacity=max(64, shape[3]),
                 device=device)
        kv.append(t.reshape(shape).to(device=kv.data.device, dtype=dtype))
        return kv, h


def gather(seqs: Sequence[SequenceKV]) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Right-padded past for a ragged batch: per layer (k, v) [B, kv_heads, P, hd] and lengths [B]."""
    lengths = torch.tensor([s.length for s in seqs], dtype=torch.long, device=seqs[0].data.device)
    if len(seqs) == 1:
        return seqs[0].past(), lengths
    P = int(lengths.max())
    s0 = seqs[0]
    buf = torch.zeros(s0.layers, 2, len(seqs), s0.kv_heads, P, s0.head_dim, dtype=s0.dtype, device=s0.data.device)
    for b, s in enumerate(seqs):
        buf[:, :, b, :, : s.length] = s.data[:, :, :, : s.length]
    return [(buf[i, 0], buf[i, 1]) for i in range(s0.layers)], lengths


def scatter_new(seqs: Sequence[SequenceKV], present, P: int) -> None:
    """Append each row's new entries (present[..., P:, :]) to its own cache."""
    new = torch.stack([torch.stack((k[:, :, P:], v[:, :, P:])) for k, v in present])  # [L, 2, B, h, T, d]
    for b, s in enumerate(seqs):
        s.append(new[:, :, b])


class BatchCache:
    """The KV of one model call over T new tokens for each of B sequences, written in place.

    The cache object `Transformer.forward_cached` expects: each layer's new k/v go
    straight into every sequence's own preallocated tensor, and attention reads
    views of it -- no padded copy of a ragged batch, no copy of the past per layer.
    Lengths move only on `commit()`, so a call that fails leaves every sequence as
    it was (what it wrote past the length is dead space).
    """

    def __init__(self, seqs: Sequence[SequenceKV], T: int):
        for s in seqs:
            s.reserve(T)               # may reallocate: take views only after this
        self.seqs, self.T = list(seqs), T
        self.starts = [s.length for s in self.seqs]
        dev = self.seqs[0].data.device if self.seqs else None     # positions and masks beside the cache
        start = torch.tensor(self.starts, dtype=torch.long, device=dev)
        self.positions = start[:, None] + torch.arange(T, device=dev)[None, :]     # [B, T]
        # new query t sees keys 0 .. start+t (one query sees everything: no mask)
        self.masks = [None if T == 1 else (torch.arange(st + T, device=dev)[None, :]
                                           <= (st + torch.arange(T, device=dev))[:, None])
                      for st in self.starts]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, n_kv, T, hd]; per sequence (K, V, mask) over all its entries."""
        out = []
        for b, (s, st) in enumerate(zip(self.seqs, self.starts)):
            d = s.data[layer]                      # [2, n_kv, cap, hd]
            end = st + self.T
            d[0, :, st:end] = k[b]
            d[1, :, st:end] = v[b]
            out.append((d[0, :, :end][None], d[1, :, :end][None], self.masks[b]))
        return out

    def commit(self) -> None:
        for s in self.seqs:
            s.length += self.T
