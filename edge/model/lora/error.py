"""The one error of an adapter that is missing, malformed, or made for another base.

Torch-free, like edge/model/sun_error.py: a llama.cpp prefill role raises it without torch.
A subclass of SunError, so whatever handles a bad SUN artifact handles a bad adapter too."""
from edge.model.sun_error import SunError


class AdapterError(SunError):
    """A LoRA adapter that cannot be used as asked; the message says what is wrong and what to do."""
