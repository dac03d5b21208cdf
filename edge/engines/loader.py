"""One place every role and CLI gets an Engine: `load_engine(model, ...)`, and
`open_model(model, ...)` -> (engine, tokenizer), the one place a model becomes an engine.

`model` is a ResolvedModel (edge/model/resolved.py: what a command resolved once, its backend
chosen, a bundle's manifest read and its artifact picked); a plain bundle directory
(manifest.json from `edge-export bundle`), .onnx graph, .gguf file, Hugging Face or SUN module
directory or model name of edge.model.fetch is resolved here, at the loader's own door, for
the callers (tests, benchmarks) that have no command. A bundle is validated before anything is loaded:
every file must be present with the size and sha256 its manifest records, and
ONNX graphs must carry the fingerprint the manifest names; a truncated,
corrupted or mismatched artifact is refused with a BundleError saying what to do.

Bundle manifest (version 1), written by export/bundle.py:

    {"format": "starsun-bundle", "version": 1,
     "tokenizer": {"files": [...], "fingerprint": ...} | null,
     "artifacts": [{"name", "backend": "onnx"|"gguf", "graph", "roles": [...],
                    "quant", "fingerprint", "kv_fingerprint", "decoder_fingerprint",
                    "tokenizer_fingerprint", "config", "files": [{"path", "bytes", "sha256"}],
                    "memory": {...}}, ...]}

`kv_fingerprint` is what the engine stamps on (and demands of) KV blobs: a
decoder's own fingerprint, and for a SUN prefill module the fingerprint of
the decoder it was tuned for.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from edge.engines.base import Engine, EngineError
# the bundle's manifest is read with the model (edge/model/bundle_manifest.py); these names stay importable here
from edge.model.bundle_manifest import (BUNDLE_FORMAT, BUNDLE_VERSION, MANIFEST, BundleError,  # noqa: F401
                                        pick_artifact, read_manifest)
from edge.model.resolved import BACKENDS, ROLES, ResolvedModel, as_resolved  # noqa: F401

if TYPE_CHECKING:
    from edge.model.tokenizer import Tokenizer


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def _check_files(d: Path, files: Sequence[dict], what: str, deep: bool) -> None:
    root = d.resolve()
    for f in files:
        p = d / f["path"]
        if not p.resolve().is_relative_to(root):      # a link (file or folder) that leads out of it
            raise BundleError(f"bundle {d}: {what} file {f['path']} is a link to outside the bundle; "
                              "copy the file itself into the bundle")
        if not p.is_file():
            raise BundleError(f"bundle {d}: {what} file {f['path']} is missing; re-copy the bundle")
        size = p.stat().st_size
        if size != f["bytes"]:
            raise BundleError(f"bundle {d}: {what} file {f['path']} is {size} bytes but the manifest says "
                              f"{f['bytes']}: it is truncated or was replaced; re-copy the bundle or re-export it")
        if deep and sha256_file(p) != f["sha256"]:
            raise BundleError(f"bundle {d}: {what} file {f['path']} is corrupted (sha256 differs from the "
                              "manifest); re-copy the bundle or re-export it")


def _onnx_fingerprint(path: Path) -> Optional[str]:
    # metadata only: parsing the whole graph (onnx.load_model) would hold it twice in memory
    from edge.engines.onnx_engine import META_FINGERPRINT
    from edge.model.onnx_metadata import OnnxMetadataError, read_onnx_metadata
    try:
        return read_onnx_metadata(path).get(META_FINGERPRINT)
    except (OnnxMetadataError, OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not a readable ONNX graph ({str(e)[:200]}); re-export the bundle") from None


def validate_bundle(directory, deep: bool = True, expect_fingerprint: Optional[str] = None,
                    expect_tokenizer: Optional[str] = None, artifacts: Optional[Sequence[str]] = None) -> dict:
    """Check a bundle before loading it; returns its manifest.

    deep: verify sha256 of every file (else sizes only). expect_fingerprint /
    expect_tokenizer: the model (or KV) and tokenizer fingerprints the caller
    needs; an artifact made for another model is refused. artifacts: check only
    these names (default: all).
    """
    d = Path(directory)
    man = _manifest(directory)
    arts = man.get("artifacts") or []
    if not arts:
        raise BundleError(f"bundle {d} lists no artifacts")
    if man.get("tokenizer"):
        _check_files(d, man["tokenizer"]["files"], "tokenizer", deep)
        if expect_tokenizer and man["tokenizer"].get("fingerprint") != expect_tokenizer:
            raise BundleError(f"bundle {d}: its tokenizer ({str(man['tokenizer'].get('fingerprint'))[:12]}) "
                              f"is not the expected one ({expect_tokenizer[:12]}); tokens would not mean the same")
    for a in arts:
        if artifacts is not None and a["name"] not in artifacts:
            continue
        _check_files(d, a["files"], f"artifact {a['name']!r}", deep)
        if expect_fingerprint and expect_fingerprint not in (a.get("fingerprint"), a.get("kv_fingerprint")):
            raise BundleError(f"bundle {d}: artifact {a['name']!r} is model {str(a.get('fingerprint'))[:12]}, "
                              f"expected {expect_fingerprint[:12]}; it was exported from other weights")
        if expect_tokenizer and a.get("tokenizer_fingerprint") not in (None, expect_tokenizer):
            raise BundleError(f"bundle {d}: artifact {a['name']!r} was made with another tokenizer")
        if a["backend"] == "onnx":
            fp = _onnx_fingerprint(d / a["files"][0]["path"])
            if fp != a.get("kv_fingerprint"):
                raise BundleError(f"bundle {d}: graph {a['files'][0]['path']} says fingerprint {str(fp)[:12]}, "
                                  f"the manifest {str(a.get('kv_fingerprint'))[:12]}: the file belongs to another "
                                  "export; re-export the bundle")
    return man


def _manifest(directory) -> dict:
    """A resolved bundle's manifest (read when it was resolved), else read here."""
    return directory.manifest if isinstance(directory, ResolvedModel) and directory.is_bundle \
        else read_manifest(directory)


def _torch_dtype(dtype):
    import torch
    if dtype is None or not isinstance(dtype, str):
        return dtype or torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}[dtype]
    except KeyError:
        raise EngineError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or float64") from None


def _torch_engine(m: ResolvedModel, dtype, threads, max_len, fingerprint, device=None) -> Engine:
    from edge.engines.torch_engine import TorchEngine
    device = None if device in (None, "auto") else device    # auto: the CPU (edge/engines/placement.py decides)
    if m.format == "sun":
        from edge.model.sun_modules import load_module  # a SUN decoder / prefill module directory
        model, man = load_module(m.path, dtype=_torch_dtype(dtype), manifest=m.manifest)
        fp = fingerprint or man.get("fingerprint") or man.get("decoder_fingerprint", "")
        return TorchEngine(model, fingerprint=fp, max_len=max_len, threads=threads, device=device)
    from edge.model.checkpoint import load_model
    model, ckpt = load_model(m, dtype=_torch_dtype(dtype))
    return TorchEngine(model, fingerprint=fingerprint or ckpt.fingerprint, max_len=max_len, threads=threads,
                       device=device)


def load_engine(model, backend: str = "auto", role: Optional[str] = None, dtype=None,
                threads: Optional[int] = None, max_len: Optional[int] = None, device: str = "auto",
                artifact: Optional[str] = None, deep_check: bool = True,
                expect_fingerprint: Optional[str] = None, **kw) -> Engine:
    """An Engine for a ResolvedModel (or a bundle, .onnx, .gguf, HF/SUN directory or model name,
    resolved here with `backend` and `role`).

    backend: torch | onnx | llamacpp | auto (edge/model/resolved.py's auto_backend: a bundle's
    artifact for the role; .onnx -> onnx; .gguf -> llamacpp if installed else torch; else torch).
    role: draft | target | prefill | decoder, used to pick a bundle artifact.
    dtype: torch backend only (float32 default). device: onnx (auto | cpu | cuda | tensorrt) and
    torch (cpu, cuda, cuda:N; auto = cpu); llama.cpp takes n_gpu_layers in kw (edge/engines/
    placement.py's Placement.engine_kwargs() gives each backend's). kw go to the backend's engine.
    """
    m = as_resolved(model, backend, role, artifact)
    if m.is_bundle:
        return _from_bundle(m, threads, max_len, device, deep_check, expect_fingerprint, kw)
    if m.backend == "onnx":
        if m.format != "onnx":
            raise EngineError(f"the onnx backend needs an .onnx graph or a bundle, got {m.ref}; "
                              "export one with `edge-export onnx`")
        from edge.engines.onnx_engine import OnnxEngine
        eng = OnnxEngine(m.path, device=device, threads=threads, max_len=max_len, **kw)
    elif m.backend == "llamacpp":
        if m.format != "gguf" or not m.path.is_file():
            raise EngineError(f"the llamacpp backend needs a .gguf file or a bundle, got {m.ref}; "
                              "write one with `edge-export gguf`")
        from edge.engines.llamacpp_engine import LlamaCppEngine
        eng = LlamaCppEngine(m.path, threads=threads, max_len=max_len or 1024, **kw)
    else:
        eng = _torch_engine(m, dtype, threads, max_len, kw.pop("fingerprint", None), device)
    if expect_fingerprint and eng.fingerprint != expect_fingerprint:
        raise EngineError(f"{m.ref} is model {eng.fingerprint[:12]}, expected {expect_fingerprint[:12]}")
    return eng


def open_model(model, backend: Optional[str] = None, role: Optional[str] = None, dtype=None,
               threads: Optional[int] = None, max_len: Optional[int] = None, tokenizer=None,
               **kw) -> Tuple[Engine, "Tokenizer"]:
    """(engine, tokenizer) of a ResolvedModel on its backend (or a model name or path, resolved here
    on `backend`, torch when not given, for `role`); tokenizer: its tokenizer, when the caller read
    it already (not read again).

    Raises ModelNotFound (no such path or name), CheckpointError (an unreadable
    checkpoint) or EngineError (the backend cannot serve it); each message says
    what to do, so a command line only has to show it."""
    m = as_resolved(model, backend or ("auto" if isinstance(model, ResolvedModel) else "torch"), role)
    # the tokenizer first: building a Qwen vocabulary from GGUF metadata peaks ~0.25 GB above what
    # it keeps (measured here), and that transient must not stack on top of the loaded weights
    tok = tokenizer if tokenizer is not None else open_tokenizer(m)
    engine = load_engine(m, dtype=dtype, threads=threads, max_len=max_len, **kw)
    return engine, tok


def open_tokenizer(model) -> Optional["Tokenizer"]:
    """The tokenizer of a ResolvedModel: a bundle's own (None when it carries none), else the
    checkpoint's (edge/model/checkpoint_files.py; torch-free)."""
    m = as_resolved(model)
    if m.is_bundle:
        return bundle_tokenizer(m)
    from edge.model.checkpoint_files import load_tokenizer
    return load_tokenizer(m)


def _from_bundle(m: ResolvedModel, threads, max_len, device, deep, expect, kw) -> Engine:
    a = m.artifact                      # picked for (role, backend) where the model was resolved
    validate_bundle(m, deep=deep, expect_fingerprint=expect, artifacts=[a["name"]])
    main = m.path / a["files"][0]["path"]
    if a["backend"] == "onnx":
        from edge.engines.onnx_engine import OnnxEngine
        eng = OnnxEngine(main, device=device, threads=threads, max_len=max_len,
                         fingerprint=a.get("kv_fingerprint"), **kw)
    else:
        from edge.engines.llamacpp_engine import LlamaCppEngine
        eng = LlamaCppEngine(main, threads=threads, max_len=max_len or 1024,
                             fingerprint=a.get("kv_fingerprint") or a.get("fingerprint"), **kw)
    eng.model_fingerprint = a.get("fingerprint")
    eng.artifact = a
    return eng


def bundle_tokenizer(directory):
    """The tokenizer a bundle carries (edge.model.tokenizer.Tokenizer), or None."""
    if not _manifest(directory).get("tokenizer"):
        return None
    from edge.model.tokenizer import Tokenizer
    return Tokenizer.from_hf_dir(Path(directory))


def list_artifacts(directory) -> List[dict]:
    return list(_manifest(directory).get("artifacts") or [])
