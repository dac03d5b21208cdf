"""Weightless export graphs kept between runs, named by what determines them.

A traced layer (export/onnx_graph.trace: the model's structure) and an optimised graph
(optimize_graph: the bytes of the graph it is given) are functions of their input alone, for one
version of the code that makes them and of the tools (torch, onnx, onnxscript). Both cost seconds
-- onnxscript's optimiser takes ~15 s on a 30-layer graph -- so each is kept in memory and in
~/.cache/starsun/onnx-traces ($STARSUN_CACHE_DIR; STARSUN_NO_TRACE_CACHE=1 keeps memory only).
The files hold no weights: export/onnx.py writes those into every graph it exports.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple

_MEMORY: Dict[str, bytes] = {}


def graph_name(prefix: str, key: bytes, sources: Iterable[str]) -> str:
    """prefix-<hash of key, the tool versions and the source files that make the graph>."""
    import onnx
    import onnxscript
    import torch
    h = hashlib.sha256(key)
    for part in (torch.__version__, onnx.__version__, onnxscript.__version__):
        h.update(part.encode())
    for src in sources:
        h.update(Path(src).read_bytes())
    return f"{prefix}-{h.hexdigest()[:24]}"


def _file(name: str) -> Optional[Path]:
    if os.environ.get("STARSUN_NO_TRACE_CACHE"):
        return None
    root = Path(os.environ.get("STARSUN_CACHE_DIR") or Path.home() / ".cache" / "starsun")
    return root / "onnx-traces" / f"{name}.onnx"


def cached_graph(name: str, make: Callable[[], Tuple[bytes, bool]]) -> bytes:
    """The graph called `name` (graph_name): from memory, from disk, or made now -- make() ->
    (its bytes, whether to keep them) -- and kept."""
    if name in _MEMORY:
        return _MEMORY[name]
    path = _file(name)
    if path is not None and path.is_file():
        data = path.read_bytes()
    else:
        data, keep = make()
        if not keep:
            return data
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            except OSError as e:
                warnings.warn(f"could not keep the ONNX graph in {path.parent}: {e}")
    _MEMORY[name] = data
    return data
