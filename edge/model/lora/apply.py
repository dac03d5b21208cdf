"""The prefill context: the base's weights (shared, never written) plus adapters applied per row.

`LoraTransformer.over(base)` is a second Transformer built around the SAME weight tensors as
`base` (no copy, no merge): its targeted linears compute y = W x + scale_a * B_a (A_a x) for
the rows of adapter a and plain W x for the rest, so one batch can mix tasks. The rows are
grouped by adapter (one pair of small matmuls per adapter present, per linear), as Punica /
S-LoRA gather many LoRAs into one batch. The base object itself -- the shared decoder -- is
untouched: no hooks, no merged weights, so it never applies an adapter.

    view = LoraTransformer.over(base)
    view.add_adapter("maths", load_adapter(path, base.cfg))
    first_logits, kv, lengths = lora_prefill(view, prompts, lengths, ["maths", None, "code"])
    # the decoder (base) continues from kv exactly as after edge.model.sun_modules.prefill_batch

Only `forward` (the functional path prefill_batch and tuning use) applies adapters;
`forward_cached` refuses, because its fast linears read the weights directly. One view
serves one thread at a time (`rows` sets its state); views are cheap, make one per thread.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from edge.model.lora.adapter import LoraAdapter, target_shapes
from edge.model.lora.error import AdapterError
from edge.model.sun_modules import prefill_batch
from edge.model.transformer import Transformer

Tasks = Union[None, str, Sequence[Optional[str]]]


class _Rows:
    """Which adapter each batch row uses in the call under way: (adapter, row indices or None = all)."""

    def __init__(self):
        self.groups: List[Tuple[LoraAdapter, Optional[torch.Tensor]]] = []
        self.batch: Optional[int] = None          # rows the call must have (None: any)


class LoraLinear(nn.Module):
    """A base linear (its own weight and bias tensors) plus the LoRA deltas of the current rows."""

    def __init__(self, base: nn.Linear, path: str, rows: _Rows):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.path, self.rows = path, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)        # what nn.Linear computes, bit for bit
        for ad, idx in self.rows.groups:
            a = ad.lora_a.get(self.path)
            if a is None:                              # this adapter does not target this linear
                continue
            b = ad.lora_b[self.path]
            if idx is None:
                y = y + F.linear(F.linear(x, a), b) * ad.scale
            else:
                y = y.index_add(0, idx, F.linear(F.linear(x.index_select(0, idx), a), b) * ad.scale)
        return y


class LoraTransformer(Transformer):
    """A Transformer over a base's weight tensors whose targeted linears apply adapters per row."""

    @classmethod
    def over(cls, base: Transformer) -> "LoraTransformer":
        """The prefill context of `base`: same tensors (no copy), frozen, every target linear wrapped."""
        view = cls.from_state_dict(base.cfg, base.state_dict())
        view.register_buffer("inv_freq", base.inv_freq, persistent=False)
        for p in view.parameters():
            p.requires_grad_(False)                    # the base is frozen: only adapters train
        view._rows = _Rows()
        view._adapters = {}
        for path in target_shapes(base.cfg):
            parent_path, name = path.rsplit(".", 1)
            parent = view.get_submodule(parent_path)
            setattr(parent, name, LoraLinear(getattr(parent, name), path, view._rows))
        return view

    @property
    def adapter_names(self) -> List[str]:
        return sorted(self._adapters)

    def adapter(self, name: str) -> LoraAdapter:
        if name not in self._adapters:
            raise AdapterError(f"no adapter {name!r} is loaded here (loaded: {', '.join(self.adapter_names) or 'none'})")
        return self._adapters[name]

    def add_adapter(self, name: str, adapter: LoraAdapter) -> LoraAdapter:
        """Hold `adapter` under `name` (replacing one of that name), cast to the base's dtype and
        device; tensors already there are kept as they are (tuning trains them in place)."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"an adapter needs a non-empty name, got {name!r}")
        adapter.check(self.cfg)
        w = self.model.embed_tokens.weight
        self._adapters[name] = adapter.to(dtype=w.dtype, device=w.device)
        return self._adapters[name]

    def remove_adapter(self, name: str) -> LoraAdapter:
        self.adapter(name)                             # an unknown name: a clear error
        return self._adapters.pop(name)

    @contextmanager
    def rows(self, tasks: Tasks):
        """Within the block, forward applies adapter tasks[b] to row b (None: the base alone).
        A single name (or None) applies to every row of any batch."""
        state = self._rows
        saved = (state.groups, state.batch)
        if tasks is None or isinstance(tasks, str):
            state.groups, state.batch = ([] if tasks is None else [(self.adapter(tasks), None)]), None
        else:
            tasks = list(tasks)
            dev = self.model.embed_tokens.weight.device
            by_name: Dict[str, List[int]] = {}
            for b, t in enumerate(tasks):
                if t is not None:
                    by_name.setdefault(t, []).append(b)
            state.groups = [(self.adapter(t), torch.tensor(r, dtype=torch.long, device=dev))
                            for t, r in sorted(by_name.items())]
            state.batch = len(tasks)
        try:
            yield self
        finally:
            state.groups, state.batch = saved

    def forward(self, tokens: torch.Tensor, *args, **kwargs):
        """Transformer.forward with the rows' adapters (see `rows`)."""
        if self._rows.batch is not None and tokens.shape[0] != self._rows.batch:
            raise AdapterError(f"the batch has {tokens.shape[0]} rows but {self._rows.batch} tasks were given")
        return super().forward(tokens, *args, **kwargs)

    def forward_cached(self, *args, **kwargs):
        raise NotImplementedError("adapters apply on Transformer.forward only (forward_cached's fast linears read "
                                  "the weights directly); use lora_prefill, or the base for decoding")


def lora_prefill(view: LoraTransformer, prompts: torch.Tensor, lengths: torch.Tensor, tasks: Tasks):
    """prefill_batch (edge/model/sun_modules.py) with row b's adapter tasks[b] (None: the base).

    Right-padded prompts [B, T] -> (first-token logits [B, V], KV per layer (k, v)
    [B, n_kv, T, hd], lengths): the shared decoder continues from that KV as from the base's."""
    with view.rows(tasks):
        return prefill_batch(view, prompts, lengths)
