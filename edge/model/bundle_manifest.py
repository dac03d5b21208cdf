"""A bundle's manifest.json: read and checked before any field is used (`read_manifest`), and
the artifact that serves a role on a backend (`pick_artifact`).

A bundle is copied onto a device from elsewhere, so its manifest is input: every field the
loader, the planner and the roles read (edge/engines/loader.py's docstring has the format)
must have the type they assume, and every file path must stay inside the bundle -- a path
like "../../etc/shadow" or "/dev/zero" would make the device hash, size or load a file that
is not part of the bundle. `manifest_problem` names the first thing wrong, or None.

A command reads a bundle's manifest once, where it resolves the model (edge/model/resolved.py);
what it hands down carries the parsed manifest.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from edge.model.errors import EngineError

BACKENDS = ("onnx", "gguf")
MAX_ARTIFACTS = 1024
MAX_FILES = 4096


MANIFEST = "manifest.json"
BUNDLE_FORMAT = "starsun-bundle"
BUNDLE_VERSION = 1
# the backend that runs each artifact kind
ARTIFACT_BACKEND = {"onnx": "onnx", "gguf": "llamacpp"}


class BundleError(EngineError):
    """A bundle that is missing, malformed, corrupted, or not what the caller expects."""


def is_bundle(p: Path) -> bool:
    """Whether a path is a bundle directory (an unreadable manifest counts: read_manifest says what is wrong)."""
    p = Path(p)
    if not (p.is_dir() and (p / MANIFEST).is_file()):
        return False
    try:
        man = json.loads((p / MANIFEST).read_text())
    except (ValueError, RecursionError):
        return True
    return not isinstance(man, dict) or man.get("format") == BUNDLE_FORMAT


def _file_problem(f: Any, where: str) -> Optional[str]:
    if not isinstance(f, dict):
        return f"{where} must be an object with path, bytes and sha256"
    path, size, sha = f.get("path"), f.get("bytes"), f.get("sha256")
    if not isinstance(path, str) or not path or "\0" in path or "\\" in path:
        return f"{where}.path must be a non-empty relative path"
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or path.startswith("~"):
        return f"{where}.path {path[:80]!r} points outside the bundle"
    if type(size) is not int or size < 0:
        return f"{where}.bytes must be a non-negative integer"
    if not isinstance(sha, str):
        return f"{where}.sha256 must be a string"
    return None


def _files_problem(files: Any, where: str) -> Optional[str]:
    if not isinstance(files, list) or not files or len(files) > MAX_FILES:
        return f"{where}.files must be a list of 1..{MAX_FILES} files"
    for i, f in enumerate(files):
        bad = _file_problem(f, f"{where}.files[{i}]")
        if bad:
            return bad
    return None


def _optional_str(a: dict, key: str) -> bool:
    return a.get(key) is None or isinstance(a.get(key), str)


def _artifact_problem(a: Any, where: str) -> Optional[str]:
    if not isinstance(a, dict):
        return f"{where} must be an object"
    if not isinstance(a.get("name"), str) or not a["name"]:
        return f"{where}.name must be a non-empty string"
    where = f"artifact {a['name'][:60]!r}"
    if a.get("backend") not in BACKENDS:
        return f"{where}: backend must be one of {', '.join(BACKENDS)}"
    roles = a.get("roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        return f"{where}: roles must be a list of role names"
    for key in ("graph", "quant", "fingerprint", "kv_fingerprint", "decoder_fingerprint",
                "tokenizer_fingerprint", "sun", "task"):
        if not _optional_str(a, key):
            return f"{where}: {key} must be a string"
    for key in ("config", "memory"):
        if a.get(key) is not None and not isinstance(a[key], dict):
            return f"{where}: {key} must be an object"
    return _files_problem(a.get("files"), where)


def manifest_problem(man: Any) -> Optional[str]:
    """What is wrong with a manifest's structure (format and version are the caller's), or None."""
    if not isinstance(man, dict):
        return f"the manifest must be a JSON object, not {type(man).__name__}"
    tok = man.get("tokenizer")
    if tok is not None:
        if not isinstance(tok, dict) or not _optional_str(tok, "fingerprint"):
            return "tokenizer must be null or an object with files and a fingerprint"
        bad = _files_problem(tok.get("files"), "tokenizer")
        if bad:
            return bad
    arts = man.get("artifacts", [])
    if not isinstance(arts, list) or len(arts) > MAX_ARTIFACTS:
        return f"artifacts must be a list of at most {MAX_ARTIFACTS} artifacts"
    names = set()
    for i, a in enumerate(arts):
        bad = _artifact_problem(a, f"artifacts[{i}]")
        if bad:
            return bad
        if a["name"] in names:
            return f"artifact {a['name'][:60]!r} is listed twice"
        names.add(a["name"])
    return None


def read_manifest(directory) -> dict:
    """A bundle's manifest, its format, version and structure checked (a BundleError says what is wrong)."""
    d = Path(directory)
    p = d / MANIFEST
    if not p.is_file():
        raise BundleError(f"{d} is not a bundle (no {MANIFEST}); make one with `edge-export bundle`")
    return parse_manifest(p, p.read_bytes())


def parse_manifest(p: Path, data: bytes) -> dict:
    """read_manifest of a manifest.json's bytes already read (`p` names it in errors)."""
    try:
        man = json.loads(data.decode("utf-8"))      # UnicodeDecodeError is a ValueError
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


def role_artifacts(man: dict, role: Optional[str] = None) -> list:
    """The artifacts that serve `role` (any role: all), those made for it (graph == role) first."""
    arts = sorted(man.get("artifacts") or [], key=lambda a: a.get("graph") != role)
    return [a for a in arts if not role or role in a.get("roles", ())]


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
    for a in role_artifacts(man, role):
        if not backend or ARTIFACT_BACKEND.get(a["backend"]) == backend:
            return a
    have = "; ".join(f"{a['name']} ({ARTIFACT_BACKEND.get(a['backend'])}, roles {','.join(a.get('roles', ()))})"
                     for a in arts)
    raise BundleError(f"{directory} has no artifact for role={role or 'any'} backend={backend or 'any'}; "
                      f"it has: {have}")
