"""The SUN accuracy table on a REAL model (the paper's Table: base, full FT, naive reuse, SUN, int4, QSUN).

Base: SmolLM2-135M-Instruct (GGUF from `make models`, dequantised to fp32 in
torch). Tasks (export/real_tasks.py): maths (reasoning-gym gsm_symbolic),
tools (BFCL simple + multiple), code (HumanEval, trained on stdlib functions).
Per task it trains a full-FT model, a SUN prefill (frozen fp32 decoder) and a
QSUN prefill (re-tuned from SUN against the int4 decoder), then scores the six
rows with greedy decoding.

It is long on CPU (hours: three 135M trainings per task plus greedy decoding of
every eval set six times). It is resumable: specialists, training checkpoints
and finished cells live in --work (default runs/sun_accuracy/); rerun the same
command to continue. Run it in the background:

  nohup .venv/bin/python -m benchmarks.sun.sun_accuracy > runs/sun_accuracy.log 2>&1 &
  .venv/bin/python -m benchmarks.sun.sun_accuracy --smoke      # minutes: tiny sizes, checks the pipeline

Run from the repository root. Writes benchmarks/results/sun_accuracy/<variant>.{json,md,png} after
every task (--out; default: the variant `default`, `smoke` with --smoke).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.lib.results import ROOT, result_stem
from export.sun_eval_lora import LORA_ROWS, lora_table, lora_titles
from export.sun_eval import ROW_TITLES, ROWS, TableConfig, accuracy_table, markdown_table
from export.tune import TuneConfig


def load_tasks(tok, names, args):
    from export.real_tasks import REAL_TASKS
    out = []
    for name in names:
        kw = {"maths": dict(n_train=args.n_train, n_eval=args.n_eval),
              "tools": {}, "code": dict(n_train=args.n_train)}[name]
        t = REAL_TASKS[name](tok, **kw)
        fits = lambda e: len(e.prompt) + len(e.answer) <= args.max_len  # noqa: E731  bounds memory per step
        t.train = [e for e in t.train if fits(e)]
        if args.n_eval:
            t.eval = t.eval[: args.n_eval]
        t.max_new = min(t.max_new, args.max_new)
        out.append(t)
    return out


def eval_size(cells: dict):
    """The prompts a task's cells were scored on; where rows differ (a reused or partial run), per row."""
    ns = {r: c["n"] for r, c in cells.items() if "n" in c}
    if len(set(ns.values())) <= 1:
        return next(iter(ns.values()), None)
    return " / ".join(f"{r} {n}" for r, n in ns.items())


def table_rows(results: dict, asked) -> list:
    """The rows to show: the six classic ones and the adapter rows, those asked for or already measured."""
    have = {r for cells in results["cells"].values() for r in cells}
    return [r for r in ROWS + LORA_ROWS if r in asked or r in have]


def repo_relative(path) -> str:
    """A path as the results JSON records it: relative to the repository root when inside it, so a
    committed file names no machine's absolute (or /tmp) path."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def recorded_args(args) -> dict:
    return dict(vars(args), work=repo_relative(args.work), out=repo_relative(args.out))


def write(results, out: Path, wall_s: float, args, eval_sizes: dict):
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, titles = table_rows(results, args.rows), lora_titles(args.rank)
    results = dict(results, machine=platform.platform(), wall_s=round(wall_s, 1), args=recorded_args(args),
                   eval_sizes=eval_sizes)
    walls = ", ".join(f"{t} {w / 3600:.2f} h" for t, w in results["meta"].get("wall_s", {}).items())
    walls_lora = ", ".join(f"{t} {w / 3600:.2f} h" for t, w in results["meta"].get("wall_s_lora", {}).items())
    lora_note = (f"Adapter rows: rank {args.rank}, alpha {args.alpha:g}, all seven linear targets, lr "
                 f"{args.lora_lr:g}, {args.steps} SUN-LoRA steps, {args.qsun_steps} QSUN-LoRA steps from SUN-LoRA; "
                 f"wall time per task (summed over resumed runs): {walls_lora or '-'}.\n"
                 if set(rows) & set(LORA_ROWS) else "")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    md = (f"# SUN accuracy table, base {args.model}\n\nScore (exact match / final number / BFCL AST / "
          f"HumanEval pass@1, greedy):\n\n{markdown_table(results, rows, titles=titles)}\n"
          f"Answer cross-entropy (nats/token):\n\n{markdown_table(results, rows, 'ce', titles)}\n"
          f"Held-out prompts per task: "
          f"{', '.join(f'{t} {n}' for t, n in eval_sizes.items())}; one seed, greedy decoding. "
          f"Training: {args.steps} steps of batch {args.batch_size} at lr {args.lr:g} (full FT and SUN), "
          f"{args.qsun_steps} QSUN steps from SUN.\nWall time per task (training + scoring, summed over "
          f"resumed runs): {walls or '-'}; this run {wall_s / 3600:.2f} h on {results['machine']}.\n{lora_note}")
    out.with_suffix(".md").write_text(md)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(results["cells"])
    fig, ax = plt.subplots(figsize=(2 + 2 * len(tasks), 4))
    w = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ys = [results["cells"][t].get(r, {}).get("acc", 0) for t in tasks]
        ax.bar([j + i * w for j in range(len(tasks))], ys, w, label=titles.get(r) or ROW_TITLES[r])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks)
    ax.set_ylabel("score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(md, flush=True)


def probe(base, tasks, args, t0: float) -> list:
    from benchmarks.lib.sun_lora_probe import lr_probe, probe_markdown
    out, probes = Path(args.out), []
    out.parent.mkdir(parents=True, exist_ok=True)
    for t in tasks:     # rewritten after each task
        probes.append(lr_probe(base, t, args.probe_lrs, args.probe_steps, args.rank, args.alpha, args.batch_size))
        out.with_suffix(".json").write_text(json.dumps(
            {"probes": probes, "machine": platform.platform(), "wall_s": round(time.perf_counter() - t0, 1),
             "args": recorded_args(args)}, indent=1))
        out.with_suffix(".md").write_text(probe_markdown(args.model, probes, platform.platform(), args.threads))
    return probes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", nargs="+", default=["maths", "tools", "code"])
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=512, help="drop training pairs longer than this")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600, help="full-FT and SUN steps")
    ap.add_argument("--qsun-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", default=",".join(ROWS + LORA_ROWS),
                    type=lambda s: [r.strip().replace("-", "_") for r in s.split(",")],
                    help="comma-separated rows to compute (e.g. sun-lora,qsun-lora); finished cells are kept")
    ap.add_argument("--reuse", default=None, help="an earlier results JSON whose cells are kept, not recomputed")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapter rows")
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lora-lr", type=float, default=1e-3,
                    help="the adapter rows' lr (a 24-step training-loss probe on tools picked 1e-3 of 5e-5..1e-3)")
    ap.add_argument("--probe-lrs", default=None, type=lambda s: [float(x) for x in s.split(",")],
                    help="only probe: a short SUN-LoRA run per lr on each task's training pairs (loss on "
                         "held-back training pairs, s/step); writes --out, trains no table row")
    ap.add_argument("--probe-steps", type=int, default=24)
    ap.add_argument("--work", default=str(ROOT / "runs" / "sun_accuracy"))
    ap.add_argument("--out", default=None, help="results path without suffix (default: "
                    "benchmarks/results/sun_accuracy/default, or .../smoke with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline in minutes")
    args = ap.parse_args(argv)
    unknown = [r for r in args.rows if r not in ROWS + LORA_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS + LORA_ROWS)}")
    if args.smoke:
        args.n_train, args.n_eval, args.steps, args.qsun_steps, args.batch_size = 16, 2, 2, 1, 2
        args.max_len, args.max_new = 200, 12
        args.work = str(Path(args.work).with_name("sun_accuracy_smoke"))
    args.out = args.out or str(result_stem("sun_accuracy", "smoke" if args.smoke else "default"))
    if args.threads:
        torch.set_num_threads(args.threads)
    from edge.model.checkpoint import load_model
    from edge.model.fetch import model_path
    path = model_path(args.model)
    if not path.exists():
        sys.exit(f"{path} is missing: run `make models` first")
    t0 = time.perf_counter()
    base, ckpt = load_model(path)
    tasks = load_tasks(ckpt.tokenizer, args.tasks, args)
    print("tasks:", {t.name: (len(t.train), len(t.eval)) for t in tasks}, flush=True)
    if args.probe_lrs:
        return probe(base, tasks, args, t0)
    common = dict(batch_size=args.batch_size, lr=args.lr, warmup=min(50, args.steps // 10), ckpt_every=50,
                  weight_decay=0.0)
    cfg = TableConfig(full=TuneConfig(mode="full", steps=args.steps, **common),
                      sun=TuneConfig(mode="sun", steps=args.steps, **common),
                      qsun=TuneConfig(mode="sun", decoder="int4", steps=args.qsun_steps,
                                      **{**common, "warmup": 0}),
                      eval_batch=16)
    lora = dict(common, mode="sun", adapter="lora", rank=args.rank, alpha=args.alpha, lr=args.lora_lr)
    sun_lora = TuneConfig(steps=args.steps, **lora)
    qsun_lora = TuneConfig(decoder="int4", steps=args.qsun_steps, **{**lora, "warmup": 0})
    classic, adapters = [r for r in ROWS if r in args.rows], [r for r in LORA_ROWS if r in args.rows]
    res = None
    for t in tasks:  # one task at a time so the files are rewritten after each
        if classic:
            res = accuracy_table(base, [t], cfg, out_dir=args.work, progress=True, rows=classic)
        if adapters or args.reuse:
            res = lora_table(base, [t], sun_lora, qsun_lora, out_dir=args.work, rows=adapters,
                             eval_batch=cfg.eval_batch, earlier=args.reuse, progress=True)
        # the prompts each task's cells were scored on (a resumed cell keeps the size it had)
        sizes = {x: eval_size(cells) for x, cells in res["cells"].items()}
        write(res, Path(args.out), time.perf_counter() - t0, args, sizes)
    return res


if __name__ == "__main__":
    main()
