"""What a fault run is made of: a Fault (name, kind, run), the Outcome it reports, and the Bench
that gives every fault the live namespace star (harness/netns_star.py), its no-fault outputs and
throughput, and the helpers that measure a fault (generate, score, partition, recovery).
benchmarks/faults/faults.py runs the faults of benchmarks/lib/faults_{network,process,hostile}.py.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

PROMPTS = {"t1": "the the he", "t2": "he the t"}
SUN_PROMPTS = [[5, 17, 99, 3, 42, 7], [200, 11, 64, 8]]
REQUEST_TIMEOUT = 60.0


@dataclass
class Outcome:
    happened: str
    tokens: int = 0                     # tokens the faulted clients asked for
    tokens_lost: int = 0
    forged_accepted: Optional[int] = None   # None: the fault forges nothing
    recovery_s: Optional[float] = None      # None: nothing to recover from
    tok_s: Optional[float] = None           # the faulted target's throughput during the fault
    max_request_s: float = 0.0              # the slowest request (each had REQUEST_TIMEOUT)
    extra: dict = field(default_factory=dict)


@dataclass
class Fault:
    name: str
    kind: str                           # network | process | attack
    run: Callable[["Bench"], Outcome]
    needs_sun: bool = False


class Bench:
    """The live star, its no-fault outputs and throughput, and helpers that measure a fault."""

    def __init__(self, star, requests: int, max_new: int, partition_s: float) -> None:
        self.star, self.requests, self.max_new, self.partition_s = star, requests, max_new, partition_s
        self.refs: Dict[str, str] = {}
        self.base_tok_s: Dict[str, float] = {}
        self.sun = None
        self.long_partition_s = 0.0

    def baseline(self) -> None:
        for host in PROMPTS:
            rs = [self.star.complete(host, PROMPTS[host], self.max_new, REQUEST_TIMEOUT) for _ in range(self.requests + 1)]
            texts = {r["text"] for r in rs}
            if len(texts) != 1:
                raise RuntimeError(f"{host}: greedy outputs differ with no fault at all: {texts}")
            self.refs[host] = rs[0]["text"]
            rs = rs[1:]                                  # the first request warms up the session
            self.base_tok_s[host] = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)

    def generate(self, hosts=("t1",), n: Optional[int] = None) -> List[dict]:
        """n requests on each host, hosts concurrently; failures (timeouts) come back as errors."""
        out: List[dict] = []
        lock = threading.Lock()

        def one(h):
            for _ in range(n or self.requests):
                try:
                    r = self.star.complete(h, PROMPTS[h], self.max_new, REQUEST_TIMEOUT)
                except Exception as e:  # a timeout: every token of it lost
                    r = {"text": None, "tokens": 0, "seconds": REQUEST_TIMEOUT, "error": repr(e)}
                with lock:
                    out.append({**r, "host": h})
        ts = [threading.Thread(target=one, args=(h,)) for h in hosts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    def score(self, results: List[dict], happened: str, focus: str = "t1", **kw) -> Outcome:
        lost = sum(self.max_new for r in results if r["text"] != self.refs[r["host"]])
        mine = [r for r in results if r["host"] == focus and r["text"] is not None]
        tok_s = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine) if mine else None
        errors = [r["error"] for r in results if "error" in r]
        differ = sum(r["text"] != self.refs[r["host"]] for r in results)
        happened += (f"; {differ} of {len(results)} outputs differ from the no-fault run" if differ else
                     f"; all {len(results)} outputs identical to the no-fault run")
        return Outcome(happened + (f"; errors: {errors}" if errors else ""), tokens=self.max_new * len(results),
                       tokens_lost=lost, tok_s=tok_s, max_request_s=max(r["seconds"] for r in results), **kw)

    def partition(self, host: str, seconds: float, load=("t1", "t2")) -> tuple:
        """Pull `host`'s cable for `seconds`, generating on `load` meanwhile: (results, healed at)."""
        lab = self.star.lab
        t0 = time.monotonic()
        with lab.partitioned(self.star.hosts[host]):
            results = self.generate(load, n=1)
            while time.monotonic() - t0 < seconds:
                results += self.generate(load, n=1)
        return results, time.monotonic()

    def recovery(self, hosts, since: float) -> Optional[float]:
        times = [self.star.recovery(h, PROMPTS[h], 8, since, timeout=90) for h in hosts]
        return None if None in times else max(times)
