"""Bundles: a directory of exported artifacts + manifest.json that a device validates before loading.

    edge-export bundle smollm2-135m out/smol --onnx model --int4 --gguf Q4_0
    edge-export bundle runs/qsun-decoder out/sun --onnx decoder --int4     # a SUN part
    edge-export bundle runs/task-a out/sun --onnx prefill                  # adds to the same bundle

Each artifact records what it is (backend, graph, roles it serves, quantisation),
which weights it holds (fingerprint; for SUN prefill modules the fingerprint of
the decoder their KV is meant for), its files (bytes + sha256) and an estimate
of the memory it needs per role and per 1k tokens of KV. Reading and checking a
bundle lives in edge/engines/loader.py (`validate_bundle`): devices never import
export/.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from edge.engines.loader import (BUNDLE_FORMAT, BUNDLE_VERSION, MANIFEST, BundleError, pick_artifact, read_manifest,
                                 sha256_file)
from edge.engines.loader import validate_bundle as validate_artifacts
from edge.engines.lora_bundle import ADAPTERS, TASK_NAME, adapter_entries, check_adapters
from edge.model.transformer import ModelConfig

__all__ = ["build_bundle", "add_artifact", "add_adapter", "validate_bundle", "memory_estimate", "BundleError"]

# roles each artifact serves (a GGUF moves KV blobs through llama.cpp's sequence state)
GRAPH_ROLES = {"model": ["draft", "target", "prefill", "decoder"], "prefill": ["prefill"],
               "decoder": ["decoder"], "gguf": ["draft", "target", "prefill", "decoder"]}
# sizing assumptions behind memory_estimate, written into the manifest
ASSUME = {"context_tokens": 1024, "draft_sessions": 8, "decoder_batch": 16, "verify_tokens": 8}


def _file_entry(d: Path, p: Path) -> dict:
    return {"path": p.relative_to(d).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}


def memory_estimate(cfg: ModelConfig, weight_bytes: int, kv_itemsize: int) -> dict:
    """Bytes per role: weights + KV for the role's usual load + a logits buffer (estimates)."""
    kv_1k = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize * 1000
    ctx = ASSUME["context_tokens"] / 1000
    logits = cfg.vocab_size * 4
    return {
        "weights_bytes": weight_bytes,
        "kv_bytes_per_1k_tokens": kv_1k,
        "roles": {
            "target": int(weight_bytes + kv_1k * ctx + logits * ASSUME["verify_tokens"]),
            "draft": int(weight_bytes + kv_1k * ctx * ASSUME["draft_sessions"] + logits * ASSUME["draft_sessions"]),
            "prefill": int(weight_bytes + kv_1k * ctx + logits),
            "decoder": int(weight_bytes + kv_1k * ctx * ASSUME["decoder_batch"] + logits * ASSUME["decoder_batch"]),
        },
        "assumptions": dict(ASSUME),
    }


def _load_manifest_or_new(d: Path) -> dict:
    if (d / MANIFEST).is_file():
        return read_manifest(d)
    return {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "tokenizer": None, "artifacts": []}


def _write_manifest(d: Path, man: dict) -> None:
    man["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(man, indent=1, sort_keys=True))
    tmp.replace(d / MANIFEST)  # a crash never leaves half a manifest


def add_artifact(directory, name: str, backend: str, files: Sequence[Path], cfg: ModelConfig, graph: str,
                 quant: str, fingerprint: str, kv_fingerprint: str, roles: Sequence[str],
                 tokenizer_fingerprint: Optional[str] = None, decoder_fingerprint: Optional[str] = None,
                 extra: Optional[dict] = None) -> dict:
    """Record files already written under `directory` as one artifact (replacing one of the same name)."""
    d = Path(directory)
    man = _load_manifest_or_new(d)
    entries = [_file_entry(d, Path(f)) for f in files]
    kv_itemsize = 4 if backend == "onnx" else 2  # ORT keeps fp32 KV; llama.cpp f16
    a = {"name": name, "backend": backend, "graph": graph, "roles": list(roles), "quant": quant,
         "fingerprint": fingerprint, "kv_fingerprint": kv_fingerprint, "decoder_fingerprint": decoder_fingerprint,
         "tokenizer_fingerprint": tokenizer_fingerprint, "config": json.loads(cfg.to_json()), "files": entries,
         "memory": memory_estimate(cfg, sum(e["bytes"] for e in entries), kv_itemsize), **(extra or {})}
    man["artifacts"] = [x for x in man["artifacts"] if x["name"] != name] + [a]
    _write_manifest(d, man)
    return a


def add_tokenizer(directory, tokenizer) -> None:
    d = Path(directory)
    tokenizer.save(d)
    man = _load_manifest_or_new(d)
    man["tokenizer"] = {"fingerprint": tokenizer.fingerprint(),
                        "files": [_file_entry(d, d / n) for n in ("tokenizer.json", "tokenizer_config.json")]}
    _write_manifest(d, man)


def validate_bundle(directory, deep: bool = True, **kw) -> dict:
    """The artifacts' check (edge/engines/loader.py) and the adapters' (sizes, sha256)."""
    man = validate_artifacts(directory, deep=deep, **kw)
    check_adapters(directory, deep=deep)
    return man


def _adapter_base(d: Path, man: dict, base) -> tuple:
    """(base GGUF path, artifact name, fingerprint): --base, else the bundle's first GGUF artifact."""
    if base:
        return Path(base), Path(base).name, None
    try:
        a = pick_artifact(man, backend="llamacpp", directory=d)
    except BundleError:
        raise BundleError(f"bundle {d} has no GGUF base for the adapter: add one (`edge-export bundle SRC {d} "
                          "--gguf F16`) or pass --base") from None
    return d / a["files"][0]["path"], a["name"], a.get("fingerprint")


def add_adapter(directory, adapter_dir, task: Optional[str] = None, base=None, ftype: str = "F32",
                log=print) -> dict:
    """Add a PEFT LoRA directory to the bundle as task `task` (default: the directory's name): its
    GGUF LoRA (checked against the bundle's GGUF base) and its PEFT files, all with sha256."""
    import shutil

    from edge.engines.lora_gguf import read_adapter
    from export.gguf_lora import CONFIG, WEIGHTS, export_adapter
    d = Path(directory)
    man = read_manifest(d)              # a bundle already: its base GGUF is what the adapter is checked against
    task = task or Path(adapter_dir).resolve().name
    if not TASK_NAME.match(task):
        raise BundleError(f"task name {task!r} must be letters, digits, _ . - (it names a directory)")
    base_path, base_name, base_fp = _adapter_base(d, man, base)
    sub = d / ADAPTERS / task
    sub.mkdir(parents=True, exist_ok=True)
    gguf_path = export_adapter(adapter_dir, base_path, sub / "adapter.gguf", ftype=ftype, task=task, log=log)
    for name in (CONFIG, WEIGHTS):
        shutil.copyfile(Path(adapter_dir) / name, sub / name)
    info, _ = read_adapter(gguf_path)
    entry = {"task": task, "format": "gguf-lora", "rank": max(info.ranks), "ranks": list(info.ranks),
             "alpha": info.alpha, "targets": list(info.targets), "layers": len(info.layers), "arch": info.arch,
             "base": base_name, "base_fingerprint": base_fp,
             "files": [_file_entry(d, sub / n) for n in ("adapter.gguf", CONFIG, WEIGHTS)]}
    man = read_manifest(d)
    man[ADAPTERS] = [a for a in (man.get(ADAPTERS) or []) if a.get("task") != task] + [entry]
    _write_manifest(d, man)
    log(f"adapter {task}: rank {entry['rank']}, {','.join(entry['targets'])} -> {sub.relative_to(d)}")
    return entry


def _load_source(src):
    """(model, identity) for a checkpoint (GGUF / HF dir / model name) or a SUN module directory."""
    p = Path(str(src))
    if p.is_dir() and (p / "model.safetensors").is_file() and (p / MANIFEST).is_file():
        from edge.model.sun_modules import load_module
        model, man = load_module(p, dtype=torch.float32)
        kind = man.get("kind", "")
        if kind == "sun-decoder":
            ident = {"fingerprint": man["fingerprint"], "kv_fingerprint": man["fingerprint"],
                     "decoder_fingerprint": man["fingerprint"], "sun": kind, "precision": man.get("precision")}
        else:  # a prefill module: its KV goes to the decoder it was tuned for
            fp = man.get("fingerprint") or man.get("decoder_fingerprint")
            from edge.model.sun_modules import weights_fingerprint
            ident = {"fingerprint": weights_fingerprint(model, "fp32"), "kv_fingerprint": man["decoder_fingerprint"],
                     "decoder_fingerprint": man["decoder_fingerprint"], "sun": kind or "sun-prefill",
                     "task": man.get("task")}
            if kind == "full-ft":
                ident["kv_fingerprint"] = fp
        return model, ident, None
    from edge.model.checkpoint import load_model
    model, ckpt = load_model(src)
    ident = {"fingerprint": ckpt.fingerprint, "kv_fingerprint": ckpt.fingerprint,
             "gguf_source": str(ckpt.source) if ckpt.kind == "gguf" else None}
    return model, ident, ckpt.tokenizer


def _gguf_roles(ident: dict) -> list:
    """A SUN part serves its own role only; a plain model serves every role."""
    sun = ident.get("sun")
    return GRAPH_ROLES["gguf"] if not sun else ["decoder"] if sun == "sun-decoder" else ["prefill"]


def _sun_extra(ident: dict) -> dict:
    """What a SUN role needs to know about the module an artifact came from."""
    return {k: ident[k] for k in ("sun", "task") if ident.get(k)}


def build_bundle(src, out_dir, onnx_graphs: Sequence[str] = ("model",), int4: bool = False,
                 int4_lm_head: bool = False, fp32: bool = True, gguf_types: Sequence[str] = (),
                 tokenizer=None, accuracy_level: int = 0, log=print) -> dict:
    """Export `src` into the bundle at out_dir (created or extended) and return the manifest.

    onnx_graphs: any of model / prefill / decoder; fp32 and/or int4 variants.
    gguf_types: GGUF file types (F32, F16, Q8_0, Q4_0) via export/gguf.py.
    tokenizer: a Tokenizer, or a path/name to take it from, when src has none (SUN module dirs).
    """
    from export.onnx import GRAPH_KINDS, QUANT_INT4, artifact_files, export_onnx
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    model, ident, tok = _load_source(src)
    if tok is None and tokenizer is not None:
        from edge.model.checkpoint import load_checkpoint
        tok = tokenizer if hasattr(tokenizer, "fingerprint") else load_checkpoint(tokenizer).tokenizer
    tok_fp = tok.fingerprint() if tok is not None else None
    if tok is not None:
        add_tokenizer(d, tok)
    stem = Path(str(src)).name.replace(".gguf", "").replace(" ", "_") or "model"
    variants = ([("fp32", False)] if fp32 else []) + ([("int4", True)] if int4 else [])
    for g in onnx_graphs:
        if g not in GRAPH_KINDS:
            raise BundleError(f"unknown graph {g!r}; choose from {', '.join(GRAPH_KINDS)}")
        for tag, q in variants:
            name = f"{stem}.{g}.{tag}"
            t0 = time.perf_counter()
            path = export_onnx(model, d / f"{name}.onnx", kind=g, int4=q, int4_lm_head=q and int4_lm_head,
                               fingerprint=ident["kv_fingerprint"], accuracy_level=accuracy_level)
            add_artifact(d, name, "onnx", artifact_files(path), model.cfg, g, QUANT_INT4 if q else "fp32",
                         ident["fingerprint"], ident["kv_fingerprint"], GRAPH_ROLES[g], tok_fp,
                         ident.get("decoder_fingerprint"), {"int4_lm_head": bool(q and int4_lm_head),
                                                            **_sun_extra(ident)})
            log(f"onnx {name}: {time.perf_counter() - t0:.1f} s")
    for ft in gguf_types:
        from export.gguf import vocab_from_gguf, write_gguf
        if tok is None:
            raise BundleError("a GGUF needs the tokenizer: pass --tokenizer (the base checkpoint)")
        # a GGUF source keeps llama.cpp's own vocabulary metadata, as export_gguf does
        gtok = vocab_from_gguf(ident["gguf_source"]) if ident.get("gguf_source") else tok
        name = f"{stem}.{ft.lower()}"
        t0 = time.perf_counter()
        path = write_gguf(d / f"{name}.gguf", model.cfg, model.state_dict(), gtok, ftype=ft)
        add_artifact(d, name, "gguf", [path], model.cfg, "gguf", ft, ident["fingerprint"],
                     ident["kv_fingerprint"], _gguf_roles(ident), tok_fp, ident.get("decoder_fingerprint"),
                     _sun_extra(ident))
        log(f"gguf {name}: {time.perf_counter() - t0:.1f} s")
    return validate_bundle(d)


def describe(directory) -> List[str]:
    """One line per artifact (for `edge-export bundle --show`)."""
    man = read_manifest(directory)
    out = []
    for a in man["artifacts"]:
        mb = a["memory"]["weights_bytes"] / 2**20
        kv = a["memory"]["kv_bytes_per_1k_tokens"] / 2**20
        out.append(f"{a['name']:<40} {a['backend']:<5} {a['quant']:<14} {','.join(a['roles']):<28} "
                   f"{mb:8.1f} MiB  KV {kv:.1f} MiB/1k tok  fp {str(a['fingerprint'])[:12]}")
    for a in adapter_entries(directory):
        mib = sum(f["bytes"] for f in a["files"]) / 2**20
        out.append(f"adapter {a['task']:<32} lora  rank {a['rank']:<9} {','.join(a['targets']):<28} "
                   f"{mib:8.2f} MiB  on {a.get('base')}  sha256 {a['files'][0]['sha256'][:12]}")
    return out
