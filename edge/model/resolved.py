"""What a model is, decided once where a command (or the hub's config, a config file, provisioning)
first sees it: `resolve(ref, backend, role)` -> ResolvedModel.

A ResolvedModel says what the user wrote, the file or directory it names (edge/model/reference.py
finds it), its format (gguf | onnx | hf | sun | bundle), a bundle's or SUN module's manifest
(read once, here), the id it is shown by (a name, never a path), and the backend it runs on with
the reason: `--backend auto` becomes one by `auto_backend`, the one rule for it. Everything below
the door (placement, the memory plan, the loader, the tokenizer, provisioning) takes the value
and never resolves the name or reads the manifest again. It is also a path (os.PathLike), so
code that only opens its files takes it as it took a path.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Optional, Sequence, Tuple

from edge.model import bundle_manifest, reference
from edge.model.bundle_manifest import ARTIFACT_BACKEND, BUNDLE_FORMAT, MANIFEST, BundleError
from edge.model.errors import EngineError

if TYPE_CHECKING:
    from edge.model.shape import ModelShape

BACKENDS = ("torch", "onnx", "llamacpp")
FORMATS = ("gguf", "onnx", "hf", "sun", "bundle")
ROLES = ("draft", "target", "prefill", "decoder")
# the module each backend's runtime is imported as
RUNTIMES = {"torch": "torch", "onnx": "onnxruntime", "llamacpp": "llama_cpp"}
# suffixes a display id drops (what /v1/models shows: "qwen.Q4_K_M", not the file's path)
_ID_SUFFIXES = (".gguf", ".onnx", ".safetensors", ".pt", ".bin")


def installed_backends() -> frozenset:
    """The backends whose runtime this Python can import (found, not imported: no torch is loaded)."""
    return frozenset(b for b, mod in RUNTIMES.items() if importlib.util.find_spec(mod) is not None)


def auto_backend(fmt: str, installed: Collection[str], artifacts: Sequence[str] = ()) -> Tuple[str, str]:
    """THE rule for `--backend auto`: (backend, why) for a model of format `fmt` where the backends
    `installed` can run. artifacts: a bundle's backends for the role, in the order it lists them.

    A bundle runs its first artifact for the role whose runtime is installed (else its first); an
    .onnx graph runs on onnxruntime; a GGUF on llama.cpp where llama-cpp-python is installed, else
    on torch (which dequantises it); a Hugging Face checkpoint or a SUN module on torch."""
    if fmt == "bundle":
        for b in artifacts:
            if b in installed:
                return b, f"the bundle's {b} artifact for the role"
        if not artifacts:
            raise BundleError("the bundle has no artifact for the role")
        return artifacts[0], f"the bundle's first artifact for the role ({RUNTIMES[artifacts[0]]} is not installed)"
    if fmt == "onnx":
        return "onnx", "an .onnx graph runs on onnxruntime"
    if fmt == "gguf":
        if "llamacpp" in installed:
            return "llamacpp", "a .gguf runs on llama.cpp (llama-cpp-python is installed)"
        if "torch" in installed:
            return "torch", "a .gguf without llama-cpp-python installed: torch dequantises it"
        return "llamacpp", "a .gguf runs on llama.cpp (install llama-cpp-python)"
    if fmt in ("hf", "sun"):
        return "torch", ("a SUN module directory runs on torch" if fmt == "sun"
                         else "a Hugging Face checkpoint runs on torch")
    raise ValueError(f"unknown model format {fmt!r}; one of {', '.join(FORMATS)}")


@dataclass(frozen=True)
class ResolvedModel:
    """A model as a command resolved it: read it, never re-resolve it."""
    ref: str                    # what was written: a model name of edge.model.fetch or a path
    path: Path                  # the file or directory it names
    format: str                 # gguf | onnx | hf | sun | bundle
    name: str                   # the id it is shown by: a fetch name, a file's stem, a directory's name
    backend: str = ""           # torch | onnx | llamacpp: as given, or what auto_backend chose
    reason: str = ""            # why that backend (the start line prints it)
    role: Optional[str] = None  # the role the backend (a bundle's artifact) was chosen for
    manifest: Optional[dict] = field(default=None, compare=False, repr=False)   # a bundle's / SUN module's
    artifact: Optional[dict] = field(default=None, compare=False, repr=False)   # a bundle's, for (role, backend)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def is_bundle(self) -> bool:
        return self.format == "bundle"

    @cached_property
    def shape(self) -> "ModelShape":
        """Dimensions and stored bytes (edge/model/shape.py), read from the files at first use."""
        from edge.model.shape import shape_of
        return shape_of(self)

    def choose(self, backend: str = "auto", role: Optional[str] = None, artifact: Optional[str] = None,
               installed: Optional[Collection[str]] = None) -> "ResolvedModel":
        """The same model on `backend` for `role` (auto: by auto_backend); a bundle's artifact picked
        from the manifest already read. installed: the backends to count as installed (default:
        this Python's; provisioning passes what the device will get)."""
        if backend not in BACKENDS + ("auto",):
            raise EngineError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
        if role is not None and role not in ROLES:
            raise EngineError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        if backend == "auto" and artifact is None:
            have = installed_backends() if installed is None else installed
            backend, why = auto_backend(self.format, have, self._role_backends(role))
        else:
            why = f"--backend {backend}" if backend != "auto" else f"the bundle's artifact {artifact!r}"
        art = self._artifact(role, None if backend == "auto" else backend, artifact)
        if art is not None and backend == "auto":
            backend = ARTIFACT_BACKEND[art["backend"]]
        return replace(self, backend=backend, reason=why, role=role, artifact=art)

    def _role_backends(self, role: Optional[str]) -> list:
        if not self.is_bundle:
            return []
        arts = bundle_manifest.role_artifacts(self.manifest, role)
        if not arts:                     # pick_artifact's error names what the bundle has
            bundle_manifest.pick_artifact(self.manifest, role=role, directory=self.path)
        return list(dict.fromkeys(ARTIFACT_BACKEND[a["backend"]] for a in arts))

    def _artifact(self, role, backend, name) -> Optional[dict]:
        if not self.is_bundle:
            return None
        if backend == "torch":
            raise BundleError(f"{self.path} is a bundle of exported artifacts (onnx / gguf); the torch backend "
                              "loads checkpoints: pass the checkpoint (a prefill worker over adapters: the shared "
                              "decoder's directory and --adapter TASK=DIR), or choose --backend onnx or llamacpp")
        return bundle_manifest.pick_artifact(self.manifest, role=role, backend=backend, name=name,
                                             directory=self.path)


def resolve(ref, backend: str = "auto", role: Optional[str] = None, artifact: Optional[str] = None,
            installed: Optional[Collection[str]] = None) -> ResolvedModel:
    """What `ref` (a name of edge.model.fetch or a path) is, on `backend` for `role`: the one place
    a model is resolved. Raises ModelNotFound, BundleError or EngineError, each saying what to do."""
    if isinstance(ref, ResolvedModel):
        return as_resolved(ref, backend, role, artifact)
    return identify(ref).choose(backend, role, artifact, installed)


def as_resolved(model, backend: str = "auto", role: Optional[str] = None,
                artifact: Optional[str] = None) -> ResolvedModel:
    """A ResolvedModel as it is (or re-chosen, from what it holds, for another backend or role);
    a plain name or path resolved here: the compatibility of the library's entry points."""
    if not isinstance(model, ResolvedModel):
        return resolve(model, backend, role, artifact)
    if backend in ("auto", model.backend) and role in (None, model.role) and artifact in (
            None, (model.artifact or {}).get("name")):
        return model
    if backend != "auto" or not model.backend:
        return model.choose(backend, role or model.role, artifact)
    return replace(model.choose(model.backend, role or model.role, artifact), reason=model.reason)


def identify(ref) -> ResolvedModel:
    """Where `ref` points and what is there (its manifest read once); no backend chosen yet."""
    p = reference.resolve_model(ref)
    fmt, manifest = _format(p)
    if fmt == "hf" and p.is_file():             # config.json names its directory
        p = p.parent
    return ResolvedModel(str(ref), p, fmt, _display_id(ref, p), manifest=manifest)


def _format(p: Path) -> Tuple[str, Optional[dict]]:
    if p.is_dir():
        m = p / MANIFEST
        if not m.is_file():
            return "hf", None
        data = m.read_bytes()
        try:
            man = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            man = None                          # unreadable: parse_manifest says what is wrong
        if not isinstance(man, dict) or man.get("format") == BUNDLE_FORMAT:
            return "bundle", bundle_manifest.parse_manifest(m, data)
        return ("sun", man) if "config" in man else ("hf", None)
    if p.suffix == ".onnx":
        return "onnx", None
    if p.suffix == ".gguf" or _magic(p) == b"GGUF":
        return "gguf", None
    if p.name == "config.json":
        return "hf", None
    raise EngineError(f"{p} is neither a GGUF file (no 'GGUF' magic), an .onnx graph, a bundle nor a model "
                      "directory (Hugging Face or SUN)")


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


def _display_id(ref, p: Path) -> str:
    """A fetch name as written; else the file's stem or the directory's name (never a path)."""
    from edge.model.fetch import MODELS
    if str(ref) in MODELS and not Path(str(ref)).exists():
        return str(ref)
    name = (p.parent if p.name == "config.json" else p).resolve().name
    for suffix in _ID_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name
