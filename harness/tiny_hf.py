"""Tiny random llamas saved as Hugging Face directories (config.json, model.safetensors and a
byte-level BPE), for tests that start real `edge-hub` / `edge-agent` processes on a model path."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from edge.model.transformer import Transformer, tiny_config

VOCAB = 262          # 256 bytes, 3 merges, 3 specials


def tokenizer_dir(d: Path) -> None:
    """A byte-level BPE (256 bytes, 3 merges, 3 specials) as edge.model.tokenizer saves it."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF

    from edge.model.tokenizer import Tokenizer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"] + specials
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    hf = HF(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    Tokenizer(hf, bos_id=tokens.index("<|im_start|>"), eos_id=tokens.index("<|im_end|>")).save(d)


def hf_dir(d: Path, seed: int = 0, base: Optional[Transformer] = None, noise: float = 0.0):
    """A tiny random llama in `d`; with `base`, base + noise * random (a draft close to its target).
    Saved in float32; load it with dtype float64 for outputs that compare exactly. (dir, model)."""
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    m = Transformer(tiny_config(vocab_size=VOCAB)).eval()
    for i, p in enumerate(m.parameters()):
        p.data.normal_(0, 0.2)
        if base is not None:
            p.data = list(base.parameters())[i].data + noise * p.data
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(m.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(d / "model.safetensors"))
    tokenizer_dir(d)
    return d, m


def hf_pair(root: Path, noise: float = 0.05):
    """(target dir, draft dir): the draft is the target's weights plus `noise`."""
    target, base = hf_dir(root / "target", seed=5)
    return target, hf_dir(root / "draft", seed=6, base=base, noise=noise)[0]
