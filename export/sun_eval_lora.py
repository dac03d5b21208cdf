"""The accuracy table's adapter rows (issue 37 point 5): SUN-LoRA and QSUN-LoRA.

  sun_lora    a prefill-only LoRA adapter tuned against the frozen fp32 base decoder
  qsun_lora   that adapter re-tuned (from it) against the int4 RTN decoder, scored with it

Same tasks, held-out prompts, scorer and seeds as export/sun_eval.py's six rows; the cells go
into the same results.json (export/sun_eval.py's store), so a table can hold the rows computed
earlier beside these. Each adapter and each finished cell is kept in the work directory: a rerun
resumes (training from its last checkpoint) and recomputes nothing finished. Here in export/ (not
benchmarks/) because `edge-hub demo-sun` tunes and scores its adapter specialists with it too.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from edge.model.lora.files import load_adapter
from edge.model.sun_modules import MANIFEST
from export.sun_eval import _score, _Store, open_table
from export.tasks import TaskData
from export.tune import TuneConfig, tune
from export.tune_lora import make_trainee

LORA_ROWS = ("sun_lora", "qsun_lora")


def lora_titles(rank: int) -> dict:
    return {"sun_lora": f"SUN-LoRA (prefill-only adapter, rank {rank})",
            "qsun_lora": f"QSUN-LoRA (adapter re-tuned for the int4 decoder, rank {rank})"}


def seed_from(store: _Store, earlier: Path, tasks: Sequence[str]) -> None:
    """Copy the cells of `tasks` from an earlier results JSON that the store lacks (so they are not
    recomputed); refused when it was measured on another base model."""
    old = json.loads(Path(earlier).read_text())
    fp_old, fp_now = old.get("meta", {}).get("decoder_fp32"), store.data["meta"].get("decoder_fp32")
    if fp_old and fp_now and fp_old != fp_now:
        raise ValueError(f"{earlier} was measured on another base (decoder {fp_old[:12]}, now {fp_now[:12]})")
    redone = set(store.data["meta"].get("redone", []))      # export/sun_rows.redo_once: never the old cell
    for task, cells in ((t, c) for t, c in old.get("cells", {}).items() if t in tasks):
        for row, cell in cells.items():
            if store.get(task, row) is None and f"{task}:{row}" not in redone:
                store.data["cells"].setdefault(task, {})[row] = cell
    walls = store.data["meta"].setdefault("wall_s", {})
    for task, w in old.get("meta", {}).get("wall_s", {}).items():
        if task in tasks:
            walls.setdefault(task, w)      # the reused rows' own training and scoring time
    store.data["meta"].setdefault("reused_from", str(earlier))
    store.save()


def _adapter_specialist(fp_base, task: TaskData, cfg: TuneConfig, out, name: str, progress: bool,
                        decoder, init=None):
    """The trained adapter over the fp base, called like a prefill module (loaded when saved)."""
    d = Path(out) / "specialists" / task.name / name if out else None
    if d is not None and (d / MANIFEST).is_file():
        ad = load_adapter(d, fp_base.cfg)
        trainee = make_trainee(fp_base, cfg.rank, cfg.alpha, cfg.targets, cfg.seed, init=ad).eval()
        for p in trainee.parameters():
            p.requires_grad_(False)
        return trainee
    cfg = replace(cfg, max_new=task.max_new, stop_ids=task.stop_ids)
    return tune(fp_base, task.train, cfg, eval_set=(), out_dir=d, decoder=decoder, init=init,
                progress=progress, manifest_extra={"task": task.name}).prefill


def lora_table(base, tasks: Sequence[TaskData], sun: TuneConfig, qsun: TuneConfig, out_dir=None,
               rows: Sequence[str] = LORA_ROWS, eval_batch: int = 16, earlier=None, progress: bool = True,
               log: Callable[[str], None] = print) -> dict:
    """Tune and score the adapter rows for each task; returns the results dict (with any earlier cells)."""
    out, store, base, (fp_dec, fp_fp), (q_dec, q_fp) = open_table(base, out_dir)
    store.data["meta"].setdefault("lora_config", {"sun": repr(sun), "qsun": repr(qsun)})
    if earlier:
        seed_from(store, earlier, [t.name for t in tasks])
    for task in tasks:
        t0 = time.perf_counter()
        need = [r for r in rows if store.get(task.name, r) is None]
        ad_sun = ad_q = None
        if need:
            ad_sun = _adapter_specialist(fp_dec, task, sun, out, "sun_lora", progress, (fp_dec, fp_fp))
            if "sun_lora" in need:
                store.put(task.name, "sun_lora", _score(task, ad_sun, fp_dec, eval_batch, "sun_lora", progress))
        if "qsun_lora" in need:
            ad_q = _adapter_specialist(base, task, qsun, out, "qsun_lora", progress, (q_dec, q_fp),
                                       init=ad_sun.frozen_adapter())
            store.put(task.name, "qsun_lora", _score(task, ad_q, q_dec, eval_batch, "qsun_lora", progress))
        walls = store.data["meta"].setdefault("wall_s_lora", {})
        walls[task.name] = round(walls.get(task.name, 0.0) + time.perf_counter() - t0, 1)
        store.save()
        log(f"{task.name}: " + ", ".join(f"{r}={store.get(task.name, r)['acc']:.3f}" for r in rows))
    return store.data
