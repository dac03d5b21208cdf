"""Many LoRA adapters over one llama.cpp model: switched per decode call, grouped by adapter (no torch).

llama-cpp-python 0.3.36 exposes llama.cpp's adapter API as ctypes functions:
`llama_adapter_lora_init(model, path)` loads an adapter onto a *model* (its tensors live beside
the base's; the model frees them at the latest), and `llama_set_adapters_lora(ctx, adapters, n,
scales)` sets the whole list active on a *context* (n = 0 clears it; llama.cpp changes nothing
when the list is the one already set). The set applies to a whole `llama_decode` call, so rows
of different tasks cannot share one call: `step_by_adapter` groups the rows of a step by their
adapter and decodes each group under its own set. The KV cache is untouched by a switch, so a
sequence prefilled under a task's adapter decodes on the bare base (SUN: prefill-only adapters,
the frozen shared decoder).

Switching rebuilds llama.cpp's compute graph at the next decode (the adapters are part of it),
so a worker keeps the number of switches per step at the number of distinct tasks in it.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import numpy as np

from edge.engines.lora_gguf import AdapterError, AdapterInfo, base_shapes, check_pairs_fit, read_adapter

__all__ = ["LlamaCppAdapters", "AdapterError"]


class LlamaCppAdapters:
    """The adapters loaded on one LlamaCppEngine's model, and which one its context applies.

    engine: a LlamaCppEngine (its model and context are used; it still owns them: close the
    adapters first, or let the model free them when the engine closes)."""

    def __init__(self, engine):
        self.engine = engine
        if getattr(engine, "twin", None):    # --repack both: its unrepacked copy would prefill without them
            engine.twin.close()
            engine.twin = None
        self._lc = engine._lc            # the engine's llama_cpp module, model and context
        self._adapters: Dict[str, object] = {}
        self.info: Dict[str, AdapterInfo] = {}
        self.active: Optional[str] = None
        self.switches = 0                # calls that changed the set on the context
        self._base = None                # (arch, tensor shapes) of the base GGUF, read once

    @property
    def names(self) -> List[str]:
        return list(self._adapters)

    def load(self, name: str, path) -> AdapterInfo:
        """Load the GGUF LoRA at `path` as `name`, after checking it fits this engine's base."""
        if name in self._adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        info, pairs = read_adapter(path)
        if self._base is None:
            self._base = base_shapes(self.engine.path)
        check_pairs_fit(pairs, info.arch, self._base[0], self._base[1], f"adapter {path}")
        handle = self._lc.llama_adapter_lora_init(self.engine._model, str(path).encode())
        if not handle:
            raise AdapterError(f"llama.cpp refused the adapter {path} (its log says why); the engine keeps "
                               "serving its other adapters")
        self._adapters[name] = handle
        self.info[name] = info
        return info

    def unload(self, name: str) -> None:
        handle = self._get(name)
        if self.active == name:
            self.use(None)
        self._lc.llama_adapter_lora_free(handle)
        del self._adapters[name], self.info[name]

    def close(self) -> None:
        for name in list(self._adapters):
            self.unload(name)

    def _get(self, name: str):
        try:
            return self._adapters[name]
        except KeyError:
            raise AdapterError(f"no adapter {name!r} is loaded (loaded: {', '.join(self._adapters) or 'none'})") \
                from None

    def use(self, name: Optional[str], scale: float = 1.0) -> None:
        """Apply adapter `name` (None: none, the bare base) to every following decode call."""
        if name == self.active:
            return
        lc = self._lc
        if name is None:
            rc = lc.llama_set_adapters_lora(self.engine._ctx, None, 0, None)
        else:
            arr = (lc.llama_adapter_lora_p_ctypes * 1)(self._get(name))
            rc = lc.llama_set_adapters_lora(self.engine._ctx, arr, 1, (ctypes.c_float * 1)(scale))
        if rc != 0:
            raise AdapterError(f"llama.cpp could not set adapter {name!r} on the context (code {rc})")
        self.active = name
        self.switches += 1

    @contextmanager
    def using(self, name: Optional[str]):
        """Run a block under adapter `name`, then return to what was active."""
        before = self.active
        self.use(name)
        try:
            yield self
        finally:
            self.use(before)

    def prefill(self, seq: int, tokens: Sequence[int], adapter: Optional[str]) -> np.ndarray:
        """A prefill of `tokens` into `seq` under `adapter`: its last logits row [1, vocab].

        The adapter stays active afterwards, so the next row of the same task switches nothing
        (restoring the previous set here cost two switches per row). Decode on a context with no
        adapter set (the sibling decode context), or call use(None) first."""
        self.use(adapter)
        return self.engine.forward_last(seq, tokens)

    def step_by_adapter(self, seqs: Sequence[int], tokens: Sequence[int],
                        adapters: Sequence[Optional[str]]) -> np.ndarray:
        """One token for each sequence, row i under adapters[i]: one decode call per distinct
        adapter (in order of first appearance); rows come back in the order given."""
        if not (len(seqs) == len(tokens) == len(adapters)):
            raise AdapterError("seqs, tokens and adapters must have one entry per row")
        groups: Dict[Optional[str], List[int]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                self._get(a)             # an unknown task fails before any row runs
            groups.setdefault(a, []).append(i)
        out = np.empty((len(seqs), self.engine.vocab_size), dtype=np.float32)
        # the active adapter's group first: one switch fewer
        for a in sorted(groups, key=lambda g: g != self.active):
            rows = groups[a]
            self.use(a)
            out[rows] = self.engine.step([seqs[i] for i in rows], [tokens[i] for i in rows])
        return out
