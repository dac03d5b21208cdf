"""Our adapter files are PEFT's: both directions against transformers + peft themselves (float64).

* an adapter we save, loaded by PeftModel.from_pretrained onto the equivalent HF model, gives
  the same prefill logits and KV as our LoraTransformer (PEFT ignores, with a warning naming
  them, only our starsun_* keys);
* an adapter PEFT itself creates and saves (get_peft_model + save_pretrained) loads with
  load_adapter and computes what PEFT computes.
"""
import warnings

import peft
import pytest
import torch
import transformers

from edge.model.lora.adapter import base_fingerprint, init_adapter
from edge.model.lora.apply import LoraTransformer
from edge.model.lora.files import load_adapter, save_adapter
from harness.tiny_models import random_model

# our RoPE angles are float32 (as the exported graphs compute them), so even without an adapter our
# float64 model and HF's differ by ~2e-7 here; a wrong scale, a transposed A/B or a missed target
# moves logits by > 1e-2 (asserted below: the adapter's own effect is > 1e-3)
TOL = 1e-6


def hf_twin(base):
    cfg = base.cfg
    cls = transformers.Qwen2ForCausalLM if cfg.arch == "qwen2" else transformers.LlamaForCausalLM
    conf = (transformers.Qwen2Config if cfg.arch == "qwen2" else transformers.LlamaConfig)(
        **cfg.to_hf(), attn_implementation="eager")
    hf = cls(conf).double().eval()
    _, unexpected = hf.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected
    return hf


def ours(base, adapter, tokens):
    view = LoraTransformer.over(base)
    view.add_adapter("t", adapter)
    with torch.no_grad(), view.rows("t"):
        return view(tokens)


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_peft_loads_our_adapter_and_computes_our_prefill(tmp_path, arch):
    base = random_model(3, arch=arch)
    ad = init_adapter(base.cfg, 4, 16.0, seed=2, dtype=torch.float64, base_fingerprint=base_fingerprint(base))
    for t in ad.lora_b.values():
        t.normal_(0, 0.2)
    save_adapter(tmp_path / "a", ad, base_model="tiny")
    tokens = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf_twin(base), str(tmp_path / "a")).eval()
    ignored = [str(w.message) for w in caught if "Unexpected keyword arguments" in str(w.message)]
    assert all("'starsun_base_fingerprint'" in m for m in ignored)
    with torch.no_grad():
        out = model(tokens, use_cache=True)
    logits, kv = ours(base, ad, tokens)
    assert (out.logits - base(tokens)[0]).abs().max() > 1e-3          # PEFT applied the adapter
    assert (logits - out.logits).abs().max() <= TOL
    for i, (k, v) in enumerate(kv):
        layer = out.past_key_values.layers[i]
        assert (k - layer.keys).abs().max() <= TOL and (v - layer.values).abs().max() <= TOL


def test_an_adapter_peft_saves_loads_here_and_computes_what_peft_computes(tmp_path):
    base = random_model(5)
    torch.manual_seed(0)
    conf = peft.LoraConfig(r=6, lora_alpha=3, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(hf_twin(base), conf).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    model.save_pretrained(str(tmp_path / "p"))
    ad = load_adapter(tmp_path / "p", base.cfg)
    assert (ad.rank, ad.alpha, ad.targets) == (6, 3.0, ("q_proj", "v_proj", "up_proj", "down_proj"))
    assert ad.base_fingerprint == ""          # PEFT records none: checked on shapes only
    tokens = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
        assert (want - base(tokens)[0]).abs().max() > 1e-3
    assert (ours(base, ad, tokens)[0] - want).abs().max() <= TOL
