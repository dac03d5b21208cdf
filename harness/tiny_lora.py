"""LoRA adapters for the adapter tests, written by PEFT itself (the format under test), with the
torch reference PEFT computes: the adapter merged into a copy of the base weights."""
import copy

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(model, out_dir, r=4, alpha=8, targets=ALL_TARGETS, seed=0, std=0.1, **config):
    """Save a random PEFT LoRA of `model` (left untouched) to out_dir; returns the merged reference
    model (W + scale B A in every adapted module, PEFT's own merge_and_unload on a copy)."""
    from peft import LoraConfig, get_peft_model
    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                              init_lora_weights=False, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    wrapped.save_pretrained(str(out_dir))
    return wrapped.merge_and_unload().eval()
