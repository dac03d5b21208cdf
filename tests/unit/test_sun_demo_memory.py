"""The SUN demo's memory line: a specialist's full copy is its saved module's bytes, its adapter
what a saved LoRA adapter of that rank holds."""
from pathlib import Path

import torch

from edge.model.lora.adapter import init_adapter
from edge.model.lora.files import save_adapter
from edge.memory.model_shape import safetensors_bytes
from edge.model.sun_modules import save_module
from edge.model.transformer import ModelConfig, Transformer
from server.demos.sun_memory import memory_lines, specialist_memory


def test_demo_memory_line_counts_full_copies_and_adapters_as_saved(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    d = save_module(tmp_path / "rotate", Transformer(cfg), {"kind": "sun-prefill", "config": cfg.__dict__})
    mem = specialist_memory({"rotate": Path(d)})["rotate"]
    assert mem["full_copy_bytes"] == sum(p.numel() * 4 for p in Transformer(cfg).state_dict().values())
    a = save_adapter(tmp_path / "a", init_adapter(cfg, 8))
    assert mem["adapter_bytes"][8] == safetensors_bytes(sorted(Path(a).glob("*.safetensors")))
    text = "\n".join(memory_lines({"rotate": mem}))
    assert "rotate" in text and f"{mem['full_copy_bytes'] / 1e3:.1f} kB" in text and "rank 16" in text
