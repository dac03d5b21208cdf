"""The one error type of opening or running a model.

It lives with the model files (not with the engines) so that resolving a model
spec can raise it without importing an engine; `edge.engines.base` re-exports it.
"""
from __future__ import annotations


class EngineError(RuntimeError):
    """A model that cannot be opened, or a request the engine cannot honour (unknown sequence, context full, ...)."""
