"""The SUN accuracy table: one base model, several tasks, six ways to serve them.

Rows (the paper's comparison, docs/architecture.md "Baselines"):

  base          the base model alone
  full_ft       one fully fine-tuned model per task (prefill = decoder = the FT model)
  naive_reuse   the full-FT model's KV fed to the frozen base decoder (no adaptation)
  sun           prefill-only tuned module + the frozen base decoder
  int4_rtn      the SUN prefill + the int4 (round-to-nearest) decoder, not re-tuned
  qsun          the prefill re-tuned (from the SUN prefill) against the int4 decoder

Each cell holds exact-match accuracy (or the task's own scorer) and the mean
answer cross-entropy. With `out_dir` every specialist and every finished cell
is saved as it completes, so an interrupted run resumes where it stopped
(training itself resumes from its last checkpoint).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from edge.model.transformer import Transformer
from edge.model.sun_modules import MANIFEST, exact_match, load_module, split_generate
from export.tasks import TaskData
from export.tune import TuneConfig, build_decoder, split_loss, tune

ROWS = ("base", "full_ft", "naive_reuse", "sun", "int4_rtn", "qsun")
ROW_TITLES = {"base": "base model", "full_ft": "full fine-tuning (one model per task)",
              "naive_reuse": "naive reuse (full-FT KV -> base decoder)", "sun": "SUN (prefill-only tuning)",
              "int4_rtn": "int4 RTN decoder, not re-tuned", "qsun": "QSUN (re-tuned for the int4 decoder)"}


@dataclass
class TableConfig:
    full: TuneConfig = field(default_factory=lambda: TuneConfig(mode="full"))
    sun: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun"))
    qsun: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun", decoder="int4"))
    eval_batch: int = 64


def _score(task: TaskData, prefill, decoder, batch: int, label: str = "",
           progress: bool = False) -> Dict[str, float]:
    from tqdm.auto import tqdm
    prompts = [e.prompt for e in task.eval]
    preds: List[List[int]] = []
    for i in tqdm(range(0, len(prompts), batch), desc=f"eval {task.name}/{label}", unit="batch",
                  disable=not progress, leave=False):   # greedy decoding of a real eval set takes minutes
        preds += split_generate(prefill, decoder, prompts[i: i + batch], task.max_new, task.stop_ids,
                                batch_size=batch)
    acc = (task.score or (lambda p, ex: exact_match(p, [e.answer for e in ex])))(preds, task.eval)
    with torch.no_grad():
        ce = sum(float(split_loss(prefill, decoder, task.eval[i: i + batch])) * len(task.eval[i: i + batch])
                 for i in range(0, len(task.eval), batch)) / max(1, len(task.eval))
    return {"acc": round(float(acc), 4), "ce": round(ce, 4), "n": len(task.eval)}


class _Store:
    """results.json beside the specialists; rewritten atomically after every cell."""

    def __init__(self, out_dir: Optional[Path]):
        self.path = out_dir / "results.json" if out_dir else None
        self.data: dict = {"cells": {}, "meta": {}}
        if self.path and self.path.is_file():
            self.data = json.loads(self.path.read_text())

    def get(self, task: str, row: str) -> Optional[dict]:
        return self.data["cells"].get(task, {}).get(row)

    def put(self, task: str, row: str, cell: dict) -> None:
        self.data["cells"].setdefault(task, {})[row] = cell
        self.save()

    def save(self) -> None:
        if self.path:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.replace(self.path)


def _specialist(base, task: TaskData, cfg: TuneConfig, out: Optional[Path], name: str, progress: bool,
                decoder=None, init=None) -> Transformer:
    d = out / "specialists" / task.name / name if out else None
    if d is not None and (d / MANIFEST).is_file():
        return load_module(d, dtype=torch.float32)[0]
    cfg = replace(cfg, max_new=task.max_new, stop_ids=task.stop_ids)
    res = tune(base, task.train, cfg, eval_set=(), out_dir=d, decoder=decoder, init=init,
               progress=progress, manifest_extra={"task": task.name})
    return res.prefill


def open_table(base: Transformer, out_dir) -> tuple:
    """A table's store in out_dir (None: in memory) for `base`, and its two shared decoders:
    -> (out, store, base in float32, (fp32 decoder, fingerprint), (int4 decoder, fingerprint)).
    A store made for another base is refused (its cells would not be this base's)."""
    out = Path(out_dir) if out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    store = _Store(out)
    base = base.float().eval()
    fp_dec, fp_fp = build_decoder(base, "fp32")
    q_dec, q_fp = build_decoder(base, "int4")
    old = store.data["meta"].get("decoder_fp32")
    if old and old != fp_fp:
        raise ValueError(f"{out} holds results for another base model (decoder {old[:12]}, now {fp_fp[:12]}); "
                         "use a new output directory")
    store.data["meta"].update({"decoder_fp32": fp_fp, "decoder_int4": q_fp})
    return out, store, base, (fp_dec, fp_fp), (q_dec, q_fp)


def accuracy_table(base: Transformer, tasks: Sequence[TaskData], cfg: TableConfig = TableConfig(),
                   out_dir=None, progress: bool = True, rows: Sequence[str] = ROWS,
                   log: Callable[[str], None] = print) -> dict:
    """Train what each row needs and score every (task, row) cell; returns the results dict."""
    out, store, base, (fp_dec, fp_fp), (q_dec, q_fp) = open_table(base, out_dir)
    store.data["meta"]["config"] = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v
                                    for k, v in asdict(cfg).items()}
    store.save()
    for task in tasks:
        t0 = time.perf_counter()
        need = {r for r in rows if store.get(task.name, r) is None}
        full = sun = qsun = None
        if need & {"full_ft", "naive_reuse"}:
            full = _specialist(base, task, cfg.full, out, "full", progress)
        if need & {"sun", "int4_rtn", "qsun"}:
            sun = _specialist(base, task, cfg.sun, out, "sun", progress, decoder=(fp_dec, fp_fp))
        if "qsun" in need:
            qsun = _specialist(base, task, cfg.qsun, out, "qsun", progress, decoder=(q_dec, q_fp), init=sun)
        pairs = {"base": (base, base), "full_ft": (full, full), "naive_reuse": (full, fp_dec),
                 "sun": (sun, fp_dec), "int4_rtn": (sun, q_dec), "qsun": (qsun, q_dec)}
        for r in rows:
            if r in need:
                store.put(task.name, r, _score(task, *pairs[r], cfg.eval_batch, r, progress))
        took = time.perf_counter() - t0
        walls = store.data["meta"].setdefault("wall_s", {})
        walls[task.name] = round(walls.get(task.name, 0.0) + took, 1)   # summed over resumed runs
        store.save()
        log(f"{task.name}: " + ", ".join(f"{r}={store.get(task.name, r)['acc']:.3f}" for r in rows)
            + f" ({took:.0f}s)")
    return store.data


def markdown_table(results: dict, rows: Sequence[str] = ROWS, metric: str = "acc",
                   titles: Optional[dict] = None) -> str:
    tasks = list(results["cells"])
    head = "| row | " + " | ".join(tasks) + " | mean |\n|---|" + "---:|" * (len(tasks) + 1) + "\n"
    lines = []
    for r in rows:
        vals = [results["cells"][t].get(r, {}).get(metric) for t in tasks]
        shown = [f"{v:.3f}" if v is not None else "-" for v in vals]
        got = [v for v in vals if v is not None]
        mean = f"{sum(got) / len(got):.3f}" if got else "-"
        lines.append(f"| {(titles or {}).get(r) or ROW_TITLES.get(r, r)} | " + " | ".join(shown) + f" | {mean} |")
    return head + "\n".join(lines) + "\n"


def row_mean(results: dict, row: str, metric: str = "acc") -> float:
    vals = [c[row][metric] for c in results["cells"].values() if row in c]
    return sum(vals) / len(vals)


# -- the fast synthetic suite (CI) ------------------------------------------------------------

def synthetic_suite(n_train: int = 20000, n_eval: int = 200, seed: int = 0,
                    names: Sequence[str] = ()) -> List[TaskData]:
    from export.tasks import SPECIALIST_TASKS, SYNTHETIC, split
    out = []
    for i, name in enumerate(names or SPECIALIST_TASKS):
        t = SYNTHETIC[name]
        tr, ev = split(t, n_train, n_eval, seed=seed + 100 + i)
        out.append(TaskData(name, tr, ev, t.max_new, t.stop_ids))
    return out


# The synthetic suite's training budget (tests/system/test_sun_tuning.py explains the margins it
# gives; ~150 s of one core): full FT 300 steps, SUN 600, QSUN 100 more from SUN.
SYNTHETIC_TABLE = TableConfig(
    full=TuneConfig(mode="full", steps=300, lr=3e-3, batch_size=64, warmup=20, seed=0),
    sun=TuneConfig(mode="sun", steps=600, lr=3e-3, batch_size=64, warmup=20, seed=0),
    qsun=TuneConfig(mode="sun", decoder="int4", steps=100, lr=1e-3, batch_size=64, warmup=0, seed=0),
)


def synthetic_base(steps: int = 500, seed: int = 0, layers: int = 2, hidden: int = 64, lr: float = 3e-3,
                   batch_size: int = 64, progress: bool = False) -> Transformer:
    """A tiny llama trained from scratch on the generic skill (copying); the suite's base."""
    from edge.model.transformer import tiny_config
    from export.tasks import PRETRAIN_TASK, SYNTHETIC, VOCAB, split
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=4, num_kv_heads=2, max_position=64)
    t = SYNTHETIC[PRETRAIN_TASK]
    tr, _ = split(t, 20000, 0, seed=seed + 1)
    run = TuneConfig(mode="full", steps=steps, lr=lr, batch_size=batch_size, seed=seed, max_new=t.max_new,
                     stop_ids=t.stop_ids)
    return tune(Transformer(cfg), tr, run, progress=progress).prefill
