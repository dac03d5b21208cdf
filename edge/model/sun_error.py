"""The error of a SUN artifact that is missing, malformed, or made for another decoder.

Its own torch-free module: the SUN roles on llama.cpp / onnxruntime raise it without importing
edge.model.sun_modules (which needs torch for the tuned modules themselves)."""


class SunError(ValueError):
    """A SUN artifact that is missing, malformed, or made for another decoder."""
