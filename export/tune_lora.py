"""Prefill-only LoRA tuning (`edge-export tune --adapter lora`): the trainee and its directory.

The trainee is the prefill module tuning differentiates: the FROZEN base (a LoraTransformer
over its tensors -- with an fp decoder, the decoder's own tensors, so no second copy) plus one
adapter whose A and B are the trainee's only parameters. It is called like a Transformer, so
export/tune.py's split loss, optimiser, checkpoints and evaluation work on it unchanged, and
gradients can reach nothing but the adapter.

The result is an adapter directory: PEFT's two files (edge/model/lora/files.py) plus a
manifest.json entry naming the decoder it was tuned for, the base's fingerprint and the files'
sha256 -- megabytes, where a full-copy specialist is a model.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from edge.model.lora.adapter import LoraAdapter, base_fingerprint, init_adapter
from edge.model.lora.apply import LoraTransformer
from edge.model.lora.error import AdapterError
from edge.model.lora.files import adapter_sha256, save_adapter
from edge.model.sun_modules import MANIFEST
from edge.model.transformer import Transformer


def _param_name(path: str, which: str) -> str:
    return f"{path.replace('.', '__')}__lora_{which}"        # module parameters cannot hold dots


class LoraTrainee(nn.Module):
    """A frozen base + one trainable adapter, called like a Transformer (every row uses the adapter)."""

    TASK = "tuned"

    def __init__(self, view: LoraTransformer, adapter: LoraAdapter):
        super().__init__()
        self.__dict__["view"] = view        # not a submodule: its frozen weights are not ours to train or save
        for path in sorted(adapter.lora_a):
            adapter.lora_a[path] = nn.Parameter(adapter.lora_a[path])
            adapter.lora_b[path] = nn.Parameter(adapter.lora_b[path])
            self.register_parameter(_param_name(path, "A"), adapter.lora_a[path])
            self.register_parameter(_param_name(path, "B"), adapter.lora_b[path])
        self.adapter = view.add_adapter(self.TASK, adapter)
        assert all(x is y for x, y in zip(self.adapter.parameters(), adapter.parameters())), \
            "the view must hold the trainee's own tensors (same dtype and device)"

    @property
    def cfg(self):
        return self.view.cfg

    def forward(self, *args, **kwargs):
        with self.view.rows(self.TASK):
            return self.view(*args, **kwargs)

    def output_weight(self) -> torch.Tensor:
        return self.view.output_weight()

    def frozen_adapter(self) -> LoraAdapter:
        """The adapter's current values, detached (what gets saved)."""
        ad = self.adapter
        return replace(ad, lora_a={k: v.detach().clone() for k, v in ad.lora_a.items()},
                       lora_b={k: v.detach().clone() for k, v in ad.lora_b.items()})


def make_trainee(prefill_base: Transformer, rank: int, alpha: float, targets, seed: int,
                 init: Optional[LoraAdapter] = None) -> LoraTrainee:
    """A trainee over `prefill_base` (fp weights, on the tuning device): PEFT's seeded init, or a
    copy of `init` (e.g. the SUN adapter when re-tuning for an int4 decoder)."""
    w = prefill_base.model.embed_tokens.weight
    fp = base_fingerprint(prefill_base)
    if init is None:
        ad = init_adapter(prefill_base.cfg, rank, alpha, targets, seed=seed, dtype=w.dtype, device=w.device,
                          base_fingerprint=fp)
    else:
        if (init.rank, tuple(init.targets)) != (rank, tuple(targets)):
            raise AdapterError(f"--init adapter has rank {init.rank} and targets {','.join(init.targets)}; "
                               f"tune with the same --rank and --targets, or start without --init")
        if init.base_fingerprint and init.base_fingerprint != fp:
            raise AdapterError("--init adapter was made for another base; give the base it was tuned on")
        init.check(prefill_base.cfg)
        ad = replace(init.to(dtype=w.dtype, device=w.device), base_fingerprint=fp)
        ad = replace(ad, lora_a={k: v.detach().clone() for k, v in ad.lora_a.items()},
                     lora_b={k: v.detach().clone() for k, v in ad.lora_b.items()})
    return LoraTrainee(LoraTransformer.over(prefill_base), ad)


def save_lora_specialist(out_dir, trainee: LoraTrainee, cfg, dec_fp: str, history: list, extra: dict) -> Path:
    """PEFT's adapter files + manifest.json (kind sun-lora / qsun-lora) in out_dir."""
    ad = trainee.frozen_adapter()
    d = save_adapter(out_dir, ad, base_model=str(extra.get("base", "")))
    man = {"kind": "qsun-lora" if cfg.decoder == "int4" else "sun-lora", "decoder_fingerprint": dec_fp,
           "decoder_precision": cfg.decoder, "base_fingerprint": ad.base_fingerprint,
           "adapter": {"format": "peft-lora", "rank": ad.rank, "alpha": ad.alpha, "targets": list(ad.targets),
                       "bytes": ad.nbytes, "sha256": adapter_sha256(d)},
           "config": json.loads(trainee.cfg.to_json()), "tune": asdict(cfg), "history_tail": history[-5:], **extra}
    (d / MANIFEST).write_text(json.dumps(man, indent=1, sort_keys=True))
    return d
