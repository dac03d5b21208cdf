"""What a hub's router sees, read from the stats lines `edge-hub serve --stats-every S` writes to its
log (server/hub_serve.py `stats_line`): a test waits on this event, not on start-up time.

A SUN router routes to a worker only once the worker answered its probe (server/liveness.py), a
hello or two after the worker came up, so "the worker said hello" does not mean "the router
routes to it": a request sent in between is refused with `no_decoder` / `unknown_task`.
"""
from __future__ import annotations

import re
from typing import Optional

_SUN_WORKERS = re.compile(r"\bsun_workers=(\d+)\b")


def sun_workers(log: str) -> Optional[int]:
    """The SUN workers the router counted online in the log's last stats line that counts them
    (None: no such line yet -- the router has heard of no worker)."""
    found = _SUN_WORKERS.findall(log)
    return int(found[-1]) if found else None
