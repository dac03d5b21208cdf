"""What a checkpoint on disk is, without loading its weights: its fingerprint, its kind, its
conversion-cache directory and its tokenizer.

These live apart from edge/model/checkpoint.py (which dequantises weights into torch tensors) so
that the llama.cpp and onnxruntime paths, which never hold torch tensors, do not import
torch: importing it costs ~0.2 GB of RSS on its own (214 MiB measured, torch 2.13 CPU) (docs/models.md, "Memory facts").

Weight fingerprint (`file_fingerprint`): sha256 over the file size and 16 evenly spaced
1 MiB samples of the file (first and last included) -- cheap (~16 MiB read), and it
changes with any re-quantisation or header change. It names weights; it is not an
integrity check (fetch.py checks the full sha256).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .tokenizer import Tokenizer, TokenizerError, open_gguf


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message says what to do."""


_SAMPLES, _CHUNK = 16, 1 << 20


def file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(f"starsun-weights-v1:{size}:".encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _CHUNK) * i // (_SAMPLES - 1)))
            h.update(f.read(_CHUNK))
    return h.hexdigest()


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf_checked(path: Path):
    """gguf.GGUFReader of a file, or a CheckpointError that says what to do."""
    try:
        return open_gguf(path)
    except Exception as e:  # truncated / corrupt: numpy or ValueError from deep inside
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                              "it may be truncated or corrupt -- delete it and run `make models`"
                              ) from e


def cache_dir(path: Path, fingerprint: str) -> Path:
    """Where edge/model/checkpoint.py keeps a GGUF's dequantised copy (an HF directory)."""
    root = Path(os.environ.get("STARSUN_CACHE_DIR") or path.parent / ".cache")
    return root / f"{path.stem}-{fingerprint[:16]}"


def resolve_checkpoint(path) -> Path:
    """The path a model reference names (edge.model.reference), its errors as CheckpointError;
    config.json -> its dir. A ResolvedModel (edge/model/resolved.py) is resolved already: its path."""
    from .reference import ModelNotFound, resolve_model
    from .resolved import ResolvedModel
    if isinstance(path, ResolvedModel):
        return path.path
    try:
        p = resolve_model(path)
    except ModelNotFound as e:          # this module's callers catch CheckpointError
        raise CheckpointError(str(e)) from None
    if p.is_file() and p.name == "config.json":
        p = p.parent
    return p


def load_tokenizer(path) -> Tokenizer:
    """Only the tokenizer (e.g. to compare fingerprints): from the conversion cache when a
    GGUF was loaded before (fast), else from the GGUF metadata or the HF directory."""
    p = resolve_checkpoint(path)
    try:
        if p.is_dir():
            return Tokenizer.from_hf_dir(p)
        if not is_gguf(p):
            raise CheckpointError(f"{p} is neither a GGUF file nor a Hugging Face directory")
        cached = cache_dir(p, file_fingerprint(p))
        if (cached / "tokenizer.json").is_file():
            try:
                return Tokenizer.from_hf_dir(cached)
            except TokenizerError:
                pass  # a broken cache: read the GGUF itself
        return Tokenizer.from_gguf(open_gguf_checked(p))
    except TokenizerError as e:
        raise CheckpointError(f"{p}: {e}") from e
