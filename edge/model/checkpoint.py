"""Load real checkpoints: GGUF files (dequantised) and Hugging Face directories.

    ckpt = load_checkpoint("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, ckpt = load_model("smollm2-135m")          # a name from edge.model.fetch works too

A GGUF is dequantised with the `gguf` package to fp32, its llama.cpp tensor
names mapped to Hugging Face names (edge.model.transformer uses HF names) and, for arch
llama, the q/k rows un-permuted (llama.cpp's converter permutes them for its
interleaved RoPE; qwen2 files are written unpermuted, as transformers' own GGUF
loader also assumes). The result is cached next to the file as an HF directory,
`.cache/<stem>-<fingerprint16>/` (model.safetensors in fp32 + config.json +
tokenizer.json + tokenizer_config.json), so the next load skips the
dequantisation; transformers can load that directory too.

Weight fingerprint (`Checkpoint.fingerprint`): edge/model/checkpoint_files.py's
`file_fingerprint`. That module also holds what needs no torch (CheckpointError,
load_tokenizer), so the llama.cpp and onnxruntime paths never import this one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .checkpoint_files import (CheckpointError, cache_dir as _cache_dir, file_fingerprint,  # noqa: F401
                               is_gguf as _is_gguf, load_tokenizer, open_gguf_checked as _open_gguf,
                               resolve_checkpoint as _resolve)
from .transformer import ModelConfig, Transformer
from .tokenizer import Tokenizer, TokenizerError


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: Dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str      # of the weights (see module doc)
    source: Path          # the GGUF file or HF directory asked for
    kind: str             # "gguf" or "hf"
    from_cache: bool = False
    load_seconds: float = 0.0


_CACHE_VERSION = "2"  # bump when the conversion changes, to invalidate old caches


# -- GGUF ----------------------------------------------------------------------------
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


ROPE_FREQS = "rope_freqs.weight"


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"unexpected tensor {gguf_name!r} in GGUF file; only plain "
                          "llama / qwen2 decoder checkpoints are supported")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rows of q/k)."""
    # permute views rows as (head, 2, d/2) and swaps; the inverse views them as (head, d/2, 2)
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape))


def _gguf_config(reader) -> ModelConfig:
    f = reader.fields

    def get(key, default=None):
        return f[key].contents() if key in f else default

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; StarSun runs the "
                              "llama and qwen2 families (SmolLM2, Llama, Qwen2.5)")
    names = {t.name: t for t in reader.tensors}
    emb = names.get("token_embd.weight")
    if emb is None:
        raise CheckpointError("GGUF file has no token_embd.weight tensor; it is not a model file")
    hidden = get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.attention.key_length") or hidden // heads
    rope_dim = get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(f"partial rotary embeddings (rope dim {rope_dim} != head dim "
                              f"{head_dim}) are not supported")
    rope_scaling = None
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:                # Llama 3.1-style: per-frequency factors, not metadata
        factors = np.array(freqs.data, dtype=np.float64).reshape(-1)
        if factors.size != head_dim // 2:
            raise CheckpointError(f"{ROPE_FREQS} has {factors.size} factors; head dim {head_dim} needs "
                                  f"{head_dim // 2}")
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    kind = get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        rope_scaling = {"rope_type": kind, "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
        orig = get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    vocab = get(f"{arch}.vocab_size") or int(emb.shape[1])
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")), num_heads=int(heads),
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)), head_dim=int(head_dim),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(get(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names)


def _gguf_weights(reader, cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    import gguf
    sd = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue                     # read into the config (rope_scaling "freq_factors")
        name = _hf_name(t.name)
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"tensor {t.name}: {e}; re-quantise the file to "
                                  "Q4_0/Q4_1/Q8_0/Q4_K/Q6_K or F16") from e
        shape = tuple(int(d) for d in reversed(t.shape))   # GGUF lists dims innermost first
        w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        if cfg.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif cfg.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        sd[name] = w
    return sd


def _write_cache(d: Path, ckpt: Checkpoint) -> None:
    """Write the converted checkpoint as an HF dir; atomic (tmp dir + rename)."""
    from safetensors.torch import save_file
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        meta = {"format": "pt", "starsun_fingerprint": ckpt.fingerprint,
                "starsun_cache_version": _CACHE_VERSION, "source": ckpt.source.name}
        save_file({k: v.float().contiguous() for k, v in ckpt.state_dict.items()},
                  str(tmp / "model.safetensors"), metadata=meta)
        hf = ckpt.config.to_hf()
        hf.update(torch_dtype="float32", bos_token_id=ckpt.tokenizer.bos_id,
                  eos_token_id=ckpt.tokenizer.eos_id)
        (tmp / "config.json").write_text(json.dumps(hf, indent=1))
        ckpt.tokenizer.save(tmp)
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
    except OSError as e:  # read-only models dir, disk full: loading still works
        warnings.warn(f"could not write the checkpoint cache {d}: {e}")
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(d: Path, fingerprint: str, dtype) -> Optional[Checkpoint]:
    from safetensors import safe_open
    st = d / "model.safetensors"
    if not st.is_file():
        return None
    try:
        with safe_open(str(st), framework="pt") as f:
            meta = f.metadata() or {}
        if (meta.get("starsun_fingerprint") != fingerprint
                or meta.get("starsun_cache_version") != _CACHE_VERSION):
            return None
        return _load_hf(d, dtype)
    except (CheckpointError, OSError, ValueError, RuntimeError) as e:
        warnings.warn(f"ignoring a broken checkpoint cache {d} ({e}); converting again")
        return None


def _load_gguf(path: Path, dtype, cache: bool) -> Checkpoint:
    fp = file_fingerprint(path)
    cdir = _cache_dir(path, fp)
    if cache:
        hit = _read_cache(cdir, fp, dtype)
        if hit is not None:
            hit.fingerprint, hit.source, hit.kind, hit.from_cache = fp, path, "gguf", True
            return hit
    reader = _open_gguf(path)
    try:
        cfg = _gguf_config(reader)
    except (TypeError, ValueError) as e:  # a key missing (None) or inconsistent
        raise CheckpointError(f"{path}: incomplete or inconsistent GGUF metadata ({e})") from e
    try:
        tok = Tokenizer.from_gguf(reader)
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e}") from e
    try:
        sd = _gguf_weights(reader, cfg)
    except (ValueError, IndexError) as e:  # tensor data past the end of a truncated file
        raise CheckpointError(f"{path}: cannot read tensor data ({e}); the file may be "
                              "truncated -- delete it and run `make models`") from e
    ckpt = Checkpoint(cfg, sd, tok, fp, path, "gguf")
    _check_names(ckpt)
    if cache:
        _write_cache(cdir, ckpt)
    ckpt.state_dict = {k: v.to(dtype) for k, v in sd.items()}
    return ckpt


# -- Hugging Face directory ------------------------------------------------------------------
def _dir_fingerprint(d: Path, files) -> str:
    h = hashlib.sha256(b"starsun-hf-v1:" + (d / "config.json").read_bytes())
    for f in sorted(files):
        h.update(f.name.encode() + file_fingerprint(f).encode())
    return h.hexdigest()


def _load_hf(d: Path, dtype) -> Checkpoint:
    from safetensors import safe_open
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d} has no config.json; a Hugging Face model directory needs "
                              "config.json + *.safetensors + tokenizer.json")
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: unsupported or incomplete config ({e})") from e
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        hint = " (pytorch_model.bin is never unpickled: convert it to safetensors)" \
            if any(d.glob("*.bin")) else ""
        raise CheckpointError(f"{d} has no *.safetensors weights{hint}")
    sd = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sd[k] = st.get_tensor(k).to(dtype)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read safetensors ({e}); the file may be "
                                  "truncated or corrupt") from e
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    try:
        tok = Tokenizer.from_hf_dir(d)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    ckpt = Checkpoint(cfg, sd, tok, _dir_fingerprint(d, files), d, "hf")
    _check_names(ckpt)
    return ckpt


def _check_names(ckpt: Checkpoint) -> None:
    try:
        with torch.device("meta"):
            want = Transformer(ckpt.config).state_dict()
    except ValueError as e:  # e.g. a RoPE scaling type edge.model.transformer does not implement
        raise CheckpointError(f"{ckpt.source}: {e}") from e
    have = ckpt.state_dict
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    bad = [k for k in want if k in have and tuple(have[k].shape) != tuple(want[k].shape)]
    if missing or extra or bad:
        raise CheckpointError(
            f"{ckpt.source}: weights do not match the config: missing {missing[:4]}, "
            f"unexpected {extra[:4]}, wrong shape {bad[:4]}")


# -- entry points ---------------------------------------------------------------------------
def load_checkpoint(path, dtype: torch.dtype = torch.float32, cache: bool = True) -> Checkpoint:
    """Config, weights (HF names, `dtype`), tokenizer and weight fingerprint of a checkpoint."""
    t0 = time.perf_counter()
    p = _resolve(path)
    if p.is_dir():
        ckpt = _load_hf(p, dtype)
    elif _is_gguf(p):
        ckpt = _load_gguf(p, dtype, cache)
    else:
        raise CheckpointError(f"{p} is neither a GGUF file (no 'GGUF' magic) nor a Hugging Face "
                              "directory (config.json + *.safetensors + tokenizer.json)")
    ckpt.config.extra.update(bos_token_id=ckpt.tokenizer.bos_id,
                             eos_token_ids=sorted(ckpt.tokenizer.eos_ids),
                             tokenizer_fingerprint=ckpt.tokenizer.fingerprint(),
                             weights_fingerprint=ckpt.fingerprint)
    ckpt.load_seconds = time.perf_counter() - t0
    return ckpt


def model_from_state_dict(cfg: ModelConfig, state_dict: Dict[str, torch.Tensor]) -> Transformer:
    """Build a Transformer around existing tensors (no random init, no copy)."""
    return Transformer.from_state_dict(cfg, state_dict)


def load_model(path, dtype: torch.dtype = torch.float32,
               cache: bool = True) -> Tuple[Transformer, Checkpoint]:
    ckpt = load_checkpoint(path, dtype, cache)
    return model_from_state_dict(ckpt.config, ckpt.state_dict), ckpt
