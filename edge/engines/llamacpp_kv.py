"""llama.cpp's per-sequence state bytes <-> our KV layout (pure functions, no llama.cpp calls).

`llama_state_seq_get_data` writes one sequence of the KV cache as:

  prefix (8 bytes in llama-cpp-python 0.3.36: a u32 tag, then the u32 seq id)
  u32 n_stream, then per stream: u32 cell_count, and when > 0
    cells:  per cell  i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
    data:   u32 v_trans, u32 n_layer
            K per layer: i32 ggml type, u64 row bytes, cell_count rows of n_kv_heads*head_dim
            V per layer: same as K when v_trans == 0; when 1 (no flash attention):
                         i32 type, u32 element bytes, u32 n_embd_v, then per channel cell_count values

Our layout (edge/model/kv.py) is float [layers, 2 (K, V), kv_heads, length, head_dim] with
K in Hugging Face's rotate-half RoPE order. llama.cpp's llama architecture runs
interleaved RoPE on q/k weights permuted at conversion (convert_hf_to_gguf, and
export/gguf.py), so its cached K holds each head's dims permuted the same way:
gguf dim 2i+j == HF dim j*head_dim/2 + i. qwen2 is not permuted (NEOX RoPE).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Tuple

import numpy as np

GGML_TYPES = {0: np.float32, 1: np.float16}   # the KV cache types this transfer handles
PERMUTED_ARCHS = {"llama"}
KV_ARCHS = {"llama", "qwen2"}


class StateError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    """What a context writes: learned from one of its own sequences (see LlamaCppEngine)."""
    tag: bytes            # the 4 bytes before the seq id
    n_stream: int
    v_trans: bool
    k_type: int
    v_type: int


class _Reader:
    def __init__(self, raw: bytes):
        self.raw, self.at = memoryview(raw), 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.raw):
            raise StateError(f"llama.cpp state ends early: need {n} bytes at offset {self.at} of {len(self.raw)}")
        out = self.raw[self.at: self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def i32(self) -> int:
        return struct.unpack("<i", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def array(self, n: int, ggml_type: int) -> np.ndarray:
        dt = _dtype(ggml_type)
        return np.frombuffer(self.take(n * np.dtype(dt).itemsize), dtype=dt)


def _dtype(ggml_type: int):
    try:
        return GGML_TYPES[ggml_type]
    except KeyError:
        raise StateError(f"llama.cpp KV cache type {ggml_type} is not F32/F16; KV transfer needs "
                         "an unquantised cache (the default, F16)") from None


def permute_k(k: np.ndarray, to_hf: bool) -> np.ndarray:
    """Reorder the last (head_dim) axis between llama.cpp's interleaved and HF's rotate-half RoPE."""
    hd = k.shape[-1]
    if to_hf:
        return k.reshape(*k.shape[:-1], hd // 2, 2).swapaxes(-1, -2).reshape(k.shape)
    return k.reshape(*k.shape[:-1], 2, hd // 2).swapaxes(-1, -2).reshape(k.shape)


def parse_state(raw: bytes, layers: int, kv_heads: int, head_dim: int,
                permuted: bool) -> Tuple[np.ndarray, Layout]:
    """One sequence's state -> (float32 [layers, 2, kv_heads, n, head_dim], the layout it used)."""
    r = _Reader(raw)
    tag = bytes(r.take(4))
    r.u32()                                      # the seq id it was saved from
    n_stream = r.u32()
    found = None
    for _ in range(n_stream):
        n = r.u32()
        if n == 0:
            continue
        if found is not None:
            raise StateError("llama.cpp state holds cells in two streams; expected one sequence")
        pos = []
        for _ in range(n):
            pos.append(r.i32())
            r.take(4 * r.u32())                  # the seq ids
        if pos != list(range(n)):
            raise StateError(f"llama.cpp sequence positions are not 0..{n - 1}; cannot export it")
        found = _parse_data(r, n, layers, kv_heads, head_dim, permuted)
    if r.at != len(raw):
        raise StateError(f"llama.cpp state has {len(raw) - r.at} unexpected trailing bytes")
    if found is None:
        return np.zeros((layers, 2, kv_heads, 0, head_dim), np.float32), Layout(tag, n_stream, False, 1, 1)
    kv, v_trans, k_type, v_type = found
    return kv, Layout(tag, n_stream, v_trans, k_type, v_type)


def _parse_data(r: _Reader, n: int, layers: int, kv_heads: int, hd: int, permuted: bool):
    v_trans = r.u32()
    if r.u32() != layers:
        raise StateError(f"llama.cpp state layer count differs from the model's {layers}")
    width = kv_heads * hd
    out = np.empty((layers, 2, kv_heads, n, hd), np.float32)
    k_type = v_type = None
    for i in range(layers):
        k_type = r.i32()
        row = r.u64()
        if row != width * np.dtype(_dtype(k_type)).itemsize:
            raise StateError(f"llama.cpp K rows are {row} bytes; the model needs {width} values per row")
        k = r.array(n * width, k_type).reshape(n, kv_heads, hd).transpose(1, 0, 2)
        out[i, 0] = permute_k(k, to_hf=True) if permuted else k
    for i in range(layers):
        v_type = r.i32()
        if v_trans:
            r.u32()                              # element bytes (implied by the type)
            if r.u32() != width:
                raise StateError(f"llama.cpp V width differs from the model's {width}")
            out[i, 1] = r.array(width * n, v_type).reshape(kv_heads, hd, n).transpose(0, 2, 1)
        else:
            r.u64()
            out[i, 1] = r.array(n * width, v_type).reshape(n, kv_heads, hd).transpose(1, 0, 2)
    return out, bool(v_trans), k_type, v_type


def build_state(kv: np.ndarray, layout: Layout, slot: int, permuted: bool) -> bytes:
    """Our [layers, 2, kv_heads, n, head_dim] -> the bytes llama_state_seq_set_data reads into `slot`."""
    layers, _, kv_heads, n, hd = kv.shape
    width = kv_heads * hd
    kt, vt = _dtype(layout.k_type), _dtype(layout.v_type)
    parts = [layout.tag, struct.pack("<II", slot, layout.n_stream)]
    for s in range(layout.n_stream):
        if s != slot or n == 0:
            parts.append(struct.pack("<I", 0))
            continue
        parts.append(struct.pack("<I", n))
        parts.append(np.array([[p, 1, slot] for p in range(n)], dtype="<i4").tobytes())
        parts.append(struct.pack("<II", int(layout.v_trans), layers))
        for i in range(layers):
            k = permute_k(kv[i, 0], to_hf=False) if permuted else kv[i, 0]
            parts.append(struct.pack("<iQ", layout.k_type, width * np.dtype(kt).itemsize))
            parts.append(np.ascontiguousarray(k.transpose(1, 0, 2), dtype=kt).tobytes())
        for i in range(layers):
            v = kv[i, 1]                              # [kv_heads, n, hd]
            if layout.v_trans:
                parts.append(struct.pack("<iII", layout.v_type, np.dtype(vt).itemsize, width))
                parts.append(np.ascontiguousarray(v.transpose(0, 2, 1), dtype=vt).tobytes())
            else:
                parts.append(struct.pack("<iQ", layout.v_type, width * np.dtype(vt).itemsize))
                parts.append(np.ascontiguousarray(v.transpose(1, 0, 2), dtype=vt).tobytes())
    return b"".join(parts)



HEAD = 12        # the 4-byte tag, the u32 seq id, the u32 stream count

# A context without a unified cache writes a sequence's state with a stream per sequence, each empty
# (a u32 0) but the sequence's own. Between two contexts of one model (edge/engines/llamacpp_twin.py)
# the one stream with cells moves whole; these rewrite the frame around it in place, no copy.


def to_one_stream(buf, n: int, slot: int) -> Tuple[int, int]:
    """buf[:n]: a state of `slot` of several streams -> (offset, length) of the same state as a
    one-stream context reads it, its header rewritten in buf just before the sequence's stream."""
    view = memoryview(buf)
    tag, _, n_stream = struct.unpack_from("<4sII", view, 0)
    at = HEAD + 4 * slot
    tail = 4 * (n_stream - 1 - slot)
    if not 0 <= slot < n_stream or n < at + 4 + tail or any(view[HEAD:at]) or any(view[n - tail:n]):
        raise StateError(f"llama.cpp state of slot {slot} holds cells outside its own stream")
    struct.pack_into("<4sII", view, at - HEAD, tag, 0, 1)
    return at - HEAD, n - tail - (at - HEAD)


def from_one_stream(buf, m: int, slot: int, n_stream: int) -> int:
    """buf[4*slot : 4*slot + m]: a one-stream state -> the state of `slot` of n_stream streams,
    rewritten in place from buf[0]; its length. buf must hold 4*(n_stream - 1) bytes more than m."""
    view = memoryview(buf)
    at = 4 * slot
    tag, _, one = struct.unpack_from("<4sII", view, at)
    if one != 1 or not 0 <= slot < n_stream or len(view) < m + 4 * (n_stream - 1):
        raise StateError(f"expected a one-stream state to move into slot {slot} of {n_stream}")
    end = at + m
    view[end:end + 4 * (n_stream - 1 - slot)] = bytes(4 * (n_stream - 1 - slot))
    view[HEAD:HEAD + at] = bytes(at)
    struct.pack_into("<4sII", view, 0, tag, slot, n_stream)
    return m + 4 * (n_stream - 1)
