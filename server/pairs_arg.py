"""`edge-hub plan`'s tables given on the command line: '1=40,2=45.5' -> {1: 40.0, 2: 45.5}
(--draft-step, --verify-cost, --hub-call-ms)."""
from __future__ import annotations

import click


def pairs_arg(spec: str, what: str, form: str = "K=VALUE") -> dict:
    """spec's K=VALUE pairs (K whole, VALUE a number); what: the option, for the error, which says
    to write `form` pairs."""
    out = {}
    for kv in (x for x in spec.split(",") if x.strip()):
        k, sep, v = kv.partition("=")
        try:
            out[int(k)] = float(v)
        except ValueError:
            sep = ""
        if not sep:
            raise click.BadParameter(f"{kv!r}: write {form} pairs separated by commas", param_hint=what)
    return out
