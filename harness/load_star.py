"""The StarSD side of the load: ONE real draft service (a tiny float64 llama on the torch engine)
inside the real hub, on a broker the caller started, and N emulated targets
(harness/load_targets.py) in a few processes. Used by tests/system/test_load.py, the soak
(tests/system/test_load_soak.py) and benchmarks/load/load.py.

`LoadStar.run` starts the targets, optionally holds them once every one is inside its
session (then asks for `extra_joins` more sessions, which the full service must refuse),
releases them, samples the service's table, queues and KV while they run, and returns it all
with the targets' records. `check_proposals` replays every answer against the draft model:
greedy proposals must be the model's own continuation of the context the request named.

`WaitCountingDraftService` is the real draft core with one more count: how many of its steps
began between a request's arrival and its answer. Every step takes everything pending, so
that is 1; a request passed over (starved) would count more.
"""
from __future__ import annotations

import tempfile
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from harness.emulated_target import DeviceTiming
from harness.load_monitor import Monitor, rss_mb
from harness.load_targets import TargetFleet
from edge.engines.torch_engine import TorchEngine
from edge.wire.link import MqttLink
from edge.wire.protocol import sampling
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient, JoinRefused
from server.hub import Hub

TOK = "tok-tiny"
VOCAB = 256


class WaitCountingDraftService(DraftService):
    """DraftService + `waited`: steps begun between each answered request's arrival and its answer."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps_begun = 0
        self.waited: Counter = Counter()
        self._arrivals: Dict[str, tuple] = {}       # sid -> (seq, steps begun at arrival)

    def submit(self, req, received=None) -> None:
        super().submit(req, received)
        self._arrivals[req.sid] = (req.seq, self.steps_begun)

    def step(self):
        self.steps_begun += 1
        replies = super().step()
        for sid, msg in replies:
            a = self._arrivals.get(sid)
            if a is not None and a[0] == getattr(msg, "seq", None):
                del self._arrivals[sid]
                self.waited[self.steps_begun - a[1]] += 1
        return replies

    def close(self, sid: str, reason: str = "bye") -> bool:
        self._arrivals.pop(sid, None)
        return super().close(sid, reason)


def draft_model():
    from harness.tiny_models import tiny_model
    return tiny_model(1)


def prompts(k: int, seed: int = 0) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(6, 17))).tolist() for _ in range(k)]


@dataclass
class LoadConfig:
    n: int = 256                      # targets, one session each at a time
    procs: int = 4                    # worker processes they are spread over
    max_sessions: int = 256           # the draft service's --max-sessions
    max_kv_mb: float = 1024.0         # ... and --max-kv-mb (the KV the engine allocates)
    ahead: bool = True                # draft-ahead in idle time
    gamma: int = 3
    max_new: int = 40
    generations: int = 1              # per target (0: until duration_s)
    duration_s: Optional[float] = None
    hold: bool = True                 # hold every target inside its first session, probe the limit
    extra_joins: int = 8              # joins asked for while held: past max_sessions, refused
    record: bool = True               # record proposals for check_proposals
    alpha: float = 0.7                # emulated acceptance
    profile: str = "jetson-orin-nano-8gb"
    time_scale: float = 0.25          # emulated device time x this (a fast test)
    net_rtt_ms: float = 2.0
    seed: int = 0
    every_s: float = 0.05             # monitor period


@dataclass
class LoadRun:
    config: LoadConfig
    targets: List[dict]
    held: Optional[dict]              # at the hold: sessions the targets held, their refusals
    sessions_at_hold: int
    extra: List[Optional[str]]        # per extra join: the refusal's reason (None: accepted)
    stats: dict                       # the draft service's DraftStats snapshot
    waited: Dict[int, int]
    monitor: Monitor = field(repr=False)

    def summary(self) -> dict:
        return {"config": asdict(self.config), "held": self.held, "sessions_at_hold": self.sessions_at_hold,
                "extra": self.extra, "stats": self.stats, "waited": self.waited}


class LoadStar:
    """The hub + draft service on `url`; `run` as often as wanted (one run at a time)."""

    def __init__(self, url: str, limits: DraftLimits, model=None, workdir: Optional[Path] = None):
        self.url = url
        self.model = model if model is not None else draft_model()
        self.engine = TorchEngine(self.model, "draft")
        self.service = WaitCountingDraftService(self.engine, limits, name="hub-draft")
        self.hub = Hub(broker_url=url, draft_core=self.service, tokenizer_fp=TOK, sun=False).start()
        self.node = self.hub.node
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ss-load-"))

    def close(self) -> None:
        self.hub.stop()

    def probes(self) -> Dict[str, Callable[[], float]]:
        svc, node, eng = self.service, self.node, self.engine
        return {"sessions": lambda: len(svc.sessions()), "pending": svc.pending, "backlog": node.loop.backlog,
                "kv_mb": lambda: svc.kv_bytes() / 1e6, "kv_alloc_mb": lambda: eng.kv_bytes() / 1e6,
                "engine_seqs": lambda: eng.active_sequences, "registry": self.hub.registry.count,
                "keys": lambda: len(node.keys._keys), "arrivals": lambda: len(svc._arrivals),
                "rss_mb": rss_mb}

    def drained(self) -> bool:
        """Nothing left: no session, request, reply, KV or key (closed sessions' KV freed)."""
        return (not self.service.sessions() and self.service.pending() == 0 and self.node.loop.backlog() == 0
                and self.engine.active_sequences == 0 and self.hub.registry.count() == 0
                and not self.service._arrivals and len(self.node.keys._keys) == 0)

    def spec(self, c: LoadConfig) -> dict:
        timing = DeviceTiming.from_profile(c.profile, net_rtt_ms=c.net_rtt_ms, time_scale=c.time_scale)
        return {"url": self.url, "prefix": f"load{c.seed}-", "tokenizer_fp": TOK, "vocab_size": VOCAB,
                "gamma": c.gamma, "max_new": c.max_new, "prompts": prompts(64, c.seed),
                "generations": c.generations, "duration_s": c.duration_s, "hold": c.hold, "record": c.record,
                "timing": timing.to_dict(), "alpha": c.alpha, "seed": c.seed}

    def run(self, c: LoadConfig, extra_probes: Optional[Dict[str, Callable[[], float]]] = None,
            during: Callable[[], None] = lambda: None) -> LoadRun:
        """One load: targets start together, (hold: probe the limit), run to the end; `during` runs
        once they are released (the soak starts its SUN load there)."""
        self.service.stats.reset()
        self.service.waited.clear()
        fleet = TargetFleet(self.spec(c), c.n, c.procs, self.workdir)
        held, at_hold, extra = None, 0, []
        try:
            fleet.start()
            with Monitor({**self.probes(), **(extra_probes or {})}, c.every_s) as mon:
                fleet.send("GO")
                if c.hold:
                    held = fleet.holding(timeout=300)
                    at_hold = len(self.service.sessions())
                    extra = self.extra_joins(c.extra_joins, c.seed)
                    fleet.send("RELEASE")
                during()
                targets = fleet.results(timeout=(c.duration_s or 0) + 600)
                from harness.waiting import wait_until
                wait_until(self.drained, 30)
        finally:
            fleet.close()
        return LoadRun(c, targets, held, at_hold, extra, self.service.stats.snapshot(),
                       dict(self.service.waited), mon)

    def extra_joins(self, k: int, seed: int = 0) -> List[Optional[str]]:
        """k more clients ask for a session at once; each one's refusal reason (None if admitted)."""
        out: List[Optional[str]] = [None] * k
        links = [MqttLink(self.url, client_id=f"extra{seed}-{i}").connect(10) for i in range(k)]
        hubs = [HubClient(ln, f"extra{seed}-{i}", TOK, VOCAB).start() for i, ln in enumerate(links)]

        def join(i: int) -> None:
            try:
                hubs[i].join(3, sampling(), 30).close()
                out[i] = None
            except JoinRefused as e:
                out[i] = e.reason
            except TimeoutError as e:
                out[i] = f"timeout: {e}"
        threads = [threading.Thread(target=join, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for ln in links:
            ln.close()
        return out


def check_proposals(targets: List[dict], model) -> tuple:
    """(answers checked, mismatches): each answer's tokens against the draft model's greedy
    continuation of the context its request named (teacher-forced: one forward per answer)."""
    eng = TorchEngine(model, "check")
    checked, bad = 0, []
    for t in targets:
        for g, gen in enumerate(t["generations"]):
            S = gen["S"]
            for L, toks in t["records"].get(str(g), []):
                seq = eng.new_sequence()
                try:
                    rows = eng.forward(seq, S[:L] + toks[:-1])
                finally:
                    eng.free(seq)
                want = [int(x) for x in rows[L - 1:L - 1 + len(toks)].argmax(-1)]
                checked += 1
                if want != toks:
                    bad.append({"client": t["client"], "generation": g, "L": L, "got": toks, "want": want})
    return checked, bad
