"""The SUN accuracy table on a REAL model: base, full FT, naive reuse, SUN, int4 RTN, QSUN, SUN-LoRA, QSUN-LoRA.

Base: a GGUF from `make models` (SmolLM2-135M by default, `--model qwen2.5-coder-0.5b` for Qwen2.5-Coder-
0.5B-Instruct), dequantised to fp32 in torch. Tasks (export/real_tasks.py): tools (BFCL simple +
multiple, AST-checked), code (HumanEval, trained on stdlib functions), maths (reasoning-gym).
Per task it trains what each row needs (a full-FT model, a SUN prefill against the frozen fp32
decoder, a QSUN prefill re-tuned from it against the int4 decoder, a SUN-LoRA adapter and a
QSUN-LoRA one re-tuned from it) and scores the rows with greedy decoding.

Long on CPU (hours per row on a 0.5B base), so resumable at every level (export/sun_rows.py): a
finished row is never redone, training checkpoints every --ckpt-minutes and resumes mid-way,
scoring resumes at its batch; the table is rewritten after every row from whatever rows are done.
Rerun the same command to continue. In the background, at low priority:

  nohup nice -n 19 .venv/bin/python -m benchmarks.sun.sun_accuracy --model qwen2.5-coder-0.5b --tasks tools code \
      --freeze-embeddings --bf16 --grad-checkpoint --out benchmarks/results/sun_accuracy/qwen0.5b \
      --work runs/sun_accuracy_qwen > runs/sun_accuracy_qwen.log 2>&1 &
  .venv/bin/python -m benchmarks.sun.sun_accuracy --smoke      # minutes: tiny sizes, checks the pipeline

Run from the repository root. Writes benchmarks/results/sun_accuracy/<variant>.{json,md,png} after
every row (--out; default: the variant `default`, `smoke` with --smoke).
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
from benchmarks.sun.sun_accuracy_report import with_ext, write
from export.sun_eval import ROWS
from export.sun_eval_lora import LORA_ROWS, lora_titles, seed_from
from export.sun_rows import ALL_ROWS, RowPlan, RowRunner, redo_once, run_rows
from export.tune import TuneConfig

# the order rows are computed in: the goals first (full FT, naive reuse, SUN-LoRA, then
# int4 RTN and QSUN-LoRA), QSUN last; the table shows them in ROWS + LORA_ROWS order
RUN_ORDER = ("base", "full_ft", "naive_reuse", "sun_lora", "sun", "int4_rtn", "qsun_lora", "qsun")


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


def repo_relative(path) -> str:
    """A path as the results JSON records it: relative to the repository root when inside it, so a
    committed file names no machine's absolute (or /tmp) path."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def recorded_args(args) -> dict:
    return dict(vars(args), work=repo_relative(args.work), out=repo_relative(args.out))


def probe(base, tasks, args, t0: float) -> list:
    from benchmarks.lib.sun_lora_probe import lr_probe, probe_markdown
    out, probes = Path(args.out), []
    out.parent.mkdir(parents=True, exist_ok=True)
    for t in tasks:     # rewritten after each task
        probes.append(lr_probe(base, t, args.probe_lrs, args.probe_steps, args.rank, args.alpha, args.batch_size))
        with_ext(out, ".json").write_text(json.dumps(
            {"probes": probes, "machine": platform.platform(), "wall_s": round(time.perf_counter() - t0, 1),
             "args": recorded_args(args)}, indent=1))
        with_ext(out, ".md").write_text(probe_markdown(args.model, probes, platform.platform(), args.threads))
    return probes


def plan(args) -> RowPlan:
    common = dict(batch_size=args.batch_size, lr=args.lr, warmup=min(50, args.steps // 10), ckpt_every=50,
                  ckpt_every_s=args.ckpt_minutes * 60, weight_decay=0.0, micro_batch=args.micro_batch,
                  grad_checkpoint=args.grad_checkpoint, freeze_embeddings=args.freeze_embeddings, bf16=args.bf16)
    lora = dict(common, mode="sun", adapter="lora", rank=args.rank, alpha=args.alpha, lr=args.lora_lr)
    # a re-tune for the int4 decoder starts from a tuned module: no warmup, and the best step kept
    retune = dict(warmup=0, select_every=args.select_every, select_n=args.select_n if args.select_every else 0)
    return RowPlan(full=TuneConfig(mode="full", steps=args.steps, **common),
                   sun=TuneConfig(mode="sun", steps=args.steps, **common),
                   qsun=TuneConfig(mode="sun", decoder="int4", steps=args.qsun_steps, **{**common, **retune}),
                   sun_lora=TuneConfig(steps=args.steps, **lora),
                   qsun_lora=TuneConfig(decoder="int4", steps=args.qsun_steps, **{**lora, **retune}),
                   eval_batch=args.eval_batch)


def notes(args, tasks) -> str:
    mem = [x for x, on in (("embedding and output head frozen (shared with the base)", args.freeze_embeddings),
                           (f"micro-batches of {args.micro_batch} accumulated", args.micro_batch),
                           ("gradient checkpointing", args.grad_checkpoint),
                           ("bf16 autocast matmuls", args.bf16)) if on]
    select = (f"; each int4 re-tune (QSUN, QSUN-LoRA) ends at its step (0, {args.select_every}, "
              f"{2 * args.select_every}, ... or the last) of lowest answer CE on {args.select_n} training pairs "
              f"held back from it" if args.select_every else "")
    return (f"Training: {args.steps} steps of batch {args.batch_size} at lr {args.lr:g} (full FT and SUN), "
            f"{args.qsun_steps} QSUN steps from SUN; adapter rows rank {args.rank}, alpha {args.alpha:g}, all "
            f"seven linear targets, lr {args.lora_lr:g}, {args.steps} SUN-LoRA steps, {args.qsun_steps} QSUN-LoRA "
            f"steps from SUN-LoRA{select}; training pairs up to {args.max_len} tokens, answers up to {args.max_new} "
            f"new tokens ({', '.join(f'{t.name} {t.max_new}' for t in tasks)}); fp32 weights, gradients and AdamW state"
            f"{'; ' + ', '.join(mem) if mem else ''}; {args.threads or torch.get_num_threads()} threads.\n")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", nargs="+", default=["maths", "tools", "code"])
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=512, help="drop training pairs longer than this")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600, help="full-FT, SUN and SUN-LoRA steps")
    ap.add_argument("--qsun-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rows", default=",".join(RUN_ORDER),
                    type=lambda s: [r.strip().replace("-", "_") for r in s.split(",")],
                    help="comma-separated rows to compute, in this order (e.g. sun-lora,qsun-lora); finished "
                         "rows are kept")
    ap.add_argument("--reuse", default=None, help="an earlier results JSON whose cells are kept, not recomputed")
    ap.add_argument("--select-every", type=int, default=10,
                    help="QSUN and QSUN-LoRA re-tunes keep their best step, judged at step 0 and every this many "
                         "steps on --select-n held-back training pairs (0: the last step, as before 2026-12-07)")
    ap.add_argument("--select-n", type=int, default=32)
    ap.add_argument("--redo", default=[], type=lambda s: [c.strip().replace("-", "_") for c in s.split(",") if c],
                    help="comma-separated TASK:ROW cells to compute again, once (e.g. tools:qsun-lora after a "
                         "recipe change); a rerun with the same option keeps the new cell")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapter rows")
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lora-lr", type=float, default=1e-3,
                    help="the adapter rows' lr (a 24-step training-loss probe on tools picked 1e-3 of 5e-5..1e-3)")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="accumulate each step's batch over passes of this many examples (0: one pass; measured "
                         "on Qwen2.5-0.5B with --bf16, passes of 1 cost ~2.3x the CPU: each pass casts the weights "
                         "to bf16 again)")
    ap.add_argument("--grad-checkpoint", action="store_true", help="recompute block activations in backward")
    ap.add_argument("--freeze-embeddings", action="store_true",
                    help="embedding and output head frozen in every trained row, shared with the base (no copy)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast matmuls in training (fp32 master weights)")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0, help="a training checkpoint at least this often")
    ap.add_argument("--eval-batch", type=int, default=8, help="prompts decoded at once when scoring")
    ap.add_argument("--keep-specialists", action="store_true",
                    help="keep every trained full-copy specialist in --work (default: one is deleted once no "
                         "pending row needs it, a model's worth of disk each; adapters are always kept)")
    ap.add_argument("--probe-lrs", default=None, type=lambda s: [float(x) for x in s.split(",")],
                    help="only probe: a short SUN-LoRA run per lr on each task's training pairs (loss on "
                         "held-back training pairs, s/step); writes --out, trains no table row")
    ap.add_argument("--probe-steps", type=int, default=24)
    ap.add_argument("--work", default=str(ROOT / "runs" / "sun_accuracy"))
    ap.add_argument("--out", default=None, help="results path without suffix (default: "
                    "benchmarks/results/sun_accuracy/default, or .../smoke with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline in minutes")
    args = ap.parse_args(argv)
    bad = [c for c in args.redo if c.count(":") != 1 or c.split(":")[1] not in ALL_ROWS]
    if bad:
        ap.error(f"--redo takes TASK:ROW cells (rows: {', '.join(ALL_ROWS)}), got {bad}")
    unknown = [r for r in args.rows if r not in ALL_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ALL_ROWS)}")
    if args.smoke:
        args.n_train, args.n_eval, args.steps, args.qsun_steps, args.batch_size = 16, 2, 2, 1, 2
        args.max_len, args.max_new, args.eval_batch = 200, 12, 2
        args.work = str(Path(args.work).with_name(Path(args.work).name + "_smoke"))
    args.out = args.out or str(result_stem("sun_accuracy", "smoke" if args.smoke else "default"))
    return args


def main(argv=None):
    args = parse(argv)
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
    print("tasks (train, held-out):", {t.name: (len(t.train), len(t.eval)) for t in tasks}, flush=True)
    if args.probe_lrs:
        return probe(base, tasks, args, t0)
    runner = RowRunner(base, args.work, plan(args))
    if args.reuse:
        seed_from(runner.store, args.reuse, [t.name for t in tasks])
    redo_once(runner, args.redo)
    shown = [r for r in ROWS + LORA_ROWS if r in args.rows or any(r in c for c in runner.store.data["cells"].values())]
    names = [t.name for t in tasks]

    sizes = {t.name: len(t.eval) for t in tasks}

    def after_row(results):
        return write(results, Path(args.out), names, shown, lora_titles(args.rank), args.model, notes(args, tasks),
                     recorded_args(args), sizes)

    after_row(runner.store.data)                   # the table as it stands, before the first new row
    res = run_rows(runner, tasks, args.rows, after_row, prune=not args.keep_specialists)
    print(after_row(res), flush=True)
    return res


if __name__ == "__main__":
    main()
