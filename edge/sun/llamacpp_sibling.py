"""A second llama.cpp context on a model another LlamaCppEngine already holds (no torch).

One model, two contexts: the prefill worker's engine owns the model (and the adapters loaded
onto it); the shared decoder runs on a `SiblingContext` of that same model -- its own KV cache,
its own batch, no adapter ever set on it (llama.cpp sets adapters per context). The weights are
in memory once. The sibling never frees the model: close it before its owner.
"""
from __future__ import annotations

import itertools
from typing import Optional

from edge.engines.llamacpp_engine import LlamaCppEngine
from edge.engines.llamacpp_load import KV_ITEMSIZE, layers_on_gpu, new_context


class SiblingContext(LlamaCppEngine):
    """A LlamaCppEngine whose model is `owner`'s (same fingerprint: the same weights)."""

    def __init__(self, owner: LlamaCppEngine, max_len: Optional[int] = None, n_seq_max: int = 8,
                 threads: Optional[int] = None, n_batch: int = 512, kv_type: str = "f16",
                 flash_attn: Optional[bool] = None):
        lc = self._lc = owner._lc
        self._owner = owner                   # kept alive while this context uses its model
        self._model, self.mmap, self.model_params = owner._model, owner.mmap, owner.model_params
        self.repack = owner.repack            # the weights (and their repacking) are the owner's
        self._ctx = self._batch = None
        self.path = owner.path
        if threads is None and getattr(owner, "_ctx", None):     # the owner's (--threads), not the library's
            threads = int(lc.llama_n_threads(owner._ctx))
        self._ctx = new_context(lc, self._model, owner.path, int(max_len or owner.max_len), n_seq_max, n_batch,
                                kv_type, flash_attn, threads)
        self.kv_itemsize = KV_ITEMSIZE[kv_type]
        self._mem = lc.llama_get_memory(self._ctx)
        self._n_batch = int(n_batch)
        self._batch = lc.llama_batch_init(self._n_batch, 0, 1)
        self.vocab_size = owner.vocab_size
        self.max_len = int(lc.llama_n_ctx_seq(self._ctx)) if hasattr(lc, "llama_n_ctx_seq") else int(max_len)
        self.n_seq_max = self.capacity = int(n_seq_max)
        self.fingerprint = owner.fingerprint
        for name in ("model_fingerprint", "artifact"):          # set by the loader on a bundle's engine
            if hasattr(owner, name):
                setattr(self, name, getattr(owner, name))
        self._free_slots = list(range(self.n_seq_max))
        self.gather, self.moves, self._copies_queued = True, 0, False
        self._slot, self._tokens, self._ids = {}, {}, itertools.count(1)
        self._read_shape()
        self._kv_layout = None
        self.n_gpu_layers = owner.n_gpu_layers
        self.gpu_layers = layers_on_gpu(lc, self.n_gpu_layers, self.cfg.num_layers)

    def where(self) -> str:
        return f"a second context on the prefill worker's model ({super().where()})"

    def close(self) -> None:
        """Free this context and its batch; the model stays its owner's."""
        self._free_context()
        self._model = None
