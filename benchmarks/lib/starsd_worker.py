"""The targets of one StarSD benchmark point, in their own process (the "devices").

    python -m benchmarks.lib.starsd_worker SPEC.json

Runs N targets as threads — emulated (harness/emulated_target.py) or real
(a GGUF on llama.cpp) — in one of three modes: `star` (each joins the hub at
spec["url"] and speculates with the shared draft), `alone` (target-only
decoding) or `colocated` (each with its own draft on the device: emulated).
A separate process keeps the targets' Python off the draft service's GIL,
as real remote devices would be.

Talks to the parent over stdout, one line each:
    READY            every target decodes (star: got its first draft answer)
    START            measurement window opens (after the warm-up)
    STOP             window closed
    RESULT {json}    per-target counts, per-token latencies, overhead samples
`TargetProcess` is the parent's side.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

from benchmarks.lib.results import ROOT
from edge.engines.counting import CountingEngine
from harness.emulated_target import (DelayLink, DeviceTiming, EmulatedDrafter, EmulatedEngine, MeasuringHubClient,
                                     _Delayer)


class _Stop(Exception):
    pass


class Control:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.t_start = float("inf")
        self.t_end = float("inf")


class Runner(threading.Thread):
    """One target generating continuously over its prompts until stopped."""

    def __init__(self, idx: int, gen: Callable, engine, prompts: List[List[int]], max_new: int,
                 ctl: Control):
        super().__init__(name=f"target-{idx}", daemon=True)
        self.idx, self.gen, self.engine, self.prompts = idx, gen, engine, prompts
        self.max_new, self.ctl = max_new, ctl
        self.ready = threading.Event()
        self.stamps: List[tuple] = []           # (time, round id) of every token in the window
        self.before: Optional[float] = None     # last token time before the window
        self.generations = 0
        self.error: Optional[str] = None
        self.mark: Optional[tuple] = None       # engine counters at window start / end

    def on_token(self, _tok: int) -> None:
        if self.ctl.stop.is_set():
            raise _Stop()
        now = time.monotonic()
        self.ready.set()
        if self.ctl.t_start <= now < self.ctl.t_end:
            self.stamps.append((now, self.engine.calls))
        elif now < self.ctl.t_start:
            self.before = now

    def run(self) -> None:
        i = self.idx
        try:
            while not self.ctl.stop.is_set():
                prompt = self.prompts[i % len(self.prompts)]
                i += 1
                self.generations += 1
                self.gen(prompt, self.max_new - len(prompt), self.on_token)
        except _Stop:
            pass
        except Exception as e:  # reported in RESULT, never hidden
            self.error = f"{type(e).__name__}: {e}"
            self.ready.set()

    def counters(self) -> tuple:
        e = self.engine
        return (e.calls, e.drafted, e.accepted, e.plain)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _engines(spec: dict) -> list:
    n = spec["n"]
    if spec.get("real"):
        from edge.engines.llamacpp_engine import LlamaCppEngine
        r = spec["real"]
        threads = r.get("threads") or max(1, (os.cpu_count() or 2) // n)
        return [CountingEngine(LlamaCppEngine(r["model"], max_len=r.get("max_len", 2048), n_seq_max=1,
                                              threads=threads)) for _ in range(n)]
    timing = DeviceTiming.from_dict(spec["timing"])
    return [EmulatedEngine(timing, spec["alpha"], spec["vocab_size"], seed=spec.get("seed", 0) * 1000 + i)
            for i in range(n)]


def _generator(spec: dict, i: int, eng, delayer, stop_ids: tuple):
    """gen(prompt, max_new, on_token) of target i in the spec's mode; through the star also its
    (hub client, link, StarTarget), else None."""
    from edge.speculative.generate import generate_plain, generate_speculative
    from edge.speculative.sampling import GREEDY
    mode, gamma = spec["mode"], spec["gamma"]
    if mode == "star":
        from edge.wire.link import MqttLink
        from edge.star.target import Deadline, StarTarget
        net = 0.0 if spec.get("real") else DeviceTiming.from_dict(spec["timing"]).net_rtt_ms
        # one client at a time: amqtt 0.12.1 can drop a client connecting during another's SUBSCRIBE
        link = DelayLink(MqttLink(spec["url"], client_id=f"emu{i}-{os.getpid()}").connect(10), net, delayer)
        hub = MeasuringHubClient(link, f"dev{i}", spec["tokenizer_fp"], spec["vocab_size"])
        star = StarTarget(eng, hub, gamma=gamma, join_timeout=30.0)
        wait = spec.get("deadline", "wait") == "wait"

        def gen(prompt, max_new, on_token):
            # wait: the planner's closed loop (bounded, so a lost QoS 0 message cannot stall forever)
            dl = Deadline(initial=120.0, lo=120.0, hi=120.0) if wait else None
            return star.generate(prompt, max_new, GREEDY, stop_ids, on_token, deadline=dl)
        return gen, (hub, link, star)
    if mode == "alone":
        return (lambda prompt, max_new, on_token: generate_plain(eng, prompt, max_new, GREEDY, stop_ids,
                                                                  on_token)), None
    if mode == "colocated":
        drafter = EmulatedDrafter(DeviceTiming.from_dict(spec["timing"]), spec["vocab_size"])
        return (lambda prompt, max_new, on_token: generate_speculative(eng, drafter, prompt, max_new, gamma, GREEDY,
                                                                        stop_ids, on_token)), None
    raise ValueError(f"unknown mode {mode!r}")


def run(spec: dict) -> dict:
    mode, n = spec["mode"], spec["n"]
    stop_ids = tuple(spec.get("stop_ids", ()))
    engines = _engines(spec)
    ctl = Control()
    hubs, links, runners, stars = [], [], [], []
    delayer = _Delayer()
    for i, eng in enumerate(engines):
        gen, star_parts = _generator(spec, i, eng, delayer, stop_ids)
        if star_parts is not None:
            hub, link, star = star_parts
            hubs.append(hub)
            links.append(link)
            stars.append(star)
        runners.append(Runner(i, gen, eng, spec["prompts"][i:] + spec["prompts"][:i], spec["max_len"], ctl))
    for r in runners:
        r.start()
    end = time.monotonic() + spec.get("ready_timeout_s", 600)
    for r in runners:
        # ready at the first token committed: past the target's prefill (an emulated 128-token
        # prompt sleeps ~20 s of the device's prefill), so no window holds a prefill the planner
        # does not model; a draft's first answer comes before it
        while time.monotonic() < end and not r.ready.is_set():
            time.sleep(0.05)
    _say("READY")
    time.sleep(spec["warmup_s"])
    marks = [r.counters() for r in runners]
    ctl.t_start, cpu0 = time.monotonic(), time.process_time()
    _say("START")
    time.sleep(spec["seconds"])
    ctl.t_end, cpu1 = time.monotonic(), time.process_time()
    ends = [r.counters() for r in runners]
    _say("STOP")
    ctl.stop.set()
    end = time.monotonic() + spec.get("join_timeout_s", 60)
    for r in runners:                       # each stops at its next token
        r.join(max(0.0, end - time.monotonic()))
    # every target of the point is a thread of this one process (on core 0 with --pin): the CPU
    # it used tells whether the emulated targets' own Python work, not the draft, set the pace
    out = {"mode": mode, "n": n, "window_s": ctl.t_end - ctl.t_start, "targets": [],
           "worker_cpu_s": cpu1 - cpu0}
    for i, r in enumerate(runners):
        c = [b - a for a, b in zip(marks[i], ends[i])]
        t = {"tokens": len(r.stamps), "rounds": c[0], "drafted": c[1], "accepted": c[2], "plain_rounds": c[3],
             "tpot_s": _tpot(r.stamps, r.before), "generations": r.generations, "error": r.error}
        if hubs:
            h = hubs[i]
            t["answers"] = [a[1:] for a in h.answers if ctl.t_start <= a[0] < ctl.t_end]
            d = stars[i].last_drafter
            if d is not None:
                t["drafter"] = {k: v for k, v in d.stats.as_dict().items() if isinstance(v, (int, float))}
        out["targets"].append(t)
    for h in hubs:
        try:
            h.close()          # bye: the draft frees the sessions now, not at eviction
        except Exception:
            pass
    time.sleep(0.2)
    for ln in links:
        ln.close()
    return out


def _tpot(stamps: List[tuple], before: Optional[float]) -> List[float]:
    """Per token: (its round's duration) / (tokens the round committed)."""
    out, prev_t, i = [], before, 0
    while i < len(stamps):
        j = i
        while j < len(stamps) and stamps[j][1] == stamps[i][1]:
            j += 1
        t = stamps[j - 1][0]
        if prev_t is not None:
            out += [(t - prev_t) / (j - i)] * (j - i)
        prev_t, i = t, j
    return out


class TargetProcess:
    """Parent side: start the worker, call back at START / STOP, return RESULT."""

    def __init__(self, spec: dict, workdir: Path):
        self.spec = spec
        self.path = workdir / f"spec-{spec['mode']}-{spec['n']}-{time.monotonic_ns()}.json"
        self.path.write_text(json.dumps(spec))

    def run(self, on_start: Callable[[], None] = lambda: None, on_stop: Callable[[], None] = lambda: None,
            log: Callable[[str], None] = lambda s: None) -> dict:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.lib.starsd_worker", str(self.path)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        errs: list = []
        threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True).start()
        result = None
        try:
            for line in proc.stdout:
                line = line.strip()
                if line == "READY":
                    log("targets ready")
                elif line == "START":
                    on_start()
                elif line == "STOP":
                    on_stop()
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            self.path.unlink(missing_ok=True)
        if result is None:
            tail = "".join(errs[-30:])
            raise RuntimeError(f"the target worker ({self.spec['mode']}, N={self.spec['n']}) died:\n{tail}")
        return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("cpus"):       # the targets' "device" (benchmarks/star/starsd_scaling.py --pin)
        os.sched_setaffinity(0, set(spec["cpus"]))
    res = run(spec)
    _say("RESULT " + json.dumps(res))
    sys.stdout.flush()
    os._exit(0)      # daemon threads (paho, stragglers) must not hold the exit


if __name__ == "__main__":
    main()
