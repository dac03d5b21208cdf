"""The KV blob format in numpy: how a sequence's KV cache travels between engines and devices.

    blob = MAGIC | u16 version | u32 header length | JSON header | raw KV | (crc32 in the header)

The raw KV is [layers, 2 (k/v), kv_heads, length, head_dim] in the header's dtype
(float16 by default). The format lives here, in numpy only, because the llama.cpp and
onnxruntime engines write and read blobs and must not import torch (~0.2 GB of RSS);
edge/model/kv.py's SequenceKV (the torch cache) frames its bytes with the same functions.
bfloat16 has no numpy dtype: it is float32's upper 16 bits, rounded to nearest even as
torch rounds it.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Optional, Sequence, Tuple

import numpy as np

MAGIC = b"SSKV"
VERSION = 1
ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8, "bfloat16": 2}


class KVError(ValueError):
    """A KV blob or cache operation that cannot be honoured."""


def check_dtype(dtype: str) -> None:
    if dtype not in ITEMSIZE:
        raise KVError(f"unsupported KV dtype {dtype!r}; use one of {sorted(ITEMSIZE)}")


def pack(raw: bytes, fingerprint: str, layers: int, kv_heads: int, head_dim: int, dtype: str, length: int,
         tokens: Optional[Sequence[int]] = None, meta: Optional[dict] = None) -> bytes:
    """A blob around raw KV bytes already in `dtype`."""
    check_dtype(dtype)
    head = {"fingerprint": fingerprint, "layers": layers, "kv_heads": kv_heads,
            "head_dim": head_dim, "dtype": dtype, "length": length,
            "tokens": list(map(int, tokens)) if tokens is not None else None,
            "meta": meta or {}, "crc32": zlib.crc32(raw)}
    hb = json.dumps(head, sort_keys=True).encode()
    return MAGIC + struct.pack("<HI", VERSION, len(hb)) + hb + raw


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
    except (ValueError, RecursionError) as e:     # RecursionError: "[[[[..." nested too deep
        raise KVError(f"corrupt KV blob header: {str(e)[:200] or type(e).__name__}") from None
    _check_header(head)
    head["_offset"] = 10 + hlen
    return head


_DIMS = ("layers", "kv_heads", "head_dim", "length")
MAX_DIM = 1 << 24            # far above any real model's layers, heads, head_dim or context


def _check_header(head) -> None:
    """Every field the readers use has the type they assume: a hostile header is a KVError,
    never a KeyError / TypeError deeper down."""
    if not isinstance(head, dict):
        raise KVError(f"corrupt KV blob header: a JSON object expected, got {type(head).__name__}")
    missing = [k for k in ("fingerprint", "dtype", "crc32", *_DIMS) if k not in head]
    if missing:
        raise KVError(f"corrupt KV blob header: missing {', '.join(missing)}")
    if not isinstance(head["fingerprint"], (str, type(None))) or not isinstance(head["dtype"], str):
        raise KVError("corrupt KV blob header: fingerprint and dtype must be strings")
    for k in _DIMS:
        v = head[k]
        if type(v) is not int or not 0 <= v <= MAX_DIM:
            raise KVError(f"corrupt KV blob header: {k} must be an integer in [0, {MAX_DIM}], got {str(v)[:40]}")
    if type(head["crc32"]) is not int:
        raise KVError("corrupt KV blob header: crc32 must be an integer")
    tokens = head.get("tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
        raise KVError("corrupt KV blob header: tokens must be null or a list of integers")
    if not isinstance(head.get("meta") or {}, dict):
        raise KVError("corrupt KV blob header: meta must be an object")


def unpack(blob: bytes, fingerprint: Optional[str] = None, layers: Optional[int] = None,
           kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           max_len: int = 2048) -> Tuple[dict, bytes]:
    """(header, raw payload) of a validated blob; expected values, when given, must match."""
    h = read_header(blob)
    if fingerprint is not None and h["fingerprint"] != fingerprint:
        raise KVError(f"KV blob was made for model {str(h['fingerprint'])[:16]}..., this model is "
                      f"{fingerprint[:16]}...; it cannot be admitted")
    for name, want in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if want is not None and h[name] != want:
            raise KVError(f"KV blob shape mismatch: {name}={h[name]}, this model has {want}")
    if h["dtype"] not in ITEMSIZE:
        raise KVError(f"KV blob has unsupported dtype {h['dtype']!r}")
    if h["length"] > max_len:
        raise KVError(f"KV blob holds {h['length']} tokens, more than the context of {max_len}")
    raw = blob[h["_offset"]:]
    want_bytes = math.prod(shape_of(h)) * ITEMSIZE[h["dtype"]]   # exact: np.prod wraps around
    if len(raw) != want_bytes:
        raise KVError(f"truncated or oversized KV blob: {len(raw)} payload bytes, expected {want_bytes}")
    if zlib.crc32(raw) != h["crc32"]:
        raise KVError("corrupt KV blob: checksum mismatch")
    return h, raw


def shape_of(h: dict) -> Tuple[int, int, int, int, int]:
    return (h["layers"], 2, h["kv_heads"], h["length"], h["head_dim"])


# -- numpy payloads (the engines that hold no torch tensors) ----------------------------------
def to_raw(data: np.ndarray, dtype: str) -> bytes:
    check_dtype(dtype)
    if dtype != "bfloat16":
        return np.ascontiguousarray(data, dtype=dtype).tobytes()
    u = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16          # round to nearest even
    nan = np.isnan(data)
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16).tobytes()  # NaN stays NaN


def from_raw(raw: bytes, dtype: str, shape) -> np.ndarray:
    """float32 [shape] from raw bytes in `dtype`."""
    if dtype == "bfloat16":
        u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).astype(np.float32).reshape(shape)


def encode(data: np.ndarray, fingerprint: str, dtype: str = "float16", tokens=None, meta=None) -> bytes:
    """A blob of float data [layers, 2, kv_heads, length, head_dim]."""
    layers, _, kv_heads, length, head_dim = data.shape
    return pack(to_raw(data, dtype), fingerprint, layers, kv_heads, head_dim, dtype, length, tokens, meta)


def decode(blob: bytes, **expect) -> Tuple[np.ndarray, dict]:
    """(float32 KV [layers, 2, kv_heads, length, head_dim], header) of a validated blob."""
    h, raw = unpack(blob, **expect)
    return from_raw(raw, h["dtype"], shape_of(h)), h
