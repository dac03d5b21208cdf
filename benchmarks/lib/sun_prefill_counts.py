"""How many prefills a SUN cell of benchmarks/sun/sun_vs_multilora.py ran for its requests, read
from its processes' logs after they stopped (issue 45: a split burst once prefilled 31 jobs for 17
requests, its clients having sent requests again under new ids).

* jobs: what the prefill worker says it prefilled (its stats line at exit: "...: {'jobs': N, ...}");
* routed: requests the hub's router routed (its last status line's sun_routed=N): a request sent
  again under a new id is routed again;
* new_ids: the hub's SUN client's "sent again as" lines (a request given a new id after silence);
* redelivered: the router's "sent again by its client" lines (a copy passed on to the workers).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _last_int(pattern: str, text: str) -> Optional[int]:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def prefill_counts(logdir: Path) -> dict:
    """{"jobs", "routed", "new_ids", "redelivered"} from logdir/prefill.err and logdir/hub.err (None: not said)."""
    hub, prefill = _read(logdir / "hub.err"), _read(logdir / "prefill.err")
    return {"jobs": _last_int(r"'jobs': (\d+)", prefill), "routed": _last_int(r"sun_routed=(\d+)", hub),
            "new_ids": hub.count("heard nothing after"), "redelivered": hub.count("sent again by its client")}


def prefill_lines(cells: dict) -> list:
    """One markdown line per SUN cell that counted its prefills: jobs per request sent (the burst plus
    the one warm-up request)."""
    out = []
    for key, c in cells.items():
        p, s = c.get("prefills"), c.get("summary")
        if not (p and s) or p.get("jobs") is None:
            continue
        sent = s["requests"] + 1
        out.append(f"* {key}: {p['jobs']} prefills for {sent} requests ({s['requests']} + the warm-up): "
                   f"{p['jobs'] / sent:.2f} per request; routed {p['routed']}, sent again under a new id "
                   f"{p['new_ids']}, copies passed on to the workers {p['redelivered']}")
    return out
