"""A bundle's LoRA adapters: the manifest's "adapters" list, checked before any adapter is loaded.

export/bundle.py's `add_adapter` writes one entry per SUN task beside the bundle's artifacts:

    "adapters": [{"task": "tools", "format": "gguf-lora", "rank": 8, "ranks": [8], "alpha": 16.0,
                  "targets": ["q", "k", "v", "o"], "layers": 30, "arch": "llama",
                  "base": "<artifact name>", "base_fingerprint": "...",
                  "files": [{"path": "adapters/tools/adapter.gguf", "bytes": ..., "sha256": ...},
                            {"path": "adapters/tools/adapter_config.json", ...},
                            {"path": "adapters/tools/adapter_model.safetensors", ...}]}]

The first file is the GGUF LoRA llama.cpp loads; the PEFT files beside it serve torch. A device
checks every file's size and sha256 (as for artifacts) and refuses a tampered adapter; one bad
adapter does not stop the others from being listed or loaded.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from edge.engines.loader import BundleError, _check_files, _manifest
from edge.engines.lora_gguf import AdapterError
from edge.model.bundle_manifest import _files_problem

ADAPTERS = "adapters"
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")   # also a directory name in the bundle


def _entry_problem(a, i: int) -> Optional[str]:
    if not isinstance(a, dict):
        return f"adapters[{i}] must be an object"
    task = a.get("task")
    if not isinstance(task, str) or not TASK_NAME.match(task):
        return f"adapters[{i}].task must be a task name (letters, digits, _ . -)"
    if a.get("format") != "gguf-lora":
        return f"adapter {task!r}: format must be gguf-lora"
    if type(a.get("rank")) is not int or a["rank"] <= 0:
        return f"adapter {task!r}: rank must be a positive integer"
    if not isinstance(a.get("targets"), list) or not all(isinstance(t, str) for t in a["targets"]):
        return f"adapter {task!r}: targets must be a list of module names"
    return _files_problem(a.get("files"), f"adapter {task!r}")


def adapter_entries(directory) -> List[dict]:
    """The bundle's adapter entries, their form checked (files are not read here); a ResolvedModel's
    from the manifest it read (check_adapters reads the file again: adapters are added at run time)."""
    d = Path(directory)
    entries = _manifest(directory).get(ADAPTERS) or []
    if not isinstance(entries, list):
        raise BundleError(f"{d}: the manifest's adapters must be a list; re-export the bundle")
    seen = set()
    for i, a in enumerate(entries):
        bad = _entry_problem(a, i)
        if bad:
            raise BundleError(f"{d}: {bad}; re-copy the bundle or re-run `edge-export adapter --bundle`")
        if a["task"] in seen:
            raise BundleError(f"{d}: adapter {a['task']!r} is listed twice")
        seen.add(a["task"])
    return entries


def check_adapters(directory, deep: bool = True, tasks: Optional[Sequence[str]] = None) -> List[dict]:
    """Entries of `tasks` (default all) whose files are present with the recorded size and sha256
    (deep; sizes only otherwise); a BundleError names the first adapter that is not."""
    d = Path(directory)
    entries = adapter_entries(d)
    if tasks is not None:
        have = {a["task"] for a in entries}
        missing = [t for t in tasks if t not in have]
        if missing:
            raise BundleError(f"{d} has no adapter for {', '.join(missing)} (it has: {', '.join(sorted(have)) or 'none'})")
        entries = [a for a in entries if a["task"] in tasks]
    for a in entries:
        _check_files(d, a["files"], f"adapter {a['task']!r}", deep)
    return entries


def adapter_file(directory, entry: dict) -> Path:
    """The GGUF LoRA file of an adapter entry."""
    return Path(directory) / entry["files"][0]["path"]


def load_bundle_adapters(adapters, directory, tasks: Optional[Sequence[str]] = None,
                         deep: bool = True) -> Dict[str, str]:
    """Load a bundle's adapters (all, or `tasks`) into `adapters` (an edge.engines.llamacpp_lora.
    LlamaCppAdapters) under their task names, each checked first (sizes, sha256, base). Returns
    {task: why} for the ones refused; the others load and serve."""
    refused: Dict[str, str] = {}
    base_fp = getattr(adapters.engine, "model_fingerprint", None)   # set when the engine came from a bundle
    for a in adapter_entries(directory):
        if tasks is not None and a["task"] not in tasks:
            continue
        try:
            check_adapters(directory, deep=deep, tasks=[a["task"]])
            if base_fp and a.get("base_fingerprint") and a["base_fingerprint"] != base_fp:
                raise AdapterError(f"adapter {a['task']!r} was made for base {a['base_fingerprint'][:12]}, "
                                   f"this engine runs {base_fp[:12]}")
            adapters.load(a["task"], adapter_file(directory, a))
        except (AdapterError, BundleError) as e:
            refused[a["task"]] = str(e)
    return refused
