"""A GGUF file's scalar metadata and tensor table, read without its arrays or weights.

The memory planner needs a model's dimensions and the bytes of each tensor as
llama.cpp holds them (the quantised blocks). gguf.GGUFReader builds a numpy
view per vocabulary string (~300k for Qwen), which costs seconds and hundreds of MB
for a question that needs a few hundred bytes; this reader skips arrays by
their lengths and keeps only scalars and array lengths.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Dict, List

# GGUFValueType -> struct code of a scalar (8 = string, 9 = array are read apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file, or one cut short."""


@dataclass
class TensorInfo:
    name: str
    shape: List[int]        # as GGUF lists them (innermost first)
    ggml_type: int
    n_elements: int
    n_bytes: int


@dataclass
class GGUFHeader:
    metadata: Dict[str, object]              # scalars; arrays as their length
    tensors: List[TensorInfo] = field(default_factory=list)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


def _read(f: BinaryIO, fmt: str):
    n = struct.calcsize("<" + fmt)
    b = f.read(n)
    if len(b) != n:
        raise GGUFHeaderError("GGUF header cut short")
    return struct.unpack("<" + fmt, b)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "Q")
    b = f.read(n)
    if len(b) != n:
        raise GGUFHeaderError("GGUF header cut short")
    return b.decode("utf-8", errors="replace")


def _skip_array(f: BinaryIO, item_type: int, count: int) -> None:
    if item_type == STRING:
        for _ in range(count):
            f.seek(_read(f, "Q"), 1)
    elif item_type in _SCALAR:
        f.seek(struct.calcsize("<" + _SCALAR[item_type]) * count, 1)
    else:
        raise GGUFHeaderError(f"GGUF array of type {item_type} is not supported")


def tensor_bytes(ggml_type: int, n_elements: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # block sizes: gguf's own table
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return n_elements // block * size


def read_gguf_header(path) -> GGUFHeader:
    p = Path(path)
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFHeaderError(f"{p} is not a GGUF file (no 'GGUF' magic)")
        version = _read(f, "I")
        if version < 2:
            raise GGUFHeaderError(f"{p}: GGUF version {version} is too old")
        n_tensors, n_kv = _read(f, "Q"), _read(f, "Q")
        meta: Dict[str, object] = {}
        for _ in range(n_kv):
            key, vtype = _string(f), _read(f, "I")
            if vtype == STRING:
                meta[key] = _string(f)
            elif vtype == ARRAY:
                item_type, count = _read(f, "I"), _read(f, "Q")
                _skip_array(f, item_type, count)
                meta[key] = count
            elif vtype in _SCALAR:
                meta[key] = _read(f, _SCALAR[vtype])
            else:
                raise GGUFHeaderError(f"{p}: metadata {key!r} has unknown type {vtype}")
        tensors = []
        for _ in range(n_tensors):
            name = _string(f)
            dims = [_read(f, "Q") for _ in range(_read(f, "I"))]
            gtype = _read(f, "I")
            _read(f, "Q")                                  # data offset
            n = 1
            for d in dims:
                n *= d
            tensors.append(TensorInfo(name, dims, gtype, n, tensor_bytes(gtype, n)))
    return GGUFHeader(meta, tensors)
