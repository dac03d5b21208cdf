"""Many emulated StarSD targets in a few processes, for the load test, the soak and benchmarks/load/load.py.

    python -m harness.load_targets SPEC.json      (TargetFleet below starts them, from the repository root)

Each target is the REAL target code (StarTarget: join, DraftRequest/DraftResponse over MQTT,
greedy verification) on harness/emulated_target.py's EmulatedEngine, with its own MQTT
connection, as a device would have. Processes keep the targets' Python off the draft
service's GIL. Per generation a target records what the load checks need:

* the committed sequence S (prompt + output) and, per draft answer, the context length L its
  request named with the proposed tokens: the draft's proposals must be its own greedy
  continuation of S[:L] (harness/load_star.py checks them against the model);
* the round trip of every answer (DraftResponse or Error), and the error codes with one
  message each (the reason a refusal gave).

Protocol with the parent, one line each on stdout: READY (all connected), HOLDING {json}
(hold=True: every target is inside its first generation's session, at its first token,
waiting), RESULT {json}. On stdin: GO (start), RELEASE (leave the hold), STOP (finish the
current generation and stop; duration_s does the same on its own).
"""
from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]     # the repository: `-m harness.load_targets` runs from it

from edge.wire.protocol import DraftResponse, Error
from edge.star.hub_client import HubClient, Session

LATENCIES_KEPT = 4096          # per target: a soak must not grow the worker without bound


class _RecordingSession(Session):
    def request(self, seq: int, keep: int, append, *rest, **options) -> bool:
        # the rest (γ, sampling, background, p_min, ...) goes on as given: only the send time is ours
        self.hub.sent[(self.sid, seq)] = (time.monotonic(), keep + len(append))
        return super().request(seq, keep, append, *rest, **options)


class RecordingHubClient(HubClient):
    """A HubClient that records, per answer, (generation, context length named, proposals)."""

    def __init__(self, *a, record: bool = True, **kw):
        super().__init__(*a, **kw)
        self.record = record
        self.gen = 0                                   # the generation the next session belongs to
        self.sent: Dict[tuple, tuple] = {}             # (sid, seq) -> (sent at, context length)
        self.sid_gen: Dict[str, int] = {}
        self.records: Dict[int, List[tuple]] = {}      # generation -> [(L, tokens)]
        self.latencies: deque = deque(maxlen=LATENCIES_KEPT)
        self.answers = 0
        self.errors: Counter = Counter()
        self.messages: Dict[str, str] = {}             # error code -> one message (the reason)

    session_type = _RecordingSession

    def _open_session(self, j, epoch, home: str = "") -> Session:
        s = super()._open_session(j, epoch, home)
        with self._lock:
            self.sid_gen[s.sid] = self.gen
        return s

    def _forget(self, s: Session) -> None:
        super()._forget(s)
        with self._lock:                               # requests it never got answers to
            for k in [k for k in self.sent if k[0] == s.sid]:
                del self.sent[k]
            self.sid_gen.pop(s.sid, None)

    def _on_down(self, topic: str, payload: bytes) -> None:
        msg = self.keys.open(topic, payload, self.vocab_size)
        if msg is None or not isinstance(msg, (DraftResponse, Error)):
            return
        now = time.monotonic()
        with self._lock:
            sent = self.sent.pop((msg.sid, msg.seq), None)
            gen = self.sid_gen.get(msg.sid)
        if sent is not None:
            self.latencies.append(now - sent[0])
            self.answers += 1
            if isinstance(msg, Error):
                self.errors[msg.code] += 1
                self.messages.setdefault(msg.code, msg.message)
            elif self.record and msg.tokens and gen is not None:
                self.records.setdefault(gen, []).append((sent[1], [int(t) for t in msg.tokens]))
        s = self.sessions.get(msg.sid)
        if s is not None:
            s._deliver(msg)


class _Hold:
    """The first token of every target's first generation waits here until RELEASE."""

    def __init__(self, n: int, on_all) -> None:
        self.n, self.on_all = n, on_all
        self.arrived = 0
        self.lock = threading.Lock()
        self.released = threading.Event()

    def arrive(self, wait: bool = True) -> None:
        with self.lock:
            self.arrived += 1
            last = self.arrived == self.n
        if last:
            self.on_all()
        if wait:
            self.released.wait(300)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _open_targets(spec: dict, timing, delayer) -> list:
    """(index, StarTarget) of each emulated target, its link delayed by the network's round trip."""
    from harness.emulated_target import DelayLink, EmulatedEngine
    from edge.wire.link import MqttLink
    from edge.star.target import StarTarget
    targets = []
    for i in range(spec["first"], spec["first"] + spec["n"]):
        link = DelayLink(MqttLink(spec["url"], client_id=f"{spec['prefix']}{i}-{os.getpid()}").connect(30),
                         timing.net_rtt_ms, delayer)
        hub = RecordingHubClient(link, f"{spec['prefix']}{i}", spec["tokenizer_fp"], spec["vocab_size"],
                                 record=spec.get("record", True))
        engine = EmulatedEngine(timing, spec["alpha"], spec["vocab_size"], seed=spec.get("seed", 0) * 100003 + i)
        targets.append((i, StarTarget(engine, hub, gamma=spec["gamma"], join_timeout=spec.get("join_timeout", 30.0))))
    return targets


def _generation(star, spec: dict, prompt, on_token) -> dict:
    """One closed-loop generation: each answer waited for (bounded: a lost QoS 0 message cannot
    stall it); what it recorded."""
    from edge.star.target import Deadline
    from edge.speculative.sampling import GREEDY
    dl = Deadline(initial=spec.get("deadline_s", 30.0), lo=spec.get("deadline_s", 30.0),
                  hi=spec.get("deadline_s", 30.0))
    res = star.generate(prompt, spec["max_new"], GREEDY, on_token=on_token, deadline=dl)
    d = star.last_drafter
    return {"S": list(prompt) + list(res.tokens) if spec.get("record", True) else None,
            "accepted": res.n_accepted, "drafted": res.n_drafted,
            "refusal": d.refusal, "stats": {k: v for k, v in d.stats.as_dict().items()
                                            if isinstance(v, (int, float))}}


def run(spec: dict, commands: "queue.Queue[str]") -> dict:
    from harness.emulated_target import DeviceTiming, _Delayer
    from edge.star.target import StarTarget

    n = spec["n"]
    timing = DeviceTiming.from_dict(spec["timing"])
    delayer = _Delayer()
    targets = _open_targets(spec, timing, delayer)
    stop = threading.Event()
    t_end = time.monotonic() + spec["duration_s"] if spec.get("duration_s") else None

    def holding() -> None:
        held = sum(1 for _, t in targets if t.last_drafter and t.last_drafter.session is not None)
        refusals = [t.last_drafter.refusal for _, t in targets if t.last_drafter and t.last_drafter.refusal]
        _say("HOLDING " + json.dumps({"held": held, "refusals": refusals}))
    hold = _Hold(n, holding) if spec.get("hold") else None
    out: Dict[int, dict] = {}

    def target_loop(i: int, star: StarTarget) -> None:
        gens, err, arrived = [], None, [False]
        try:
            g = 0
            while not stop.is_set() and (not spec.get("generations") or g < spec["generations"]):
                if t_end is not None and time.monotonic() >= t_end:
                    break
                prompt = spec["prompts"][(i + g) % len(spec["prompts"])]
                star.hub.gen = g

                def on_token(_tok, g=g):
                    if hold is not None and g == 0 and not arrived[0]:
                        arrived[0] = True
                        hold.arrive()
                gens.append(_generation(star, spec, prompt, on_token))
                g += 1
        except Exception as e:  # reported in RESULT and on stderr, never hidden
            err = f"{type(e).__name__}: {e}"
            sys.stderr.write(f"target {i}: {traceback.format_exc()}")
            if hold is not None and not arrived[0]:
                arrived[0] = True              # counted, so the others' hold ends (HOLDING shows it short)
                hold.arrive(wait=False)
        h = star.hub
        out[i] = {"index": i, "client": h.client, "error": err,
                  "generations": gens if spec.get("record", True) else len(gens),
                  "records": {str(k): v for k, v in h.records.items()},
                  "latencies": list(h.latencies), "answers": h.answers,
                  "errors": dict(h.errors), "messages": h.messages}

    _say("READY")
    while commands.get() != "GO":
        pass
    threads = [threading.Thread(target=target_loop, args=(i, t), daemon=True) for i, t in targets]
    for t in threads:
        t.start()

    def commands_loop() -> None:
        while True:
            c = commands.get()
            if c == "RELEASE" and hold is not None:
                hold.released.set()
            elif c == "STOP":
                stop.set()
                if hold is not None:
                    hold.released.set()
    threading.Thread(target=commands_loop, daemon=True).start()
    for t in threads:
        t.join()
    flushed = threading.Event()                   # the last byes still sit in the network delay
    delayer.later(timing.net_rtt_ms / 2e3 + 0.05, flushed.set)
    flushed.wait(10)
    for _, star in targets:
        star.hub.link.close()
    return {"targets": [out[i] for i, _ in targets]}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    commands: "queue.Queue[str]" = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("STOP")                       # the parent is gone: stop
    threading.Thread(target=read_stdin, daemon=True).start()
    res = run(spec, commands)
    _say("RESULT " + json.dumps(res))
    os._exit(0)      # daemon threads (paho, the delayer) must not hold the exit


# ---- the parent's side ------------------------------------------------------------------------

def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)    # 1 = PR_SET_PDEATHSIG


class TargetFleet:
    """`n` targets split over `procs` worker processes; `spec` as `run` reads it (without n/first)."""

    def __init__(self, spec: dict, n: int, procs: int, workdir: Path):
        self.workdir = Path(workdir)
        self.procs: List[subprocess.Popen] = []
        self.lines: List["queue.Queue[str]"] = []
        self.specs = []
        per = [n // procs + (k < n % procs) for k in range(procs)]
        first = 0
        for m in (p for p in per if p):
            self.specs.append({**spec, "n": m, "first": first})
            first += m

    def start(self, timeout: float = 120.0) -> "TargetFleet":
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for k, spec in enumerate(self.specs):
            path = self.workdir / f"load-targets-{os.getpid()}-{k}.json"
            path.write_text(json.dumps(spec))
            err = open(self.workdir / f"load-targets-{k}.err", "wb")
            p = subprocess.Popen([sys.executable, "-m", "harness.load_targets", str(path)], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                 preexec_fn=_die_with_parent)
            err.close()
            q: "queue.Queue[str]" = queue.Queue()
            threading.Thread(target=lambda p=p, q=q: [q.put(ln.strip()) for ln in p.stdout] and None,
                             daemon=True).start()
            self.procs.append(p)
            self.lines.append(q)
        self.expect("READY", timeout)
        return self

    def send(self, word: str) -> None:
        for p in self.procs:
            p.stdin.write(word + "\n")
            p.stdin.flush()

    def expect(self, word: str, timeout: float) -> List[str]:
        """The rest of the line `word` from every process (raises with their stderr if one dies)."""
        end, got = time.monotonic() + timeout, []
        for k, q in enumerate(self.lines):
            while True:
                try:
                    line = q.get(timeout=max(0.01, end - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(f"target worker {k}: no {word} within {timeout:g} s\n{self.stderr(k)}")
                if line.startswith(word):
                    got.append(line[len(word):].strip())
                    break
        return got

    def holding(self, timeout: float = 120.0) -> dict:
        parts = [json.loads(s) for s in self.expect("HOLDING", timeout)]
        return {"held": sum(p["held"] for p in parts), "refusals": [r for p in parts for r in p["refusals"]]}

    def results(self, timeout: float = 600.0) -> List[dict]:
        out = [json.loads(s) for s in self.expect("RESULT", timeout)]
        return [t for r in out for t in r["targets"]]

    def stderr(self, k: int) -> str:
        try:
            return (self.workdir / f"load-targets-{k}.err").read_text()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


if __name__ == "__main__":
    main()
