"""A LoRA adapter on disk, in PEFT's format: adapter_config.json + adapter_model.safetensors.

What PEFT's save_pretrained writes and PeftModel.from_pretrained (and llama.cpp's
convert_lora_to_gguf.py) read: peft_type "LORA", r, lora_alpha, target_modules,
base_model_name_or_path; tensors "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"
[r, in] and "...lora_B.weight" [out, r]. Our own keys start with "starsun_" (PEFT ignores them,
with a warning that names them): the fingerprint of the base the adapter was made for.

`load_adapter` trusts nothing in the files: every way an adapter can be wrong for a base is an
AdapterError that says what is wrong and what to do, before any tensor reaches a model.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Dict, Mapping, Optional, Union

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from edge.model.lora.adapter import ALL_TARGETS, TARGET_PARENTS, LoraAdapter
from edge.model.lora.error import AdapterError
from edge.model.transformer import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FINGERPRINT_KEY = "starsun_base_fingerprint"
_NAME = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+))\.lora_([AB])\.weight$")
# PEFT options that change what the adapter computes and that this runtime does not implement
_UNSUPPORTED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
                "layers_to_transform": (None,), "layers_pattern": (None, [], ""), "modules_to_save": (None, []),
                "rank_pattern": (None, {}), "alpha_pattern": (None, {}), "layer_replication": (None,),
                "use_qalora": (False, None), "alora_invocation_tokens": (None,), "lora_bias": (False, None),
                "trainable_token_indices": (None,), "target_parameters": (None, [])}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def adapter_sha256(directory) -> Dict[str, str]:
    """{file name: sha256 hex} of an adapter directory's two files (what a manifest records)."""
    d = Path(directory)
    return {name: _sha256(d / name) for name in (CONFIG_FILE, WEIGHTS_FILE)}


def save_adapter(directory, adapter: LoraAdapter, base_model: Optional[str] = None) -> Path:
    """Write the adapter as PEFT does (tensors in their own dtype); returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank, "lora_alpha": adapter.alpha,
            "target_modules": list(adapter.targets), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": adapter.use_rslora, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": base_model if base_model is not None else adapter.base_model}
    if adapter.base_fingerprint:
        conf[FINGERPRINT_KEY] = adapter.base_fingerprint
    tensors = {n: t.detach().cpu().contiguous() for n, t in adapter.named_tensors()}
    tmp = d / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(d / WEIGHTS_FILE)       # atomic: a reader never sees half a file
    (d / CONFIG_FILE).write_text(json.dumps(conf, indent=2, sort_keys=True))
    return d


def _read_config(d: Path) -> dict:
    try:
        conf = json.loads((d / CONFIG_FILE).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{d / CONFIG_FILE} is not valid JSON ({e}); re-export the adapter") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{d / CONFIG_FILE} must hold a JSON object")
    if conf.get("peft_type") != "LORA":
        raise AdapterError(f"{d}: peft_type is {conf.get('peft_type')!r}; only LoRA adapters (\"LORA\") "
                           "apply to a SUN base")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise AdapterError(f"{d / CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{d / CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    for key, fine in _UNSUPPORTED.items():
        if key in conf and conf[key] not in fine:
            raise AdapterError(f"{d / CONFIG_FILE}: {key}={conf[key]!r} is not supported (plain LoRA on "
                               f"{','.join(ALL_TARGETS)} only); re-train without it")
    targets = conf.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{d / CONFIG_FILE}: target_modules must be a list of module names, got {targets!r}")
    unknown = [t for t in targets if t not in TARGET_PARENTS]
    if unknown:
        raise AdapterError(f"{d / CONFIG_FILE}: unknown target module {unknown[0]!r}; a Llama/Qwen2 base has "
                           f"{','.join(ALL_TARGETS)}")
    return conf


def _check_sha256(d: Path, blob: bytes, conf_bytes: bytes, sha256) -> None:
    want = {WEIGHTS_FILE: sha256} if isinstance(sha256, str) else dict(sha256)
    have = {WEIGHTS_FILE: hashlib.sha256(blob).hexdigest(), CONFIG_FILE: hashlib.sha256(conf_bytes).hexdigest()}
    for name, digest in want.items():
        if name not in have:
            raise AdapterError(f"expected sha256 for {name!r}, which is not an adapter file ({', '.join(have)})")
        if have[name] != str(digest).lower():
            raise AdapterError(f"{d / name}: sha256 {have[name][:16]}… is not the expected {str(digest)[:16]}…: "
                               "the file was changed or damaged in transit; copy it again")


def _read_tensors(d: Path, blob: bytes) -> Dict[str, torch.Tensor]:
    try:
        return load_bytes(blob)
    except Exception as e:   # safetensors raises its own error types, or OverflowError etc. on a bad header
        raise AdapterError(f"{d / WEIGHTS_FILE} is not a readable safetensors file (truncated or corrupt: "
                           f"{type(e).__name__}: {e}); re-export or copy it again") from None


def _split_tensors(d: Path, tensors: Mapping[str, torch.Tensor], targets) -> tuple:
    a, b = {}, {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if not m or TARGET_PARENTS.get(m.group(4)) != m.group(3):
            raise AdapterError(f"{d / WEIGHTS_FILE}: unexpected tensor {name!r}: not a LoRA weight of "
                               f"{','.join(ALL_TARGETS)} under PEFT's names")
        if m.group(4) not in targets:
            raise AdapterError(f"{d / WEIGHTS_FILE}: tensor {name!r} is for {m.group(4)}, which target_modules "
                               f"({','.join(targets)}) does not list: config and weights disagree")
        (a if m.group(5) == "A" else b)[m.group(1)] = t
    return a, b


def load_adapter(path, base_config: ModelConfig, sha256: Union[str, Mapping[str, str], None] = None,
                 base_fingerprint: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 device=None) -> LoraAdapter:
    """Read and validate an adapter directory for a base of config `base_config`.

    sha256: the expected digest of adapter_model.safetensors, or {file name: digest} for either
    file (adapter_sha256's form). base_fingerprint: the base's base_fingerprint(); checked
    against the one the adapter records (an adapter from elsewhere that records none is
    checked on shapes only). dtype / device: where the tensors go (default: as saved, CPU).
    Raises AdapterError on anything wrong."""
    d = Path(path)
    if d.is_file() and d.name in (CONFIG_FILE, WEIGHTS_FILE):
        d = d.parent
    if not (d / CONFIG_FILE).is_file() or not (d / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{d} is not a LoRA adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
                           "(PEFT's save_pretrained, or `edge-export tune --adapter lora`, writes them)")
    conf_bytes, blob = (d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes()
    if sha256 is not None:
        _check_sha256(d, blob, conf_bytes, sha256)
    conf = _read_config(d)
    recorded = conf.get(FINGERPRINT_KEY) or ""
    if base_fingerprint and recorded and recorded != base_fingerprint:
        raise AdapterError(f"{d}: made for base {recorded[:12]}…, not this base {base_fingerprint[:12]}… "
                           "(same shapes, other weights); load the base it was tuned on, or re-tune")
    targets = tuple(t for t in ALL_TARGETS if t in conf["target_modules"])
    a, b = _split_tensors(d, _read_tensors(d, blob), targets)
    extra = {k: v for k, v in conf.items() if k.startswith("starsun_") and k != FINGERPRINT_KEY}
    adapter = LoraAdapter(conf["r"], float(conf["lora_alpha"]), targets, a, b,
                          use_rslora=bool(conf.get("use_rslora", False)), base_fingerprint=recorded,
                          base_model=str(conf.get("base_model_name_or_path") or ""), extra=extra)
    adapter.check(base_config)
    bad = next((k for k, t in (*a.items(), *b.items()) if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise AdapterError(f"{d / WEIGHTS_FILE}: {bad} holds NaN or inf; the tuning diverged, re-tune")
    return adapter.to(dtype=dtype, device=device)
