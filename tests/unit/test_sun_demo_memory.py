"""The SUN demo's memory lines: a specialist's adapter is its saved adapter's tensor bytes, a full
copy the saved base's (the prefill module's shapes again), and the worker's measured tensors hold
the base once plus each adapter."""
from pathlib import Path

import torch

from edge.model.lora.adapter import base_fingerprint, init_adapter
from edge.model.lora.files import save_adapter
from edge.model.sun_modules import save_module, weights_fingerprint
from edge.model.transformer import ModelConfig, Transformer
from edge.sun.adapter_torch import TorchAdapterBackend
from server.demos.sun_memory import held_bytes, memory_lines, specialist_memory


def test_demo_memory_lines_count_the_adapters_served_and_the_full_copies_they_replace(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    base = Transformer(cfg).eval()
    d = save_module(tmp_path / "base", base, {"kind": "synthetic-base"})
    ranks = {"rotate": 8, "sort": 4}
    ads = {t: save_adapter(tmp_path / t, init_adapter(cfg, r, base_fingerprint=base_fingerprint(base)))
           for t, r in ranks.items()}
    mem = specialist_memory(Path(d), ads)
    full = sum(p.numel() * 4 for p in base.state_dict().values())
    assert mem["base_bytes"] == full
    for t, r in ranks.items():       # rank x (in + out) per targeted linear per layer, F32
        want = 4 * cfg.num_layers * r * sum(a + b for a, b in ((64, 64), (64, 32), (64, 32), (64, 64),
                                                                 (64, 128), (64, 128), (128, 64)))
        assert mem["tasks"][t] == {"adapter_bytes": want, "full_copy_bytes": full}, t
    be = TorchAdapterBackend(base, weights_fingerprint(base))
    for t, a in ads.items():
        be.add(t, a)
    held = held_bytes(be)
    assert held == {"base_bytes": full, "adapter_bytes": {t: m["adapter_bytes"] for t, m in mem["tasks"].items()}}
    text = "\n".join(memory_lines(mem, held))
    flat = " ".join(text.split())
    rotate = mem["tasks"]["rotate"]["adapter_bytes"]
    assert f"rotate adapter {rotate / 1e3:.1f} kB full copy {full / 1e3:.1f} kB ({full / rotate:.1f}x less)" in flat
    assert f"as full copies 2 x {full / 1e3:.1f} kB" in text
