"""The model-free suffix draft vs n-gram prompt lookup and the 0.5B model draft, co-located.

Where text repeats -- function calling (BFCL), code edits (HumanEval functions to
rewrite), MT-bench second turns -- and on plain MT-bench first turns, with the llama.cpp
target Qwen2.5-Coder-1.5B on this machine, greedy. Modes per prompt: target-only, n-gram
(NgramDrafter), suffix (SuffixDrafter; ONE fleet tree per workload, so later prompts learn
from earlier outputs as the hub's service does), the 0.5B model draft, and the hybrid
(the suffix proposal when its score >= --min-score, else the model's). Per prompt:
acceptance, tokens per verify call, end-to-end tok/s and its ratio to the same prompt's
target-only run (and of decode tok/s alone: the target's and the model draft's prefill
excluded), whether the text equals target-only (llama.cpp's multi-token verify may
split greedy texts at near-ties), and the drafter's own time per call. Medians per
workload x mode go in the table.

  python -m benchmarks.speculative.suffix_draft                                   # 8 prompts a workload, 128 tokens
  python -m benchmarks.speculative.suffix_draft --prompts 2 --max-new 24 --out /tmp/sfx   # a quick check
Run from the repository root. Writes benchmarks/results/suffix_draft/<variant>.{json,png,md} (--out;
default: the variant `default`, or the target format's name, `f16`). Run it on quiet cores:
the speedups are ratios of wall times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.lib.repetitive_workloads import prompts_of
from benchmarks.lib.results import result_stem
from export.target_format import FORMATS
from edge.telemetry.cpu_info import cpu_name
from edge.speculative.drafter import Drafter
from edge.model.fetch import model_path
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.ngram import NgramDrafter
from edge.speculative.sampling import SamplingParams
from edge.speculative.suffix_drafter import SuffixConfig, SuffixDrafter

GREEDY = SamplingParams(temperature=0.0)
WORKLOADS = ("bfcl", "edits", "multiturn", "mtbench")
MODES = ("ngram", "suffix", "model", "hybrid")


class LocalHybrid(Drafter):
    """The hub's hybrid on one machine: the suffix proposal when it scores high, else the model's."""
    name = "hybrid"

    def __init__(self, suffix: SuffixDrafter, model: ModelDrafter, min_score: float):
        self.suffix, self.model, self.min_score = suffix, model, min_score
        self.vocab_size = model.vocab_size
        self.answers = {"suffix": 0, "model": 0}

    def prefill(self, prompt):
        self.suffix.prefill(prompt)
        return self.model.prefill(prompt)

    def draft(self, context, gamma, rng=None):
        toks, qs = self.suffix.draft(context, gamma, rng)
        if toks and self.suffix.ctx.last.score >= self.min_score:
            self.answers["suffix"] += 1
            return toks, qs
        self.answers["model"] += 1
        return self.model.draft(context, gamma, rng)

    def close(self):
        self.model.close()


def load(name: str, threads: int, fmt: str = "native"):
    from export.target_format import target_gguf
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.tokenizer import Tokenizer
    return (LlamaCppEngine(target_gguf(name, fmt), max_len=4096, n_seq_max=2, threads=threads),
            Tokenizer.from_gguf(model_path(name)))


def e2e(r) -> float:
    return r.n_generated / r.wall_s if r.wall_s > 0 else 0.0


def draft_ms(r) -> float:
    ts = [t.seconds for t in r.timings if t.kind == "draft"]
    return 1e3 * statistics.mean(ts) if ts else 0.0


def run_workload(workload, target, draft, tok, args):
    cfg = SuffixConfig(min_prob=args.min_prob)
    fleet, fleet_h = cfg.global_tree(), cfg.global_tree()   # one per mode: each learns only its own runs
    rows = []
    stops = tuple(tok.eos_ids)
    for i, ids in enumerate(prompts_of(workload, args.prompts, target, tok, args)):
        base = generate_plain(target, ids, args.max_new, GREEDY, stop_ids=stops)
        rows.append(dict(workload=workload, mode="target-only", prompt=i, prompt_tokens=len(ids), tps=e2e(base),
                         decode_tps=base.tokens_per_s, ratio=1.0, decode_ratio=1.0, accept=None, tpv=1.0, same=True, draft_ms=0.0))
        for mode in args.modes:
            if mode == "ngram":
                d = NgramDrafter()
            elif mode == "suffix":
                d = SuffixDrafter(cfg, fleet)
            elif mode == "model":
                d = ModelDrafter(draft, GREEDY)
            else:
                d = LocalHybrid(SuffixDrafter(cfg, fleet_h), ModelDrafter(draft, GREEDY), args.min_score)
            r = generate_speculative(target, d, ids, args.max_new, args.gamma, GREEDY, stop_ids=stops)
            extra = dict(d.answers) if isinstance(d, LocalHybrid) else {}
            d.close()
            rows.append(dict(workload=workload, mode=mode, prompt=i, prompt_tokens=len(ids), tps=e2e(r),
                             decode_tps=r.tokens_per_s, ratio=e2e(r) / e2e(base),
                             decode_ratio=r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0,
                             accept=r.acceptance_rate,
                             tpv=r.tokens_per_verify, same=r.tokens == base.tokens, draft_ms=draft_ms(r), **extra))
        n = len(args.modes)
        print(f"[{workload}] prompt {i} ({len(ids)} tokens): target-only {e2e(base):.2f} tok/s; "
              + ", ".join(f"{x['mode']} {x['ratio']:.2f}x acc {x['accept']:.2f} tpv {x['tpv']:.2f}"
                          for x in rows[-n:]), flush=True)
    return rows, {"fleet_nodes": len(fleet), "fleet_sequences": len(fleet.keys())}


def summarise(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["workload"], r["mode"]), []).append(r)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return [dict(workload=w, mode=m, n=len(rs), tps=med([r["tps"] for r in rs]),
                 ratio=med([r["ratio"] for r in rs]), decode_ratio=med([r["decode_ratio"] for r in rs]),
                 accept=med([r["accept"] for r in rs if r["accept"] is not None]),
                 tpv=med([r["tpv"] for r in rs]), draft_ms=med([r["draft_ms"] for r in rs]),
                 same=sum(r["same"] for r in rs))
            for (w, m), rs in groups.items()]


def write(table, rows, fleets, args):
    out = Path(args.out or result_stem("suffix_draft", "default" if args.target_format == "native"
                                       else args.target_format.lower()))
    out.parent.mkdir(parents=True, exist_ok=True)
    as_fmt = "" if args.target_format == "native" else f" stored as {args.target_format}"
    meta = dict(target_format=args.target_format, machine=platform.processor() or platform.machine(), cpu=cpu_name(),
                cores=os.cpu_count(),
                loadavg=os.getloadavg(), prompts=args.prompts, max_new=args.max_new, gamma=args.gamma,
                threads=args.threads, min_score=args.min_score, min_prob=args.min_prob,
                date=time.strftime("%F %T"), note=args.note)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, table=table, fleets=fleets, rows=rows),
                                                   indent=1, default=str))
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"# Suffix draft vs n-gram vs the 0.5B model draft (llama.cpp, Qwen2.5-Coder-1.5B{as_fmt} target, "
             f"greedy, γ={args.gamma}, {args.max_new} new tokens, {args.threads} threads, medians over "
             f"{args.prompts} prompts a workload)\n",
             f"CPU: {meta['cpu']}. Load average at the end: {', '.join(f'{x:.1f}' for x in meta['loadavg'])}. "
             f"{args.note}\n",
             "| workload | mode | tok/s (end to end) | vs target-only | decode only: vs target-only | accept | "
             "tok/verify | draft ms/call | text == target-only |", "|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['workload']} | {t['mode']} | {t['tps']:.2f} | {t['ratio']:.2f}x | "
                     f"{t['decode_ratio']:.2f}x | {f(t['accept'])} | "
                     f"{f(t['tpv'])} | {f(t['draft_ms'])} | {t['same']}/{t['n']} |")
    lines.append("\nFleet trees at the end (suffix mode): " + ", ".join(
        f"{w}: {v['fleet_nodes']} nodes over {v['fleet_sequences']} sequences" for w, v in fleets.items()))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    works = [w for w in WORKLOADS if any(t["workload"] == w for t in table)]
    modes = [m for m in MODES if any(t["mode"] == m for t in table)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        vals = [next((t["ratio"] for t in table if t["workload"] == w and t["mode"] == m), 0) for w in works]
        ax.bar([i + j * width for i in range(len(works))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(works))], works)
    ax.set_ylabel("speedup vs target-only (median)")
    ax.set_title(f"Co-located drafting, llama.cpp 1.5B{as_fmt} target, γ={args.gamma}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(out.with_suffix(".md").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4, help="the most tokens any drafter proposes a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-format", default="native", choices=FORMATS,
                    help="the target's GGUF as fetched (Q4_K_M) or the same weights as F16 / BF16 / Q8_0 "
                         "(a verify over k tokens costs less than k steps; BF16: Zen 4's native dot)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {','.join(WORKLOADS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    ap.add_argument("--min-score", type=float, default=1.5, help="hybrid: suffix answers at this score")
    ap.add_argument("--min-prob", type=float, default=0.1, help="suffix: path probability cut-off")
    ap.add_argument("--turn1-tokens", type=int, default=96, help="multiturn: length of the first answer")
    ap.add_argument("--out", default=None, help="results path without suffix")
    ap.add_argument("--note", default="", help="a line for the table (e.g. 'measured under load')")
    args = ap.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    works = [w for w in args.workloads.split(",") if w]
    bad = [x for x in args.modes if x not in MODES] + [w for w in works if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown {', '.join(bad)}: modes are {', '.join(MODES)}, workloads {', '.join(WORKLOADS)}")
    target, tok = load("qwen2.5-coder-1.5b", args.threads, args.target_format)
    draft = load("qwen2.5-coder-0.5b", args.threads)[0] if {"model", "hybrid"} & set(args.modes) else None
    rows, fleets = [], {}
    for w in works:
        r, fleets[w] = run_workload(w, target, draft, tok, args)
        rows += r
    write(summarise(rows), rows, fleets, args)


if __name__ == "__main__":
    main()
