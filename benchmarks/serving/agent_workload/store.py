"""The run's checkpoint: the result JSON itself, cell by cell ("server|model|part")."""
from __future__ import annotations

import fcntl
import fnmatch
import json
import statistics
import threading
from pathlib import Path
from typing import List


class Store:
    """The result JSON, loaded when it exists (a rerun resumes), written atomically after every step.
    Two runs may share one file (say llama-server's BFCL on core 1 beside ours on core 0): each save
    takes a file lock and first adopts what the other wrote (the cells, servers and runs it did not
    write itself), so neither loses the other's cells."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.data = json.loads(path.read_text()) if path.exists() else {"cells": {}, "servers": {}, "runs": []}
        self.mine = set()        # the cells this run wrote or dropped: its own copy wins for these

    def cell(self, server: str, model: str, part: str) -> dict:
        self.mine.add(f"{server}|{model}|{part}")
        return self.data["cells"].setdefault(f"{server}|{model}|{part}", {"done": False})

    def done(self, server: str, model: str, part: str) -> bool:
        return self.data["cells"].get(f"{server}|{model}|{part}", {}).get("done", False)

    def drop(self, patterns: List[str]) -> List[str]:
        """Forget the cells whose key matches one of the shell patterns (they run again); -> their keys.
        A pattern is matched literally except for * and ? (`|` and `[` are not special here)."""
        gone = [k for k in self.data["cells"]
                if any(fnmatch.fnmatchcase(k, p.replace("[", "[[]")) for p in patterns)]
        for k in gone:
            del self.data["cells"][k]
        self.mine.update(gone)
        return gone

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".json.lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self.path.exists():
                    self._adopt(json.loads(self.path.read_text()))
                tmp = self.path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(self.data, indent=1))
                tmp.replace(self.path)

    def _adopt(self, disk: dict) -> None:
        """What another run sharing the file wrote since: its cells, servers, runs and errors."""
        d = self.data
        for key, cell in disk.get("cells", {}).items():
            if key not in self.mine:
                d["cells"][key] = cell
        for key, server in disk.get("servers", {}).items():
            d["servers"].setdefault(key, server)
        for field, ident in (("runs", ("started", "argv")), ("errors", ("at", "error"))):
            ours = d.setdefault(field, [])
            known = {tuple(str(x.get(k)) for k in ident) for x in ours}
            ours[:0] = [x for x in disk.get(field, []) if tuple(str(x.get(k)) for k in ident) not in known]


def median_of(xs):
    """The median of the values that were measured (None where a server sent none); None if none were."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
