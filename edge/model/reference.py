"""Where a model reference points: a path (GGUF, .onnx, HF / SUN / bundle directory) or a name of
edge.model.fetch.

The path half of resolving a model: edge/model/resolved.py's `resolve` calls it once where a
command first sees the reference (and makes the ResolvedModel everything below takes), so that a
name means the same file everywhere and a missing model always gets the same advice.
"""
from __future__ import annotations

from pathlib import Path

from edge.model.errors import EngineError


class ModelNotFound(EngineError):
    """No model at that reference: not a path that exists, or a known name not fetched yet."""


def resolve_model(ref) -> Path:
    """The path a reference names; an existing path wins over a model name of the same spelling."""
    from edge.model.fetch import MODELS, model_path

    p = Path(ref)
    if p.exists():
        return p
    if str(ref) in MODELS:
        p = model_path(str(ref))
        if not p.exists():
            raise ModelNotFound(f"model {str(ref)!r} is not fetched yet ({p} is missing): run `make models` "
                                f"(or `python -m edge.model.fetch {ref}`)")
        return p
    raise ModelNotFound(f"no such model file or directory: {ref}; give a GGUF file, a Hugging Face "
                        f"directory, a bundle or a model name ({', '.join(MODELS)}); "
                        "run `make models` to fetch the real models")
