"""`edge-hub top`: every device of the star in one table, from their telemetry (server/telemetry_board.py).

One row per client: role, memory, KV, load, temperature, power, tokens/s and per joule,
sessions, acceptance, busy ratio and the age of its last report (a device whose report is
older than three of its intervals is marked stale: it stopped reporting without leaving).
"""
from __future__ import annotations

import sys
import time
from typing import List, Optional, Tuple

from edge.wire.protocol import Telemetry

COLUMNS = ["client", "role", "RSS MB", "KV MB", "CPU%", "GPU%", "temp C", "power W", "tok/s", "tok/J",
           "sess", "accept", "busy", "batch", "age s"]
STALE_INTERVALS = 3


def _num(v: Optional[float], fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def row_cells(m: Telemetry, age: float) -> List[str]:
    kv = "-" if m.kv_budget_mb is None and m.kv_used_mb is None else \
        f"{_num(m.kv_used_mb)}/{_num(m.kv_budget_mb)}"
    stale = m.interval > 0 and age > STALE_INTERVALS * m.interval
    return [m.client, m.role, _num(m.rss_mb), kv, _num(m.cpu_pct), _num(m.gpu_pct), _num(m.temp_c, "{:.1f}"),
            _num(m.power_w, "{:.1f}"), _num(m.tok_s, "{:.1f}"), _num(m.tok_j, "{:.2f}"), str(m.sessions),
            _num(m.acceptance, "{:.2f}"), _num(m.busy, "{:.2f}"),
            f"{_num(m.batch_mean, '{:.1f}')}/{m.batch_max}", f"{age:.1f}" + (" stale" if stale else "")]


def render(rows: List[Tuple[Telemetry, float]], dropped: Optional[dict] = None) -> str:
    """The table as text (fixed-width columns), with a line of dropped reports by reason."""
    cells = [COLUMNS] + [row_cells(m, age) for m, age in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    if not rows:
        lines.append("(no device has reported yet: agents publish with --telemetry-interval SECONDS; with the "
                     "hub's ACL only a hub-role user reads them)")
    if dropped:
        lines.append("dropped reports: " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))
    return "\n".join(lines)


def wait_for_retained(board, timeout: float, quiet: float = 0.5) -> None:
    """Until the broker's retained reports have arrived (they come at once on subscribing):
    `quiet` seconds in which no new device appeared, at most `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if board.received and time.monotonic() - board.last_change >= quiet:
            return
        time.sleep(0.05)


def run_top(board, once: bool, refresh: float, wait: float, out=sys.stdout) -> None:
    wait_for_retained(board, wait)
    if once:
        out.write(render(board.rows(), board.dropped) + "\n")
        out.flush()
        return
    while True:                                      # until Ctrl-C
        out.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S  ") + f"{len(board.rows())} devices\n"
                  + render(board.rows(), board.dropped) + "\n")
        out.flush()
        time.sleep(refresh)
