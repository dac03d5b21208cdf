"""A model's shape for the memory planner: a ResolvedModel's `shape` (edge/model/shape.py reads
it from the files, the bundle's artifact picked where the model was resolved).

`read_shape` is the entry point of callers that hold a plain name or path (benchmarks, tests,
demos): it resolves it here, at their door. Nothing here imports torch.
"""
from __future__ import annotations

from typing import Optional

from edge.model.resolved import as_resolved
from edge.model.shape import ModelShape, params_from_dims, safetensors_bytes  # noqa: F401  (imported from here)


def read_shape(model, role: Optional[str] = None, backend: Optional[str] = None) -> ModelShape:
    """The shape of a ResolvedModel, or of what a model name or path names (a bundle's artifact
    for `role` on `backend`, None / auto: as the loader would pick it)."""
    return as_resolved(model, backend or "auto", role).shape
