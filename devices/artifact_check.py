"""What the device will run, checked on the PC before the device is touched: the artifact
(a model file, a bundle, a SUN module directory) exists, is whole, and fits the profile's budget.

The budget check is `edge-agent plan`'s (edge/cli/plan_command.py, edge/memory/fit.py): the same
numbers the agent checks again on the device before it loads (`run --profile`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click

SUN_ROLES = ("prefill", "decoder")


@dataclass
class Artifact:
    kind: str                   # "model" | "bundle" | "module"
    path: Path                  # on the PC (a file or a directory)
    backend: str                # what the agent runs it on (resolved as `edge-agent run` resolves it)
    plan_bytes: int             # the role's peak, as planned
    budget_bytes: Optional[int]
    summary: str                # one line for the progress output

    @property
    def bytes(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else sum(
            p.stat().st_size for p in self.path.rglob("*") if p.is_file())


def _resolve(role: str, model, bundle, module) -> tuple:
    given = [(k, v) for k, v in (("model", model), ("bundle", bundle), ("module", module)) if v]
    if len(given) != 1:
        what = "MODULE=DIR (a SUN specialist or shared decoder)" if role in SUN_ROLES else "MODEL=... or BUNDLE=DIR"
        raise click.UsageError(f"--role {role} needs exactly one artifact: {what}"
                               + (f" (got {', '.join(k.upper() for k, _ in given)})" if given else ""))
    kind, spec = given[0]
    if role in SUN_ROLES and kind == "model":
        raise click.UsageError(f"--role {role} runs a SUN module: give MODULE=DIR (edge-export tune), not MODEL")
    if role not in SUN_ROLES and kind == "module":
        raise click.UsageError(f"--role {role} runs a model: give MODEL=... or BUNDLE=DIR, not MODULE")
    from edge.engines.base import EngineError
    from edge.model.reference import resolve_model
    try:
        path = Path(spec) if kind != "model" else resolve_model(spec)
    except EngineError as e:       # ModelNotFound: the name is neither a path nor a fetched model
        raise click.ClickException(f"MODEL={spec}: {e}") from None
    if not path.exists():
        hint = {"bundle": "make one with `edge-export bundle`", "module": "make one with `edge-export tune`",
                "model": "fetch it with `python -m edge.model.fetch NAME` or give a path"}[kind]
        raise click.ClickException(f"{kind.upper()}={spec}: no such file or directory ({hint})")
    if kind == "bundle":
        from edge.engines.loader import BundleError, validate_bundle
        try:
            validate_bundle(path, deep=False)   # sizes here; the agent checks sha256 on the device
        except BundleError as e:
            raise click.ClickException(f"BUNDLE={spec}: {e}") from None
    return kind, path


def _is_bundle(path: Path) -> bool:
    import json
    from edge.engines.loader import BUNDLE_FORMAT, MANIFEST
    try:
        return path.is_dir() and json.loads((path / MANIFEST).read_text()).get("format") == BUNDLE_FORMAT
    except (OSError, ValueError):
        return False


def _backend(role: str, kind: str, path: Path, backend: str) -> str:
    """The backend `edge-agent run` will use: SUN roles default to torch (a bundle: onnx); a model
    file to what its suffix says; a bundle to the loader's choice."""
    if backend != "auto":
        return backend
    if role in SUN_ROLES:
        return "onnx" if _is_bundle(path) else "torch"
    if kind == "model":
        return "llamacpp" if path.suffix == ".gguf" else "onnx" if path.suffix == ".onnx" else "torch"
    return "auto"


def check_artifact(role: str, profile: str, model=None, bundle=None, module=None, backend: str = "auto",
                   memory_budget: Optional[str] = None, max_len: Optional[int] = None, max_sessions: int = 64,
                   max_batch: int = 64) -> Artifact:
    """The artifact, sized by the planner against the profile (or --memory-budget); a
    click error that says what to change when it is missing or does not fit."""
    from edge.cli.plan_command import GB, budget_bytes, make_plan, refusal
    kind, path = _resolve(role, model, bundle, module)
    b = _backend(role, kind, path, backend)
    budget = budget_bytes(profile, memory_budget)
    f, e = make_plan(role, str(path), budget, b, max_len, max_batch, max_sessions)
    if f is not None and not f.fits:
        where = f"--memory-budget {memory_budget}" if memory_budget else f"profile {profile}"
        raise click.ClickException(refusal(f, where))
    w = e.workload
    summary = (f"{kind} {path.name}: {role} on {w.backend}, {w.context} x {w.sequences} tokens, "
               f"plan {e.total / GB:.2f} GB" + (f" of {f.budget / GB:.2f} GB" if f is not None else ""))
    return Artifact(kind, path, b, e.total, budget, summary)
