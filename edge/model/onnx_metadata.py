"""An .onnx file's metadata_props, read without parsing its graph.

`onnx.load_model(path, load_external_data=False)` still parses every embedded
initialiser: for SmolLM2's fp32 graph (621 MiB) it peaked at 1.3 GB of RSS here,
above what the onnxruntime session itself needs (0.98 GB), only to read a
fingerprint. ModelProto is a protobuf message; its metadata_props are top-level
field 14 (StringStringEntryProto: key = 1, value = 2), so a scan of the top-level
fields that skips the others by their length reads them from a few KB.
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Dict

# metadata keys export/onnx.py writes into every graph (edge/engines/onnx_engine.py re-exports them)
META_GRAPH = "starsun.graph"            # "model" | "prefill" | "decoder"
META_CONFIG = "starsun.config"          # ModelConfig as JSON
META_FINGERPRINT = "starsun.fingerprint"
META_QUANT = "starsun.quant"            # "fp32" | "int4-q4_0-g32"
META_EXTRA = "starsun.extra"            # JSON: int4 details, ...

_METADATA_PROPS = 14
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class OnnxMetadataError(ValueError):
    """Not a readable ONNX ModelProto."""


def _varint(f: BinaryIO) -> int:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            raise EOFError
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise OnnxMetadataError("malformed varint")


def _entry(buf: bytes) -> tuple:
    """(key, value) of a StringStringEntryProto."""
    import io
    f, out = io.BytesIO(buf), {1: "", 2: ""}
    while f.tell() < len(buf):
        tag = _varint(f)
        if tag & 7 != _LEN:
            raise OnnxMetadataError("unexpected field in a metadata entry")
        out[tag >> 3] = f.read(_varint(f)).decode("utf-8", errors="replace")
    return out[1], out[2]


def read_onnx_metadata(path) -> Dict[str, str]:
    p = Path(path)
    size = p.stat().st_size
    meta: Dict[str, str] = {}
    with open(p, "rb") as f:
        try:
            while f.tell() < size:
                tag = _varint(f)
                field, wire = tag >> 3, tag & 7
                if wire == _VARINT:
                    _varint(f)
                elif wire == _I64:
                    f.seek(8, 1)
                elif wire == _I32:
                    f.seek(4, 1)
                elif wire == _LEN:
                    n = _varint(f)
                    if field == _METADATA_PROPS:
                        k, v = _entry(f.read(n))
                        meta[k] = v
                    else:
                        f.seek(n, 1)
                else:
                    raise OnnxMetadataError(f"{p}: wire type {wire} at the top level: not an ONNX model")
            cut = f.tell() != size            # a skipped field ran past the end of the file
        except EOFError:
            cut = True
    if cut:
        raise OnnxMetadataError(f"{p} is cut short: not a complete ONNX model")
    return meta
