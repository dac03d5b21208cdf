"""The run's checkpoint: the result JSON itself, cell by cell ("server|model|part")."""
from __future__ import annotations

import fnmatch
import json
import statistics
import threading
from pathlib import Path
from typing import List


class Store:
    """The result JSON, loaded when it exists (a rerun resumes), written atomically after every step."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.data = json.loads(path.read_text()) if path.exists() else {"cells": {}, "servers": {}, "runs": []}

    def cell(self, server: str, model: str, part: str) -> dict:
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
        return gone

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(self.path)


def median_of(xs):
    """The median of the values that were measured (None where a server sent none); None if none were."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
