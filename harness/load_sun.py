"""The SUN side of the load: a mixed pool of task specialists and ONE shared decoder under many
concurrent requests, on a broker the caller started. Used by tests/system/test_load.py, the
soak and benchmarks/load/load.py.

Real parts, each on its own MQTT link: the router (server/sun_router.py), one prefill worker
per task (a specialist of a tiny float64 base), one shared decoder node with its limits
(`max_batch` rows per engine step, `max_pending_mb` of KV in transit, `max_sequences`
running + waiting) and a few clients. The reference for every answer is the one-process
split generation (edge.model.sun_modules.split_generate).

`RowCountingDecoder` is the real SharedDecoder with one more count: how many of its steps
passed between a request's admission (or its last row) and its next row. Round-robin over the
running sequences bounds that by ceil(load / max_batch); a starved request would exceed it.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge.engines.torch_engine import TorchEngine
from edge.wire.link import MqttLink
from edge.wire.protocol import sun_hello_topic
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.sun.client import SunClient, SunRequestError
from edge.sun.worker_limits import DEFAULT_MAX_SEQUENCES
from edge.model.sun_modules import split_generate, weights_fingerprint
from server.sun_router import SunRouter
from harness.waiting import wait_until

TASKS = ("maths", "code", "tools")
KEY = b"k" * 32                   # the deployment's ctl key
BIG_PROMPT = 400                  # tokens: its float64 KV (~400 KiB) passes a 0.25 MiB max_pending_mb


class RowCountingDecoder(SharedDecoder):
    """SharedDecoder + `gaps`: steps from a request's admission or last row to its next row."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.step_no = 0
        self.max_load = 0                   # running + waiting, at the start of any step
        self.gaps: Counter = Counter()
        self._last: Dict[str, int] = {}

    def admit(self, blob, request_id=None, **kw) -> str:
        rid = super().admit(blob, request_id, **kw)
        if rid not in self.results:        # not finished at once
            self._last[rid] = self.step_no
        return rid

    def step(self):
        self.max_load = max(self.max_load, self.load)
        self.step_no += 1
        events = super().step()
        for e in events:
            last = self._last.get(e.request_id)
            if last is not None and e.finish_reason not in ("context", "error"):   # it got a row
                self.gaps[self.step_no - last] += 1
                self._last[e.request_id] = self.step_no
            if e.done:
                self._last.pop(e.request_id, None)
        return events

    def cancel(self, request_id: str) -> bool:
        self._last.pop(request_id, None)
        return super().cancel(request_id)

    def gap_bound(self) -> int:
        return max(1, math.ceil(self.max_load / self.max_batch))


def sun_models():
    """(base, its fingerprint, {task: specialist}): a tiny float64 base and perturbed prefill modules."""
    from harness.tiny_models import random_model, specialist
    base = random_model()
    return base, weights_fingerprint(base), {t: specialist(base, i + 10) for i, t in enumerate(TASKS)}


def jobs(n: int, seed: int = 0, max_new: Optional[int] = None) -> List[Tuple[str, List[int], int]]:
    """n mixed requests: (task, prompt of 3..12 tokens, max_new 6..16 or the one given), tasks interleaved."""
    rng = np.random.default_rng(seed)
    out = [(TASKS[int(rng.integers(len(TASKS)))], rng.integers(3, 256, size=int(rng.integers(3, 13))).tolist(),
            int(rng.integers(6, 17))) for _ in range(n)]
    return out if max_new is None else [(t, p, max_new) for t, p, _ in out]


def big_jobs(n: int, seed: int = 1) -> List[Tuple[str, List[int], int]]:
    """Requests whose KV alone is more than the decoder may hold in transit."""
    rng = np.random.default_rng(seed)
    return [(TASKS[i % len(TASKS)], rng.integers(3, 256, size=BIG_PROMPT).tolist(), 4) for i in range(n)]


class SunPool:
    def __init__(self, url: str, models=None, max_batch: int = 8, max_pending_mb: float = 0.25,
                 clients: int = 4, chunk_bytes: int = 4096, tasks: Sequence[str] = TASKS,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES):
        self.url = url
        self.base, self.fp, self.specs = models or sun_models()
        self.links: List[MqttLink] = []
        self.nodes: list = []
        self.router = SunRouter(self._link("router").connect(10), ctl_key=KEY).start()
        self.prefills = {t: self._start(f"prefill-{t}", lambda ln, t=t: PrefillNode(
            PrefillWorker(TorchEngine(self.specs[t], fingerprint=self.fp), t, kv_dtype="float64"), ln,
            f"prefill-{t}", KEY, chunk_bytes=chunk_bytes)) for t in tasks}
        self.decoder = RowCountingDecoder(TorchEngine(self.base, fingerprint=self.fp), max_batch=max_batch,
                                          name="dec", max_sequences=max_sequences)
        self.dnode = self._start("dec", lambda ln: DecoderNode(self.decoder, ln, "dec", KEY,
                                                               max_pending_mb=max_pending_mb))
        self.max_pending = self.dnode.max_pending
        self.clients = [SunClient(self._link(f"client{k}").connect(10), f"client{k}").start()
                        for k in range(clients)]
        self._refs: Dict[tuple, List[int]] = {}

    def _link(self, name: str) -> MqttLink:
        ln = MqttLink(self.url, client_id=f"{name}-{os.getpid()}-{len(self.links)}")
        self.links.append(ln)
        return ln

    def _start(self, name: str, make):
        ln = self._link(name)
        node = make(ln)
        ln.set_will(sun_hello_topic(name), node.will())
        ln.connect(10)
        self.nodes.append(node.start())
        if not wait_until(lambda: name in self.router.workers and self.router.workers[name].online, 20):
            raise RuntimeError(f"{name} never came online at the router")
        return node

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        for ln in self.links:
            ln.close()

    def expect(self, task: str, prompt: List[int], max_new: int) -> List[int]:
        """The one-process answer (cached: the soak asks the same requests again)."""
        key = (task, tuple(prompt), max_new)
        if key not in self._refs:
            self._refs[key] = split_generate(self.specs[task], self.base, [prompt], max_new=max_new)[0]
        return self._refs[key]

    def serve(self, todo: Sequence[Tuple[str, List[int], int]], timeout: float = 120.0) -> List[tuple]:
        """Send every request at once (spread over the clients); per request (result, None) or
        (None, SunRequestError). A result's `total_s` is set to its last token's arrival (wait()
        would stamp when it was collected, here one after another)."""
        sent = []
        for i, (t, p, m) in enumerate(todo):
            c, last = self.clients[i % len(self.clients)], [0.0]
            h = c.submit(t, p, max_new=m, on_token=lambda _i, _t, last=last: last.__setitem__(0, time.perf_counter()))
            sent.append((c, h, last))
        out = []
        for c, h, last in sent:
            try:
                r = h.wait(timeout)
                r.total_s = last[0] - h.t0
                out.append((r, None))
            except SunRequestError as e:
                out.append((None, e))
            finally:
                c.forget(h.rid)
        return out

    def probes(self) -> Dict[str, Callable[[], float]]:
        d, n, r = self.decoder, self.dnode, self.router
        return {"dec_pending_bytes": n._pending_bytes, "dec_pending": lambda: len(n._pending),
                "dec_early": lambda: len(n._early), "dec_queued_bytes": lambda: n._queued,
                "dec_backlog": n.loop.backlog, "dec_load": lambda: d.load, "dec_node_load": lambda: n.load,
                "dec_live": lambda: len(n._live),
                "dec_results": lambda: len(d.results), "dec_engine_seqs": lambda: d.engine.active_sequences,
                "router_inflight": lambda: sum(len(v) for v in list(r.inflight.values())),
                "router_prefilling": lambda: sum(len(v) for v in list(r.prefilling.values())),
                "prefill_load": lambda: sum(p.load for p in self.prefills.values()),
                "client_handles": lambda: sum(len(c._handles) for c in self.clients)}

    def drained(self) -> bool:
        """Nothing held anywhere: no KV in transit, no running sequence, no stream, no handle."""
        return all(v() == 0 for v in self.probes().values())

    def rows_per_step(self) -> List[int]:
        return [len(b) for b in self.decoder.batches]


def wrong(pool: SunPool, todo, results) -> List[str]:
    """What differs from the one-process run (empty: every answer is the same greedy output)."""
    out = []
    for (t, p, m), (res, err) in zip(todo, results):
        if err is not None:
            out.append(f"{t} {p[:4]}...: {err}")
        elif res.tokens != pool.expect(t, p, m) or res.workers != [f"prefill-{t}", "dec"]:
            out.append(f"{t} {p[:4]}...: {res.tokens} via {res.workers}, want {pool.expect(t, p, m)}")
    return out


def refusal_codes(results) -> Counter:
    return Counter(err.code for _, err in results if err is not None)


def first_message(results, code: str) -> Optional[str]:
    return next((err.message for _, err in results if err is not None and err.code == code), None)
