"""Per-sequence KV cache: preallocated, a length pointer, rollback, ragged batching, bytes.

A sequence's cache is one tensor [layers, 2 (k/v), kv_heads, capacity, head_dim]
plus `length`. Rollback after a rejected draft is `truncate(n)`: it only moves
the pointer. Capacity grows by doubling (amortised O(1) per token) up to the
model's context. Many sequences of different lengths are batched by padding
their caches to the longest one (`gather`), which is what lets one draft or
one shared decoder step many clients with one read of the weights.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

MAGIC = b"SSKV"
VERSION = 1
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16}


class KVError(ValueError):
    """A KV blob or cache operation that cannot be honoured."""


class SequenceKV:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 max_len: int = 2048, capacity: int = 64):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.length = 0
        self.data = torch.zeros(layers, 2, kv_heads, min(capacity, max_len), head_dim, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def reserve(self, n: int) -> None:
        """Make room for n more tokens (doubling), or fail if past max_len."""
        need = self.length + n
        if need > self.max_len:
            raise KVError(f"KV cache full: {self.length} + {n} tokens exceeds the context of {self.max_len}")
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_len)
        grown = torch.zeros(*self.data.shape[:3], cap, self.head_dim, dtype=self.dtype)
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

    # -- bytes -------------------------------------------------------------------
    def to_bytes(self, fingerprint: str, dtype: str = "float16", tokens: Optional[Sequence[int]] = None,
                 meta: Optional[dict] = None) -> bytes:
        """Header (JSON) + raw KV in `dtype` (fp16 default) + crc32 of the payload."""
        if dtype not in _DTYPES:
            raise KVError(f"unsupported KV dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        payload = self.data[:, :, :, : self.length].to(_DTYPES[dtype]).contiguous()
        raw = payload.view(torch.uint8).numpy().tobytes() if dtype == "bfloat16" else payload.numpy().tobytes()
        head = {"fingerprint": fingerprint, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": dtype, "length": self.length,
                "tokens": list(map(int, tokens)) if tokens is not None else None,
                "meta": meta or {}, "crc32": zlib.crc32(raw)}
        hb = json.dumps(head, sort_keys=True).encode()
        return MAGIC + struct.pack("<HI", VERSION, len(hb)) + hb + raw

    @staticmethod
    def read_header(blob: bytes) -> dict:
        if len(blob) < 10 or blob[:4] != MAGIC:
            raise KVError("not a StarSun KV blob (bad magic)")
        version, hlen = struct.unpack("<HI", blob[4:10])
        if version != VERSION:
            raise KVError(f"KV blob version {version} is not supported (expected {VERSION})")
        if len(blob) < 10 + hlen:
            raise KVError("truncated KV blob (header cut short)")
        try:
            head = json.loads(blob[10: 10 + hlen])
        except ValueError as e:
            raise KVError(f"corrupt KV blob header: {e}") from None
        head["_offset"] = 10 + hlen
        return head

    @classmethod
    def from_bytes(cls, blob: bytes, fingerprint: Optional[str] = None, layers: Optional[int] = None,
                   kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                   dtype=torch.float32, max_len: int = 2048) -> Tuple["SequenceKV", dict]:
        """Parse and validate a blob; expected values, when given, must match."""
        h = cls.read_header(blob)
        if fingerprint is not None and h["fingerprint"] != fingerprint:
            raise KVError(f"KV blob was made for model {h['fingerprint'][:16]}..., this model is "
                          f"{fingerprint[:16]}...; it cannot be admitted")
        for name, want in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if want is not None and h[name] != want:
                raise KVError(f"KV blob shape mismatch: {name}={h[name]}, this model has {want}")
        if h["dtype"] not in _DTYPES:
            raise KVError(f"KV blob has unsupported dtype {h['dtype']!r}")
        if h["length"] > max_len:
            raise KVError(f"KV blob holds {h['length']} tokens, more than the context of {max_len}")
        shape = (h["layers"], 2, h["kv_heads"], h["length"], h["head_dim"])
        raw = blob[h["_offset"]:]
        itemsize = torch.tensor([], dtype=_DTYPES[h["dtype"]]).element_size()
        if len(raw) != int(np.prod(shape)) * itemsize:
            raise KVError(f"truncated or oversized KV blob: {len(raw)} payload bytes, "
                          f"expected {int(np.prod(shape)) * itemsize}")
        if zlib.crc32(raw) != h["crc32"]:
            raise KVError("corrupt KV blob: checksum mismatch")
        if h["dtype"] == "bfloat16":
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(raw, dtype=h["dtype"]).copy())
        kv = cls(shape[0], shape[2], shape[4], dtype=dtype, max_len=max_len, capacity=max(64, shape[3]))
        kv.append(t.reshape(shape).to(dtype))
        return kv, h


def gather(seqs: Sequence[SequenceKV]) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Right-padded past for a ragged batch: per layer (k, v) [B, kv_heads, P, hd] and lengths [B]."""
    lengths = torch.tensor([s.length for s in seqs], dtype=torch.long)
    if len(seqs) == 1:
        return seqs[0].past(), lengths
    P = int(lengths.max())
    s0 = seqs[0]
    buf = torch.zeros(s0.layers, 2, len(seqs), s0.kv_heads, P, s0.head_dim, dtype=s0.dtype)
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
        start = torch.tensor(self.starts, dtype=torch.long)
        self.positions = start[:, None] + torch.arange(T)[None, :]     # [B, T]
        # new query t sees keys 0 .. start+t (one query sees everything: no mask)
        self.masks = [None if T == 1 else torch.arange(st + T)[None, :] <= (st + torch.arange(T))[:, None]
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
