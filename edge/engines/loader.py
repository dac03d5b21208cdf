"""One place every role and CLI gets an Engine: `load_engine(path, backend=...)`, and
`open_model(spec, ...)` -> (engine, tokenizer), the one place a model name becomes an engine.

`path` may be a bundle directory (manifest.json from `edge-export bundle`), an
.onnx graph, a .gguf file, a Hugging Face directory, a SUN module directory or
a model name of edge.model.fetch. A bundle is validated before anything is loaded:
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
import json
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from edge.engines.base import Engine, EngineError
from edge.model.bundle_manifest import BUNDLE_FORMAT, MANIFEST, is_bundle, manifest_problem
from edge.model.reference import resolve_model

if TYPE_CHECKING:
    from edge.model.tokenizer import Tokenizer

BUNDLE_VERSION = 1
BACKENDS = ("torch", "onnx", "llamacpp")
ROLES = ("draft", "target", "prefill", "decoder")
# which artifact kinds serve which backend
_ARTIFACT_BACKEND = {"onnx": "onnx", "gguf": "llamacpp"}


class BundleError(EngineError):
    """A bundle that is missing, malformed, corrupted, or not what the caller expects."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def read_manifest(directory) -> dict:
    d = Path(directory)
    p = d / MANIFEST
    if not p.is_file():
        raise BundleError(f"{d} is not a bundle (no {MANIFEST}); make one with `edge-export bundle`")
    try:
        man = json.loads(p.read_text())
    except (ValueError, RecursionError) as e:     # RecursionError: nested too deep to parse
        raise BundleError(f"{p} is not valid JSON ({str(e)[:200] or type(e).__name__}); re-copy the bundle "
                          "or re-run `edge-export bundle`") from None
    if not isinstance(man, dict) or man.get("format") != BUNDLE_FORMAT:
        man = man if isinstance(man, dict) else {}
        raise BundleError(f"{p} is not a StarSun bundle manifest (format {str(man.get('format'))[:80]!r})")
    if man.get("version") != BUNDLE_VERSION:
        raise BundleError(f"{p} has bundle version {man.get('version')}, this kit reads version "
                          f"{BUNDLE_VERSION}; re-export the bundle with this kit's `edge-export bundle`")
    bad = manifest_problem(man)
    if bad:
        raise BundleError(f"{p} is malformed: {bad}; re-copy the bundle or re-run `edge-export bundle`")
    return man


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
    man = read_manifest(d)
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


def pick_artifact(man: dict, role: Optional[str] = None, backend: Optional[str] = None,
                  name: Optional[str] = None, directory="bundle") -> dict:
    """The artifact for a name, or the first that serves (role, backend)."""
    arts = man.get("artifacts") or []
    if name is not None:
        for a in arts:
            if a["name"] == name:
                return a
        raise BundleError(f"{directory} has no artifact {name!r} (it has: {', '.join(a['name'] for a in arts)})")
    # a graph made for the role (prefill, decoder) before a general "model" graph
    for a in sorted(arts, key=lambda a: a.get("graph") != role):
        if role and role not in a.get("roles", ()):
            continue
        if backend and _ARTIFACT_BACKEND.get(a["backend"]) != backend:
            continue
        return a
    have = "; ".join(f"{a['name']} ({_ARTIFACT_BACKEND.get(a['backend'])}, roles {','.join(a.get('roles', ()))})"
                     for a in arts)
    raise BundleError(f"{directory} has no artifact for role={role or 'any'} backend={backend or 'any'}; "
                      f"it has: {have}")


def _torch_dtype(dtype):
    import torch
    if dtype is None or not isinstance(dtype, str):
        return dtype or torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}[dtype]
    except KeyError:
        raise EngineError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or float64") from None


def _torch_engine(path, dtype, threads, max_len, fingerprint, device=None) -> Engine:
    from edge.engines.torch_engine import TorchEngine
    device = None if device in (None, "auto") else device    # auto: the CPU (edge/engines/placement.py decides)
    p = Path(path)
    if p.is_dir() and (p / "model.safetensors").is_file() and (p / MANIFEST).is_file():
        from edge.model.sun_modules import load_module  # a SUN decoder / prefill module directory
        model, man = load_module(p, dtype=_torch_dtype(dtype))
        fp = fingerprint or man.get("fingerprint") or man.get("decoder_fingerprint", "")
        return TorchEngine(model, fingerprint=fp, max_len=max_len, threads=threads, device=device)
    from edge.model.checkpoint import load_model
    model, ckpt = load_model(path, dtype=_torch_dtype(dtype))
    return TorchEngine(model, fingerprint=fingerprint or ckpt.fingerprint, max_len=max_len, threads=threads,
                       device=device)


def load_engine(path, backend: str = "auto", role: Optional[str] = None, dtype=None,
                threads: Optional[int] = None, max_len: Optional[int] = None, device: str = "auto",
                artifact: Optional[str] = None, deep_check: bool = True,
                expect_fingerprint: Optional[str] = None, **kw) -> Engine:
    """An Engine for a bundle, .onnx, .gguf, HF/SUN directory or model name.

    backend: torch | onnx | llamacpp | auto (a bundle's first artifact for the
    role; .onnx -> onnx; .gguf -> llamacpp if installed else torch; else torch).
    role: draft | target | prefill | decoder, used to pick a bundle artifact.
    dtype: torch backend only (float32 default). device: onnx (auto | cpu | cuda | tensorrt) and
    torch (cpu, cuda, cuda:N; auto = cpu); llama.cpp takes n_gpu_layers in kw (edge/engines/
    placement.py's Placement.engine_kwargs() gives each backend's). kw go to the backend's engine.
    """
    if backend not in BACKENDS + ("auto",):
        raise EngineError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if role is not None and role not in ROLES:
        raise EngineError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
    p = resolve_model(path)
    if is_bundle(p):
        return _from_bundle(p, backend, role, threads, max_len, device, artifact, deep_check,
                            expect_fingerprint, kw)
    if backend == "auto":
        if p.suffix == ".onnx":
            backend = "onnx"
        elif p.suffix == ".gguf":
            backend = "llamacpp" if _has_llamacpp() else "torch"
        else:
            backend = "torch"
    if backend == "onnx":
        if p.suffix != ".onnx":
            raise EngineError(f"the onnx backend needs an .onnx graph or a bundle, got {path}; "
                              "export one with `edge-export onnx`")
        from edge.engines.onnx_engine import OnnxEngine
        eng = OnnxEngine(p, device=device, threads=threads, max_len=max_len, **kw)
    elif backend == "llamacpp":
        if not (p.is_file() and p.suffix == ".gguf"):
            raise EngineError(f"the llamacpp backend needs a .gguf file or a bundle, got {path}; "
                              "write one with `edge-export gguf`")
        from edge.engines.llamacpp_engine import LlamaCppEngine
        eng = LlamaCppEngine(p, threads=threads, max_len=max_len or 1024, **kw)
    else:
        eng = _torch_engine(p, dtype, threads, max_len, kw.pop("fingerprint", None), device)
    if expect_fingerprint and eng.fingerprint != expect_fingerprint:
        raise EngineError(f"{path} is model {eng.fingerprint[:12]}, expected {expect_fingerprint[:12]}")
    return eng


def open_model(spec, backend: str = "torch", role: Optional[str] = None, dtype=None,
               threads: Optional[int] = None, max_len: Optional[int] = None, **kw) -> Tuple[Engine, "Tokenizer"]:
    """(engine, tokenizer) for a model name or path on a backend; role picks a bundle's artifact.

    Raises ModelNotFound (no such path or name), CheckpointError (an unreadable
    checkpoint) or EngineError (the backend cannot serve it); each message says
    what to do, so a command line only has to show it."""
    from edge.model.checkpoint_files import load_tokenizer   # torch-free (edge.model.checkpoint is not)
    p = resolve_model(spec)
    # the tokenizer first: building a Qwen vocabulary from GGUF metadata peaks ~0.25 GB above what
    # it keeps (measured here), and that transient must not stack on top of the loaded weights
    tok = bundle_tokenizer(p) if is_bundle(p) else load_tokenizer(p)
    engine = load_engine(p, backend=backend, role=role, dtype=dtype, threads=threads, max_len=max_len, **kw)
    return engine, tok


def resolve_backend(spec, backend: str = "auto", role: Optional[str] = None) -> str:
    """The backend load_engine would run `spec` on (what `auto` becomes), without loading it:
    placement is decided for that backend before the model loads."""
    if backend != "auto":
        return backend
    p = resolve_model(spec)
    if is_bundle(p):
        return _ARTIFACT_BACKEND[pick_artifact(read_manifest(p), role=role, directory=p)["backend"]]
    if p.suffix == ".onnx":
        return "onnx"
    if p.suffix == ".gguf":
        return "llamacpp" if _has_llamacpp() else "torch"
    return "torch"


def _has_llamacpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def _from_bundle(d: Path, backend, role, threads, max_len, device, artifact, deep, expect, kw) -> Engine:
    man = read_manifest(d)
    want = None if backend in ("auto", "torch") else backend
    if backend == "torch":
        raise BundleError(f"{d} is a bundle of exported artifacts (onnx / gguf); the torch backend loads "
                          "checkpoints: pass the checkpoint, or choose --backend onnx or llamacpp")
    a = pick_artifact(man, role=role, backend=want, name=artifact, directory=d)
    validate_bundle(d, deep=deep, expect_fingerprint=expect, artifacts=[a["name"]])
    main = d / a["files"][0]["path"]
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
    d = Path(directory)
    man = read_manifest(d)
    if not man.get("tokenizer"):
        return None
    from edge.model.tokenizer import Tokenizer
    return Tokenizer.from_hf_dir(d)


def list_artifacts(directory) -> List[dict]:
    return list(read_manifest(directory).get("artifacts") or [])
