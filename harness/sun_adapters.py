"""Prefill-only LoRA adapters of a tiny random base for the adapter-serving tests, and the
in-process reference they are held to: prefill under that task's adapter, decode on the base."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from edge.model.lora.adapter import ALL_TARGETS, base_fingerprint, init_adapter
from edge.model.lora.apply import LoraTransformer
from edge.model.lora.files import WEIGHTS_FILE, adapter_sha256, load_adapter, save_adapter
from edge.model.sun_modules import split_generate


def trained_adapter(base, root, task, seed, rank=4, targets=ALL_TARGETS, record_base=True):
    """A PEFT adapter directory as a tuning leaves one (B off zero), for `base`: (dir, sha256 of its
    weights file)."""
    ad = init_adapter(base.cfg, rank, 2.0 * rank, targets, seed=seed, dtype=torch.float64,
                      base_fingerprint=base_fingerprint(base) if record_base else "")
    g = torch.Generator().manual_seed(seed + 100)
    for t in ad.lora_b.values():
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.3)
    d = save_adapter(Path(root) / task, ad)
    return d, adapter_sha256(d)[WEIGHTS_FILE]


def edit_config(directory, **changes):
    """Change keys of an adapter's adapter_config.json (its weights, and their sha256, unchanged)."""
    p = Path(directory) / "adapter_config.json"
    conf = json.loads(p.read_text())
    conf.update(changes)
    p.write_text(json.dumps(conf))


class Reference:
    """greedy SUN output in process: a LoraTransformer view of the base per task, the base decodes."""

    def __init__(self, base, dirs):
        self.base, self.view = base, LoraTransformer.over(base)
        for task, d in dirs.items():
            self.view.add_adapter(task, load_adapter(d, base.cfg))

    def expect(self, task, prompt, max_new):
        with torch.no_grad(), self.view.rows(task):
            return split_generate(self.view, self.base, [prompt], max_new=max_new)[0]
