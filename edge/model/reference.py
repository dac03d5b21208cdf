"""What a model spec names: a path (GGUF, .onnx, HF / SUN / bundle directory) or a name of edge.model.fetch.

The one resolver every loader and command line uses, so that a name means the
same file everywhere and a missing model always gets the same advice.
"""
from __future__ import annotations

from pathlib import Path

from edge.model.errors import EngineError


class ModelNotFound(EngineError):
    """No model at that spec: not a path that exists, or a known name not fetched yet."""


def resolve_model(spec) -> Path:
    """The path a spec names; an existing path wins over a model name of the same spelling."""
    from edge.model.fetch import MODELS, model_path

    p = Path(spec)
    if p.exists():
        return p
    if str(spec) in MODELS:
        p = model_path(str(spec))
        if not p.exists():
            raise ModelNotFound(f"model {str(spec)!r} is not fetched yet ({p} is missing): run `make models` "
                                f"(or `python -m edge.model.fetch {spec}`)")
        return p
    raise ModelNotFound(f"no such model file or directory: {spec}; give a GGUF file, a Hugging Face "
                        f"directory, a bundle or a model name ({', '.join(MODELS)}); "
                        "run `make models` to fetch the real models")
