"""The synthetic SUN base (export.sun_eval.synthetic_base) trained once and kept, for the test files
that tune on it (tests/conftest.py's sun_table, tests/system/test_sun_demo.py): each trained the
same 600-step base, ~20 s of one core, in its own xdist worker.

It is kept under $STARSUN_CACHE_DIR (~/.cache/starsun)/synthetic-base, named by its arguments,
torch's thread count and version, and the source of every module that trains it (export/,
edge/model/): a change there trains it again. A lock lets one worker train while another waits
for it. What comes back is the trained model's weights, bit for bit, frozen like tune()'s result.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from export.sun_eval import synthetic_base as _train   # bound now: test_sun_demo patches the module's name

_ROOT = Path(__file__).resolve().parents[1]
_SOURCES = ("export", "edge/model")      # synthetic_base, the tasks, tune(), the transformer


def _key(steps: int, seed: int, kw: dict) -> str:
    import numpy
    import torch
    h = hashlib.sha256(json.dumps([steps, seed, sorted(kw.items()), torch.get_num_threads(),
                                   torch.__version__, numpy.__version__]).encode())
    for folder in _SOURCES:
        for src in sorted((_ROOT / folder).rglob("*.py")):
            h.update(str(src.relative_to(_ROOT)).encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:24]


def synthetic_base(steps: int, seed: int = 0, progress: bool = False, **kw):
    """export.sun_eval.synthetic_base(steps, seed, **kw), trained here only when not kept yet."""
    import torch
    from filelock import FileLock

    from edge.model.sun_modules import MANIFEST, load_module, save_module
    root = Path(os.environ.get("STARSUN_CACHE_DIR") or Path.home() / ".cache" / "starsun") / "synthetic-base"
    d = root / f"{steps}-{seed}-{_key(steps, seed, kw)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:                                    # nowhere to keep it: train it here
        return _train(steps=steps, seed=seed, progress=progress, **kw)
    with FileLock(str(d) + ".lock"):
        if not (d / MANIFEST).is_file():
            base = _train(steps=steps, seed=seed, progress=progress, **kw)
            tmp = d.with_name(f"{d.name}.{os.getpid()}.tmp")
            save_module(tmp, base, {"kind": "synthetic-base", "steps": steps, "seed": seed})
            shutil.rmtree(d, ignore_errors=True)
            tmp.replace(d)
            return base
    base = load_module(d, dtype=torch.float32)[0]
    for p in base.parameters():
        p.requires_grad_(False)
    return base
