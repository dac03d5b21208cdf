"""The shape of a bundle's manifest.json, checked before any field is used.

A bundle is copied onto a device from elsewhere, so its manifest is input: every field the
loader, the planner and the roles read (edge/engines/loader.py's docstring has the format)
must have the type they assume, and every file path must stay inside the bundle -- a path
like "../../etc/shadow" or "/dev/zero" would make the device hash, size or load a file that
is not part of the bundle. `manifest_problem` names the first thing wrong, or None.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any, Optional

BACKENDS = ("onnx", "gguf")
MAX_ARTIFACTS = 1024
MAX_FILES = 4096


MANIFEST = "manifest.json"
BUNDLE_FORMAT = "starsun-bundle"


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
