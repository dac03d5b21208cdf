"""Adapters on disk (edge/model/lora/files.py): PEFT's layout, a lossless round trip, and every
way an adapter can be wrong for a base refused at load with an AdapterError that says what."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from edge.model.lora.adapter import base_fingerprint, init_adapter, parse_targets
from edge.model.lora.apply import LoraTransformer, lora_prefill
from edge.model.lora.error import AdapterError
from edge.model.lora.files import CONFIG_FILE, WEIGHTS_FILE, adapter_sha256, load_adapter, save_adapter
from edge.model.sun_error import SunError
from edge.model.sun_modules import pad_right
from harness.tiny_models import random_model


def saved(tmp_path, base, name="task", rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj")):
    ad = init_adapter(base.cfg, rank, 2.0 * rank, targets, seed=1, dtype=torch.float64,
                      base_fingerprint=base_fingerprint(base))
    for t in ad.lora_b.values():
        t.normal_(0, 0.1)
    return save_adapter(tmp_path / name, ad, base_model="tiny-llama"), ad


def edit_config(d, **changes):
    conf = json.loads((d / CONFIG_FILE).read_text())
    conf.update(changes)
    (d / CONFIG_FILE).write_text(json.dumps(conf))


def edit_tensors(d, fn):
    t = load_file(str(d / WEIGHTS_FILE))
    fn(t)
    save_file(t, str(d / WEIGHTS_FILE))


def test_round_trip_in_peft_layout(tmp_path):
    base = random_model(0)
    d, ad = saved(tmp_path, base)
    conf = json.loads((d / CONFIG_FILE).read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["target_modules"] == list(parse_targets("q,k,v,o,gate,up,down"))
    assert conf["base_model_name_or_path"] == "tiny-llama"
    assert conf["starsun_base_fingerprint"] == base_fingerprint(base)
    tensors = load_file(str(d / WEIGHTS_FILE))
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    assert len(tensors) == 2 * 7 * base.cfg.num_layers
    back = load_adapter(d, base.cfg, sha256=adapter_sha256(d), base_fingerprint=base_fingerprint(base))
    assert (back.rank, back.alpha, back.targets, back.scale) == (ad.rank, ad.alpha, ad.targets, 2.0)
    assert all(torch.equal(x, y) for x, y in zip(back.parameters(), ad.parameters()))
    assert load_adapter(d / CONFIG_FILE, base.cfg, dtype=torch.float32).lora_a[
        "model.layers.0.self_attn.q_proj"].dtype == torch.float32


def test_base_fingerprint_is_the_fp32_weights_not_the_dtype():
    from edge.model.sun_modules import weights_fingerprint
    base = random_model(0)
    fp32 = random_model(0).float()
    assert base_fingerprint(base) == base_fingerprint(fp32) == weights_fingerprint(fp32, "fp32")
    other = random_model(1)
    assert base_fingerprint(other) != base_fingerprint(base)


def _truncate(d):
    blob = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(blob[: len(blob) // 2])


def _garbage(d):
    (d / WEIGHTS_FILE).write_bytes(b"\xff" * 64)


def _flip_a_value(d):
    """A still-valid safetensors file whose bytes differ: only a checksum can tell."""
    edit_tensors(d, lambda t: t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].mul_(1.5))


def _rank_mismatch_one_tensor(d):
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    edit_tensors(d, lambda t: t.__setitem__(key, t[key][:3].contiguous()))


def _drop_tensor(d):
    edit_tensors(d, lambda t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"))


def _foreign_tensor(d):
    edit_tensors(d, lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)))


def _nan(d):
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"
    edit_tensors(d, lambda t: t[key].__setitem__((0, 0), float("nan")))


# name -> (how the saved adapter is spoiled, load_adapter kwargs, the message's gist)
BAD = {
    "wrong base shape": (None, {}, r"q_proj: wrong base shape: this base's linear is \[32, 32\], the adapter's is \[64, 64\]"),
    "config rank": (lambda d: edit_config(d, r=8), {}, r"wrong rank tensors: .* disagree with r=8"),
    "one tensor's rank": (_rank_mismatch_one_tensor, {}, r"up_proj: wrong rank tensors: lora_A \(3, 64\)"),
    "unknown target": (lambda d: edit_config(d, target_modules=["q_proj", "wq"]), {},
                       r"unknown target module 'wq'; a Llama/Qwen2 base has q_proj"),
    "target as a regex": (lambda d: edit_config(d, target_modules=".*proj"), {},
                          "target_modules must be a list of module names"),
    "target missing from config": (lambda d: edit_config(d, target_modules=["q_proj", "k_proj"]), {},
                                   r"is for [a-z]+_proj, which target_modules .q_proj,k_proj. does not list"),
    "missing tensor": (_drop_tensor, {}, r"lacks lora_A or lora_B of model.layers.1.self_attn.v_proj"),
    "extra tensor": (_foreign_tensor, {}, r"unexpected tensor 'base_model.model.lm_head.lora_A.weight'"),
    "truncated file": (_truncate, {}, "not a readable safetensors file .truncated or corrupt"),
    "not safetensors": (_garbage, {}, "not a readable safetensors file"),
    "sha256 mismatch": (_flip_a_value, "sha", "sha256 .* is not the expected .*copy it again"),
    "config sha256 mismatch": (lambda d: edit_config(d, lora_alpha=4), "sha-both",
                               "adapter_config.json: sha256 .* is not the expected"),
    "base fingerprint mismatch": (None, {"base_fingerprint": "0" * 64},
                                  r"made for base [0-9a-f]{12}…, not this base 000000000000…"),
    "not json": (lambda d: (d / CONFIG_FILE).write_text("{r: 4"), {}, "is not valid JSON"),
    "not lora": (lambda d: edit_config(d, peft_type="PREFIX_TUNING"), {}, "only LoRA adapters"),
    "dora": (lambda d: edit_config(d, use_dora=True), {}, "use_dora=True is not supported"),
    "bad alpha": (lambda d: edit_config(d, lora_alpha="big"), {}, "lora_alpha must be a positive number"),
    "nan": (_nan, {}, "gate_proj holds NaN or inf"),
    "no weights file": (lambda d: (d / WEIGHTS_FILE).unlink(), {}, "is not a LoRA adapter directory"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_adapter_is_refused_with_what_is_wrong(tmp_path, case):
    base = random_model(0)
    d, _ = saved(tmp_path, base)
    spoil, kw, message = BAD[case]
    digests = adapter_sha256(d)
    if kw == "sha":
        kw = {"sha256": digests[WEIGHTS_FILE]}
    elif kw == "sha-both":
        kw = {"sha256": digests}
    narrower = random_model(0, hidden_size=32, num_heads=2, num_kv_heads=1).cfg
    cfg = narrower if case == "wrong base shape" else base.cfg
    if spoil:
        spoil(d)
    with pytest.raises(AdapterError, match=message) as err:
        load_adapter(d, cfg, **kw)
    assert isinstance(err.value, SunError)          # SUN's error handlers catch it too


def test_a_refused_adapter_leaves_the_loaded_ones_serving(tmp_path):
    base = random_model(0)
    good, _ = saved(tmp_path, base, "good")
    bad, _ = saved(tmp_path, base, "bad")
    _truncate(bad)
    view = LoraTransformer.over(base)
    view.add_adapter("good", load_adapter(good, base.cfg))
    toks, lens = pad_right([[5, 6, 7, 8], [9, 10]])
    with torch.no_grad():
        before = lora_prefill(view, toks, lens, ["good", None])[0]
        with pytest.raises(AdapterError):
            view.add_adapter("bad", load_adapter(bad, base.cfg))
        assert view.adapter_names == ["good"]
        assert torch.equal(lora_prefill(view, toks, lens, ["good", None])[0], before)
