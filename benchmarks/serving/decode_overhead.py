"""Where a decoded token's CPU goes in our endpoint decoding alone: llama_decode vs our own work around it.

Issue #44: one request at a time, llama-server decoded the 0.5B Q4_K_M at 11.56 tok/s and ours
(benchmarks/lib/agent_alone_worker.py, the same GGUF through the same llama.cpp) at 10.72. This runs
that endpoint in this process (its `endpoint`, the same options), sends streamed MT-bench chats from a
client process, and times the parts of each generation's decode phase (after its prefill) in thread
CPU seconds, which a busy machine inflates less than wall time: llama_decode itself; copying the
logits rows out of llama.cpp; the engine-call path around them (BatchedCalls at --parallel > 1, the
batch, the sequence bookkeeping); penalties + picking the token; committing it (detokenizing, stop
strings, the SSE chunk written to the socket); the rest of the loop. "concurrent" runs --clients
clients at once and also counts the whole process's CPU (HTTP threads, prefills, templates included)
against llama_decode's. Fractions within one process are the figure; the absolute ms scale with the
load (the 1-minute load average is recorded).

  python -m benchmarks.serving.decode_overhead [--model qwen2.5-coder-0.5b] [--requests 4]
      [--tokens 128] [--parallel 4] [--clients 4] [--out benchmarks/results/decode_overhead/NAME]
Run from the repository root. Writes benchmarks/results/decode_overhead/<variant>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.lib.results import ROOT, result_stem
from edge.telemetry.cpu_info import cpu_name

PARTS = ("llama_decode", "logits rows", "engine calls", "sampling", "commit: SSE chunk", "commit: detok + stop",
         "loop rest")


class Timers:
    """Inclusive thread-CPU timers on named functions, counted only in threads that switched them on."""

    def __init__(self):
        self.acc, self.lock, self.local = collections.Counter(), threading.Lock(), threading.local()
        self.every_decode = 0.0         # llama_decode's CPU in every thread, prefills included

    def wrap_every(self, owner, attr: str) -> None:
        """`attr`'s CPU in every thread into every_decode (and into the on threads' timers as `attr`)."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, **k):
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                d = time.thread_time() - c
                with self.lock:
                    self.every_decode += d
                if getattr(self.local, "on", False):
                    self.local.acc[attr] += d
        setattr(owner, attr, timed)

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, **k):
            if not getattr(self.local, "on", False):
                return fn(*a, **k)
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.local.acc[name] += time.thread_time() - c
        setattr(owner, attr, timed)

    def start(self) -> None:
        self.local.on, self.local.acc, self.local.t0 = True, collections.Counter(), time.thread_time()

    def stop(self, tokens: int) -> None:
        if getattr(self.local, "on", False):
            self.local.on = False
            self.local.acc["decode phase"] += time.thread_time() - self.local.t0
            self.local.acc["tokens"] += tokens
            with self.lock:
                self.acc.update(self.local.acc)


def instrument(timers: Timers) -> None:
    """Timers on the parts (module doc); a generation's decode phase starts when its prefill is done."""
    import llama_cpp
    import edge.api.streamed_answer as answer
    import edge.engines.batched_calls as batched
    import edge.engines.llamacpp_engine as llamacpp
    import edge.speculative.generate as gen
    timers.wrap_every(llama_cpp, "llama_decode")
    timers.wrap(llamacpp.LlamaCppEngine, "_decode", "_decode")
    for cls in (batched.BatchedCalls, llamacpp.LlamaCppEngine):
        for m in ("forward", "forward_last", "forward_tail"):
            if m in vars(cls):
                timers.wrap(cls, m, "engine call")
    timers.wrap(gen, "pick", "pick")
    timers.wrap(gen, "adjust_logits", "adjust")
    timers.wrap(gen._Run, "commit", "commit")
    timers.wrap(answer.StreamedAnswer, "send", "send")
    init, finish = gen._Run.__init__, gen._Run.finish

    def started(run, *a, **k):
        init(run, *a, **k)
        timers.start()

    def finished(run):
        timers.stop(len(run.res.tokens))
        return finish(run)
    gen._Run.__init__, gen._Run.finish = started, finished


def parts_of(acc: collections.Counter) -> dict:
    """Exclusive seconds of each part (PARTS) from the inclusive timers. A nested engine call (BatchedCalls
    around LlamaCppEngine) is counted once: the outer call's time."""
    engine = acc["engine call"] - acc["_decode"]
    return {"llama_decode": acc["llama_decode"], "logits rows": acc["_decode"] - acc["llama_decode"],
            "engine calls": engine, "sampling": acc["adjust"] + acc["pick"], "commit: SSE chunk": acc["send"],
            "commit: detok + stop": acc["commit"] - acc["send"],
            "loop rest": acc["decode phase"] - acc["engine call"] - acc["adjust"] - acc["pick"] - acc["commit"]}


CLIENT = """
import json, sys, threading
from benchmarks.lib.chat_client import chat_stream
from benchmarks.lib.datasets import mtbench_first_turns
url, clients, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts, got = mtbench_first_turns(clients * n), []
def client(i):
    for j in range(n):
        r = chat_stream(url, {"temperature": 0, "max_tokens": tokens,
                              "messages": [{"role": "user", "content": prompts[i * n + j]}]}, 900)
        got.append(r.get("completion_tokens") or 0)
chat_stream(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, 900)   # warm-up
print("warm", flush=True); sys.stdin.readline()
th = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
[t.start() for t in th]; [t.join() for t in th]
print(json.dumps(got), flush=True)
"""


def run_mode(url: str, timers: Timers, clients: int, requests: int, tokens: int) -> dict:
    """`clients` clients of `requests` streamed chats each; the timers and the process CPU over them."""
    p = subprocess.Popen([sys.executable, "-c", CLIENT, url, str(clients), str(requests), str(tokens)], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "warm", "the client did not start"
    with timers.lock:
        timers.acc.clear()
        timers.every_decode = 0.0
    cpu0, wall0, load0 = time.process_time(), time.perf_counter(), os.getloadavg()[0]
    p.stdin.write("\n")
    p.stdin.flush()
    got = json.loads(p.stdout.readline())
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    p.wait()
    acc = dict(timers.acc)
    n = acc.get("tokens", 0)
    parts = parts_of(collections.Counter(acc))
    phase = acc.get("decode phase", 0.0)
    return {"clients": clients, "requests": clients * requests, "completion_tokens": sum(got), "decoded": n,
            "decode_phase_ms_per_token": 1e3 * phase / n,
            "parts_us_per_token": {k: 1e6 * v / n for k, v in parts.items()},
            "parts_fraction": {k: v / phase for k, v in parts.items()},
            "outside_llama_decode_fraction": 1 - parts["llama_decode"] / phase,
            "process_cpu_s": cpu, "process_llama_decode_cpu_s": timers.every_decode,
            "process_outside_llama_decode_fraction": 1 - timers.every_decode / cpu,
            "wall_s": wall, "loadavg": [load0, os.getloadavg()[0]]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a model name (docs/models.md) or a .gguf path")
    ap.add_argument("--requests", type=int, default=4, help="requests one at a time (and about as many at once)")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of a request")
    ap.add_argument("--parallel", type=int, default=4, help="the endpoint's --parallel (agent_workload's)")
    ap.add_argument("--clients", type=int, default=4, help="clients at once in the concurrent part")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=result_stem("decode_overhead"), help="results path without suffix")
    args = ap.parse_args(argv)
    from benchmarks.lib.agent_alone_worker import endpoint, parser
    from edge.model.fetch import model_path
    gguf = str(model_path(args.model)) if not str(args.model).endswith(".gguf") else args.model
    timers = Timers()
    instrument(timers)
    server = endpoint(parser().parse_args(["--model", gguf, "--port", "0", "--threads", str(args.threads),
                                           "--parallel", str(args.parallel)])).start()
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        modes = {"one at a time": run_mode(url, timers, 1, args.requests, args.tokens),
                 "concurrent": run_mode(url, timers, args.clients, -(-args.requests // args.clients), args.tokens)}
    finally:
        server.stop()
    res = {"model": args.model, "gguf": Path(gguf).name, "threads": args.threads, "parallel": args.parallel,
           "tokens": args.tokens, "cpu": cpu_name(), "machine": platform.node(), "cores": os.cpu_count(),
           "commit": _commit(), "modes": modes}
    write(res, args.out)


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def write(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    path = {ext: out.parent / f"{out.name}.{ext}" for ext in ("json", "md", "png")}   # a name may hold dots
    path["json"].write_text(json.dumps(res, indent=1))
    lines = [f"# Where a decoded token's CPU goes: our endpoint decoding alone ({res['gguf']}, {res['threads']} "
             f"thread, --parallel {res['parallel']}, {res['tokens']}-token streamed MT-bench answers)", "",
             f"CPU: {res['cpu']} ({res['cores']} cores), commit {res['commit']}. Thread CPU in each generation's "
             "decode phase (after its prefill), us a token and the fraction of that phase; the machine was "
             "shared (load average below), so read the fractions, not the absolute times.", "",
             "| part | " + " | ".join(res["modes"]) + " |", "|---|" + "---:|" * len(res["modes"])]
    for part in PARTS:
        lines.append(f"| {part} | " + " | ".join(f"{m['parts_us_per_token'][part]:.0f} us "
                                                 f"({100 * m['parts_fraction'][part]:.2f}%)"
                                                 for m in res["modes"].values()) + " |")
    rows = [("decode phase, ms a token", lambda m: f"{m['decode_phase_ms_per_token']:.2f}"),
            ("outside llama_decode", lambda m: f"{100 * m['outside_llama_decode_fraction']:.2f}%"),
            ("the whole process's CPU outside llama_decode (HTTP, prefills' Python, every thread)",
             lambda m: f"{100 * m['process_outside_llama_decode_fraction']:.2f}%"),
            ("tokens decoded / requests", lambda m: f"{m['decoded']} / {m['requests']}"),
            ("1-minute load average, start -> end", lambda m: "{:.1f} -> {:.1f}".format(*m["loadavg"]))]
    lines += [f"| {name} | " + " | ".join(f(m) for m in res["modes"].values()) + " |" for name, f in rows]
    path["md"].write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3))
    left = [0.0] * len(res["modes"])
    for part in PARTS[1:]:
        vals = [m["parts_us_per_token"][part] for m in res["modes"].values()]
        ax.barh(list(res["modes"]), vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    for i, m in enumerate(res["modes"].values()):
        ax.text(left[i], i, f"  {100 * m['outside_llama_decode_fraction']:.2f}% of "
                            f"{m['decode_phase_ms_per_token']:.1f} ms", va="center", fontsize=8)
    ax.set_xlabel("thread CPU us a token outside llama_decode")
    ax.set_xlim(0, max(left) * 1.5)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"{res['gguf']}: our work around llama_decode", fontsize=9)
    fig.tight_layout()
    fig.savefig(path["png"], dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
