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
    backend: str                # what the agent runs it on (edge/model/resolved.py's rule, as `run` applies it)
    plan_bytes: int             # the role's peak, as planned
    budget_bytes: Optional[int]
    summary: str                # one line for the progress output

    @property
    def bytes(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else sum(
            p.stat().st_size for p in self.path.rglob("*") if p.is_file())


def _given(role: str, model, bundle, module) -> tuple:
    """(kind, what was given): exactly one artifact, the kind the role runs."""
    given = [(k, v) for k, v in (("model", model), ("bundle", bundle), ("module", module)) if v]
    if len(given) != 1:
        what = "MODULE=DIR (a SUN specialist or shared decoder)" if role in SUN_ROLES else "MODEL=... or BUNDLE=DIR"
        raise click.UsageError(f"--role {role} needs exactly one artifact: {what}"
                               + (f" (got {', '.join(k.upper() for k, _ in given)})" if given else ""))
    kind, ref = given[0]
    if role in SUN_ROLES and kind == "model":
        raise click.UsageError(f"--role {role} runs a SUN module: give MODULE=DIR (edge-export tune), not MODEL")
    if role not in SUN_ROLES and kind == "module":
        raise click.UsageError(f"--role {role} runs a model: give MODEL=... or BUNDLE=DIR, not MODULE")
    return kind, ref


def resolve_artifact(role: str, kind: str, ref, backend: str = "auto"):
    """The ResolvedModel the device will run (edge/model/resolved.py): `auto` chosen by the agent's
    one rule as if every runtime were installed, since provisioning installs the one it picks (a
    .gguf runs on llama.cpp, a bundle -- SUN ones included -- its artifact for the role, a tuned
    SUN directory or checkpoint on torch)."""
    from edge.engines.base import EngineError
    from edge.model.reference import ModelNotFound
    from edge.model.resolved import BACKENDS, resolve
    if kind != "model" and not Path(ref).exists():
        hint = {"bundle": "make one with `edge-export bundle`", "module": "make one with `edge-export tune`"}[kind]
        raise click.ClickException(f"{kind.upper()}={ref}: no such file or directory ({hint})")
    try:
        return resolve(ref, backend, role, installed=BACKENDS)
    except ModelNotFound as e:       # the name is neither a path nor a fetched model
        raise click.ClickException(f"MODEL={ref}: {e}") from None
    except EngineError as e:         # BundleError: an unreadable manifest, no artifact for the role
        raise click.ClickException(f"{kind.upper()}={ref}: {e}") from None


def check_artifact(role: str, profile: str, model=None, bundle=None, module=None, backend: str = "auto",
                   memory_budget: Optional[str] = None, max_len: Optional[int] = None, max_sessions: int = 64,
                   max_batch: int = 64) -> Artifact:
    """The artifact, sized by the planner against the profile (or --memory-budget); a
    click error that says what to change when it is missing or does not fit."""
    from edge.cli.plan_command import GB, budget_bytes, make_plan, refusal
    kind, ref = _given(role, model, bundle, module)
    m = resolve_artifact(role, kind, ref, backend)
    if kind == "bundle" and not m.is_bundle:
        raise click.ClickException(f"BUNDLE={ref} is not a bundle (no manifest.json); make one with "
                                   "`edge-export bundle`, or give a model file as MODEL=")
    if m.is_bundle:
        from edge.engines.loader import BundleError, validate_bundle
        try:
            validate_bundle(m, deep=False)   # sizes here; the agent checks sha256 on the device
        except BundleError as e:
            raise click.ClickException(f"{kind.upper()}={ref}: {e}") from None
    budget = budget_bytes(profile, memory_budget)
    f, e = make_plan(role, m, budget, max_len, max_batch, max_sessions)
    if f is not None and not f.fits:
        where = f"--memory-budget {memory_budget}" if memory_budget else f"profile {profile}"
        raise click.ClickException(refusal(f, where))
    w = e.workload
    summary = (f"{kind} {m.path.name}: {role} on {w.backend} ({m.reason}), {w.context} x {w.sequences} tokens, "
               f"plan {e.total / GB:.2f} GB" + (f" of {f.budget / GB:.2f} GB" if f is not None else ""))
    return Artifact(kind, m.path, m.backend, e.total, budget, summary)
