"""`edge-agent` whose adapter prefill worker holds its first step open: a burst that outlasts its
clients' silence timeout, played on a tiny model without a slow machine.

    STARSUN_HELD_STEP=DIR STARSUN_HELD_ROWS=N python -m harness.held_prefill_step run --role prefill ...

The worker waits until N prompts are queued, so that its first step takes all of them at once (as
a split SUN worker takes up to 8 rows of a burst), writes DIR/stepping when that step begins, and
finishes the step only once DIR/open exists. The process stays alive and answering meanwhile: its
link thread answers copies of the jobs it holds, its heartbeat says hello while the step runs
(edge/runtime/heartbeat.py), exactly as in a long real step.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from edge.sun.adapter_prefill import AdapterPrefillWorker

POLL_S = 0.02                  # how often the held step looks for DIR/open


def hold_first_step(gate: Path, rows: int) -> None:
    """Patch AdapterPrefillWorker so its first step takes `rows` prompts and waits for gate/open."""
    held = threading.Event()                      # the first step has begun (later steps run freely)
    has_work, prefill = AdapterPrefillWorker.has_work, AdapterPrefillWorker._prefill

    def gathered(self) -> bool:                   # not before the whole burst is queued
        return has_work(self) and (held.is_set() or self.load >= rows)

    def held_open(self, jobs, rules):
        if not held.is_set():
            held.set()
            (gate / "stepping").write_text(f"{len(jobs)}\n")
            while not (gate / "open").exists():   # the test opens it after what it must see
                threading.Event().wait(POLL_S)
        return prefill(self, jobs, rules)

    AdapterPrefillWorker.has_work = gathered
    AdapterPrefillWorker._prefill = held_open


if __name__ == "__main__":
    hold_first_step(Path(os.environ["STARSUN_HELD_STEP"]), int(os.environ["STARSUN_HELD_ROWS"]))
    from edge.cli.agent import main
    main(prog_name="edge-agent")
