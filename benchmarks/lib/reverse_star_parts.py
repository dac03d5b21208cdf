"""What benchmarks/star/reverse_star.py is made of: the hub process, recorded and replayed drafts,
and N drafting devices run at once over the real broker.

The hub is the real `edge-hub serve --verify-model` (Mosquitto, the verify service, its target on
llama.cpp, one thread) in its own process pinned to the hub's core. A device is the real device
code (edge/star/drafting_device.py) over its own MQTT link; only its drafter is emulated for N > 1:
it replays the proposals the real draft made from the same context in the calibration pass (so the
acceptance is the real draft's) and sleeps the real draft's measured step time per token it
proposes (a device with a core of its own). With greedy decoding and a fixed γ the contexts of every
round are the same whatever N is, so every proposal is found; a context not recorded (a near-tie the
batched call decided otherwise) proposes nothing that round, and is counted.
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.lib.server_process import stop_process
from edge.speculative.drafter import Drafter
from edge.speculative.generate import ModelDrafter

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class RecordingDrafter(Drafter):
    """The real draft, each proposal recorded by its context (the calibration pass)."""

    def __init__(self, engine, trace: Dict[tuple, List[int]], step_s: List[float]):
        self.inner, self.trace, self.step_s = ModelDrafter(engine), trace, step_s

    def draft(self, context, gamma, rng):
        t0 = time.perf_counter()
        toks, qs = self.inner.draft(context, gamma, rng)
        if toks:
            self.step_s.append((time.perf_counter() - t0) / len(toks))
        self.trace[tuple(context)] = list(toks)
        return toks, qs

    def close(self) -> None:
        self.inner.close()


class ReplayDrafter(Drafter):
    """The recorded proposals for the same context, taking the real draft's step time per token."""

    def __init__(self, trace: Dict[tuple, List[int]], step_s: float, misses: List[int]):
        self.trace, self.step_s, self.misses = trace, step_s, misses

    def draft(self, context, gamma, rng):
        toks = self.trace.get(tuple(context))
        if toks is None:
            self.misses.append(len(context))
            return [], None
        toks = toks[:gamma]
        time.sleep(self.step_s * len(toks))        # the device's own drafting, on its own core
        return toks, None


class HubProcess:
    """`edge-hub serve --mosquitto --verify-model TARGET`, pinned to `core`, stats every second."""

    def __init__(self, target: Path, port: int, core: Optional[int], workdir: Path, max_sessions: int,
                 backend: str = "llamacpp", dtype: str = "bfloat16"):
        self.err_path = workdir / "hub.err"
        args = [str(BIN / "edge-hub"), "serve", "--mosquitto", "--port", str(port), "--verify-model", str(target),
                "--verify-backend", backend, "--threads", "1", "--max-len", "1024",
                "--max-sessions", str(max_sessions), "--max-gamma", "16", "--evict-after", "600",
                "--stats-every", "1", "--telemetry-interval", "0"] + (["--dtype", dtype] if backend == "torch" else [])
        if core is not None:
            args = ["taskset", "-c", str(core)] + args
        self.err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.err,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.url = f"mqtt://127.0.0.1:{port}"

    def wait_up(self, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if "serving on" in self.text():
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"the hub exited:\n{self.text()[-3000:]}")
            time.sleep(0.5)
        raise SystemExit(f"the hub did not come up in {timeout:.0f} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return self.err_path.read_text(errors="replace")

    def verify_stats(self) -> dict:
        """The last stats line's verify part: requests and the mean batch."""
        m = re.findall(r"verify: sessions=(\d+) requests=(\d+) batch=([\d.]+) accept=([\d.]+)", self.text())
        if not m:
            return {}
        s, r, b, a = m[-1]
        calls = re.findall(r"verify: .* calls=(\S+)", self.text())
        busy = re.findall(r"verify: .* busy_s=([\d.]+)", self.text())
        steps = {int(k): (int(n), float(ms)) for k, n, ms in re.findall(r"(\d+):(\d+)x([\d.]+)ms", calls[-1])} \
            if calls else {}
        # the serving hub's own batched verify calls (cumulative over the run): {sessions: (calls, mean ms)}
        return {"sessions": int(s), "requests": int(r), "batch_mean": float(b), "acceptance": float(a),
                "calls": steps, "busy_s": float(busy[-1]) if busy else None}

    def stop(self) -> None:
        stop_process(self.proc)
        self.err.close()


def make_device(url: str, name: str, fp: str, vocab: int, gamma: int, drafter_of):
    from edge.star.drafting_device import DraftingDevice
    from edge.star.hub_client import HubClient
    from edge.wire.link import MqttLink
    link = MqttLink(url, client_id=name).connect(30)
    return DraftingDevice(None, HubClient(link, name, fp, vocab, role="drafter"), gamma=gamma,
                          join_timeout=30.0, answer_timeout=600.0, drafter_of=drafter_of)


def jobs_of(prompts: list, n: int) -> List[list]:
    """Every N point generates every prompt at least once (the same mix of texts, so the same
    acceptance): device i takes prompts i, i+N, ... of max(N, P) in turn."""
    total = max(n, len(prompts))
    return [[prompts[j % len(prompts)] for j in range(i, total, n)] for i in range(n)]


def run_devices(devices: list, jobs: List[list], new: int, stop_ids: tuple) -> dict:
    """Every device generates its prompts (jobs[i], one after another), all devices at once, job k of
    every device once all finished job k - 1. Rates are of the decode, as the plain baseline's (no
    prompt's prefill in them): a generation's window runs from the last first answer of its job's
    group (every prompt of the group prefilled at the hub by then) to its end, with the tokens
    committed after that. hub tokens/s: the devices' decode rates summed; per-device: the median
    generation's."""
    gens: list = [[] for _ in devices]
    errors: list = []
    start = threading.Barrier(len(devices) + 1)
    # before job k: every device that had job k - 1 has finished it
    turns = [threading.Barrier(sum(len(j) >= k for j in jobs)) for k in range(max(map(len, jobs)) + 1)]

    def one(i: int) -> None:
        start.wait()
        for k, prompt in enumerate(jobs[i]):
            if k:
                turns[k].wait()
            stamps: list = []
            try:
                r = devices[i].generate(prompt, new, stop_ids=stop_ids, on_token=lambda t: stamps.append(
                    time.perf_counter()))
            except Exception as e:  # reported below
                errors.append(repr(e))
                for b in turns:
                    b.abort()
                return
            end = time.perf_counter()
            first = [x for x in stamps if x - stamps[0] < 0.005]        # the first round's tokens
            verify = [t.seconds for t in r.timings if t.kind == "verify"]
            gens[i].append({"result": r, "job": k, "stamps": stamps, "prompt": len(prompt), "first_at": stamps[0],
                            "first_done": first[-1], "end_at": end, "first_round_s": verify[0] if verify else 0.0})
        if len(jobs[i]) < len(turns) - 1 and not errors:
            turns[len(jobs[i])].wait()                            # the others may start their next job
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(devices))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"a device failed: {errors[:3]}")
    return summary(gens, t0, wall)


def summary(gens: list, t0: float, wall: float) -> dict:
    """The point's rates (run_devices' doc) and timeline."""
    group_first: Dict[int, float] = {}
    for g in (g for gs in gens for g in gs):
        group_first[g["job"]] = max(group_first.get(g["job"], 0.0), g["first_done"])
    for g in (g for gs in gens for g in gs):
        t_from = group_first[g["job"]]
        g["decode_tokens"] = sum(1 for x in g["stamps"] if x > t_from)
        g["decode_s"] = g["end_at"] - t_from
    flat = [g for gs in gens for g in gs]
    res = [g["result"] for g in flat]
    tokens, rounds = sum(r.n_generated for r in res), sum(r.n_verify_calls for r in res)
    # each generation's rounds past its first (whose round trip holds the hub's prefill of its prompt)
    rtts = [t.seconds for r in res for t in [x for x in r.timings if x.kind == "verify"][1:]]
    timed = [[g for g in gs if g["decode_s"] > 0 and g["decode_tokens"]] for gs in gens]
    return {"n": len(gens), "wall_s": wall, "tokens": tokens, "generations": len(flat),
            "hub_tps": sum(sum(g["decode_tokens"] for g in gs) / sum(g["decode_s"] for g in gs) for gs in timed if gs),
            "per_device_tps": statistics.median(g["decode_tokens"] / g["decode_s"] for gs in timed for g in gs),
            "drafted": sum(r.n_drafted for r in res), "accepted": sum(r.n_accepted for r in res),
            "rounds": rounds, "rtt_ms_p50": 1e3 * statistics.median(rtts) if rtts else None,
            "tokens_per_round": tokens / rounds if rounds else 0.0,
            # each generation's decode window and its first round (the hub's prefill of its prompt), from t0
            "timeline": [{"device": i, "job": g["job"], "prompt": g["prompt"], "first_at": g["first_at"] - t0,
                          "decode_from": group_first[g["job"]] - t0, "end_at": g["end_at"] - t0,
                          "first_round_s": g["first_round_s"], "decode_tokens": g["decode_tokens"],
                          "tokens": g["result"].n_generated, "rounds": g["result"].n_verify_calls}
                         for i, gs in enumerate(gens) for g in gs]}


def alpha_of(points: List[dict], gamma: int) -> float:
    """Per-token acceptance under the geometric model from tokens per round: E = (1-a^(g+1))/(1-a)."""
    return alpha_for(statistics.median(p["tokens_per_round"] for p in points), gamma)


def prompt_alphas(real: dict, gamma: int) -> Dict[int, float]:
    """Each prompt's own acceptance (keyed by its length), from the calibration pass's generations."""
    by: Dict[int, list] = {}
    for g in real["timeline"]:
        t, r = by.setdefault(g["prompt"], [0, 0])
        by[g["prompt"]] = [t + g["tokens"], r + g["rounds"]]
    return {p: alpha_for(t / r, gamma) for p, (t, r) in by.items() if r}


def alpha_for(e: float, gamma: int) -> float:
    """The acceptance whose expected tokens a round at γ is e."""
    from edge.speculative.verify import expected_tokens
    lo, hi = 0.0, 1.0
    for _ in range(60):                                   # E grows with a: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < e else (lo, mid)
    return (lo + hi) / 2


def pin(core: Optional[int]) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
