"""The SUN accuracy table row by row, resumable at every level, within bounded memory.

A row (export/sun_eval.py's six, export/sun_eval_lora.py's two adapter rows) is computed for one
task at a time and recorded in the work directory's results.json the moment it is scored; a
recorded row is never computed again. What a row needs is kept too: each trained specialist
(full FT, SUN, QSUN prefill, SUN-LoRA and QSUN-LoRA adapter) in specialists/<task>/<name>/, its
training checkpointed (export/tune.py: every few steps or minutes) and resumed mid-way, and the
scoring of a row batch by batch in scoring/<task>/<row>.json.

Memory (a 0.5B base on a shared CPU box): the fp decoder IS the base (no copy), the int4 decoder
shares every tensor the int4 grid leaves in float with it (embeddings, norms, biases, head), a
decoder is built only for the row that needs it, and a specialist's frozen embeddings are the
base's own (tune_memory.share_embeddings). Specialists and decoders are dropped after each row.

Per row the cell records its score, answer CE, the held-out count, the scoring seconds and the
training seconds of the specialists it was the first to need (summed over resumed runs).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from edge.model.sun_modules import (MANIFEST, exact_match, greedy_from_prefill, pad_right, prefill_batch,
                                    read_manifest, weights_fingerprint)
from edge.model.transformer import Transformer
from edge.telemetry.cpu_info import cpu_name
from export.quant import fake_quant_state_dict
from export.sun_eval import ROWS, _specialist, _Store
from export.sun_eval_lora import LORA_ROWS, _adapter_specialist
from export.tasks import TaskData
from export.tune import CKPT_DIR, TuneConfig, answer_ce_sum
from export.tune_memory import share_embeddings

ALL_ROWS = ROWS + LORA_ROWS
# the specialists a row needs, in training order (a later one starts from the one before)
NEEDS = {"base": (), "full_ft": ("full",), "naive_reuse": ("full",), "sun": ("sun",), "int4_rtn": ("sun",),
         "qsun": ("sun", "qsun"), "sun_lora": ("sun_lora",), "qsun_lora": ("sun_lora", "qsun_lora")}
INT4_ROWS = ("int4_rtn", "qsun", "qsun_lora")
FULL_COPIES = ("full", "sun", "qsun")          # specialists that are a whole model (the others: adapters)


@dataclass
class RowPlan:
    """How each specialist is tuned; eval_batch: prompts decoded at once when scoring."""
    full: TuneConfig = field(default_factory=lambda: TuneConfig(mode="full"))
    sun: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun"))
    qsun: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun", decoder="int4"))
    sun_lora: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun", adapter="lora"))
    qsun_lora: TuneConfig = field(default_factory=lambda: TuneConfig(mode="sun", decoder="int4", adapter="lora"))
    eval_batch: int = 8


def int4_decoder(base: Transformer) -> Transformer:
    """The QSUN decoder around the base's own tensors: only the int4 projections are new."""
    dec = Transformer.from_state_dict(base.cfg, fake_quant_state_dict(base.state_dict()))
    for p in dec.parameters():
        p.requires_grad_(False)
    return dec


class RowRunner:
    """Computes (task, row) cells one at a time into `out_dir` (see the module docstring)."""

    def __init__(self, base: Transformer, out_dir, plan: RowPlan, progress: bool = True,
                 log: Callable[[str], None] = print):
        self.out, self.plan, self.progress, self.log = Path(out_dir), plan, progress, log
        self.out.mkdir(parents=True, exist_ok=True)
        self.base = base.float().eval()
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.store = _Store(self.out)
        self.fp = weights_fingerprint(self.base, "fp32")
        old = self.store.data["meta"].get("decoder_fp32")
        if old and old != self.fp:
            raise ValueError(f"{self.out} holds results for another base model (decoder {old[:12]}, now "
                             f"{self.fp[:12]}); use a new --work directory")
        self.store.data["meta"]["decoder_fp32"] = self.fp
        self.store.save()
        self._int4 = None

    # -- what a row is made of -----------------------------------------------------------------

    def decoder(self, row: str):
        if row not in INT4_ROWS:
            return self.base, self.fp
        if self._int4 is None:
            dec = int4_decoder(self.base)
            self._int4 = (dec, weights_fingerprint(dec, "int4"))
            self.store.data["meta"]["decoder_int4"] = self._int4[1]
        return self._int4

    def specialist_dir(self, task: str, name: str) -> Path:
        return self.out / "specialists" / task / name

    def _specialists(self, task: TaskData, row: str) -> Dict[str, object]:
        """Train (or load) what the row needs, in order; each later one starts from the one before."""
        got: Dict[str, object] = {}
        p = self.plan
        for name in NEEDS[row]:
            if name == "full":
                got[name] = _specialist(self.base, task, p.full, self.out, "full", self.progress)
            elif name == "sun":
                got[name] = _specialist(self.base, task, p.sun, self.out, "sun", self.progress,
                                        decoder=(self.base, self.fp))
            elif name == "qsun":
                got[name] = _specialist(self.base, task, p.qsun, self.out, "qsun", self.progress,
                                        decoder=self.decoder("qsun"), init=got["sun"])
            elif name == "sun_lora":
                got[name] = _adapter_specialist(self.base, task, p.sun_lora, self.out, "sun_lora", self.progress,
                                                (self.base, self.fp))
            else:
                got[name] = _adapter_specialist(self.base, task, p.qsun_lora, self.out, "qsun_lora",
                                                self.progress, self.decoder("qsun_lora"),
                                                init=got["sun_lora"].frozen_adapter())
            if isinstance(got[name], Transformer):
                share_embeddings(got[name], self.base)     # frozen ones: the base's, not a second copy
            # a saved specialist is loaded, never resumed: its training checkpoint (weights + AdamW
            # state, ~4 GB on a 0.5B base) is dead weight on disk
            shutil.rmtree(self.specialist_dir(task.name, name) / CKPT_DIR, ignore_errors=True)
        return got

    def pair(self, task: TaskData, row: str):
        """(prefill, decoder) of a row, training what is missing."""
        s = self._specialists(task, row)
        dec = self.decoder(row)[0]
        return {"base": (self.base, self.base), "full_ft": (s.get("full"), s.get("full")),
                "naive_reuse": (s.get("full"), dec), "sun": (s.get("sun"), dec), "int4_rtn": (s.get("sun"), dec),
                "qsun": (s.get("qsun"), dec), "sun_lora": (s.get("sun_lora"), dec),
                "qsun_lora": (s.get("qsun_lora"), dec)}[row]

    # -- one row -------------------------------------------------------------------------------

    def run_row(self, task: TaskData, row: str) -> Optional[dict]:
        """Compute and record one cell; None when it was recorded already (nothing is recomputed)."""
        if row not in ALL_ROWS:
            raise ValueError(f"unknown row {row!r}; choose from {', '.join(ALL_ROWS)}")
        if self.store.get(task.name, row) is not None:
            return None
        fresh = [n for n in NEEDS[row] if not (self.specialist_dir(task.name, n) / MANIFEST).is_file()]
        t0 = time.perf_counter()
        prefill, decoder = self.pair(task, row)
        t1 = time.perf_counter()
        path = self.out / "scoring" / task.name / f"{row}.json"
        cell = score_resumable(task, prefill, decoder, self.plan.eval_batch, path, row, self.progress)
        cell["train_s"] = round(sum(self._train_s(task.name, n) for n in fresh), 3)
        cell["trained"] = fresh
        cell["score_s"] = round(cell.pop("scored_s"), 1)     # summed over resumed runs, like train_s
        cell["prepare_s"] = round(t1 - t0, 1)                # this run: training and loading what it needs
        cell["load1"] = round(os.getloadavg()[0], 2)
        cell["cpu"] = cpu_name()                            # rows of one table may span machines
        picked = {n: s for n in fresh if (s := self._picked(task.name, n)) is not None}
        if picked:
            cell["picked_step"] = picked                     # a re-tune's kept step (export/tune_select.py)
        self.store.put(task.name, row, cell)
        del prefill, decoder
        if row in INT4_ROWS:
            self._int4 = None                      # a decoder is held for the row that needs it only
        gc.collect()
        self.log(f"{task.name}/{row}: {cell['acc']:.3f} (ce {cell['ce']:.3f}, {cell['n']} prompts; "
                 f"train {cell['train_s'] / 3600:.2f} h, score {cell['score_s'] / 3600:.2f} h)")
        return cell

    def _picked(self, task: str, name: str) -> Optional[int]:
        tail = read_manifest(self.specialist_dir(task, name)).get("history_tail", [])
        return next((h["picked_step"] for h in reversed(tail) if "picked_step" in h), None)

    def _train_s(self, task: str, name: str) -> float:
        tail = read_manifest(self.specialist_dir(task, name)).get("history_tail", [])
        return float(next((h["train_s"] for h in reversed(tail) if "train_s" in h), 0.0))


@torch.inference_mode()
def score_batch(prefill, decoder, examples, max_new: int, stop_ids) -> tuple:
    """(greedy answers, answer CE x examples) of a batch from ONE prefill: export/sun_eval._score's
    numbers (split_generate's tokens, split_loss's CE at the same padding) at half its prefill cost."""
    dev = next(prefill.parameters()).device
    toks, plens = pad_right([e.prompt for e in examples], device=dev)
    first, kv, plens = prefill_batch(prefill, toks, plens)
    total, count = answer_ce_sum(decoder, first, kv, plens, [e.answer for e in examples])
    preds = greedy_from_prefill(decoder, first, kv, plens, max_new, set(stop_ids))
    return preds, float(total / count) * len(examples)


def score_resumable(task: TaskData, prefill, decoder, batch: int, path: Optional[Path], label: str = "",
                    progress: bool = False) -> dict:
    """export/sun_eval._score, each batch's greedy answers and CE kept in `path` as it finishes:
    a killed scoring resumes at the batch it was in (path None: nothing kept). Kept batches of another
    eval set are refused."""
    from tqdm.auto import tqdm
    prompts = [e.prompt for e in task.eval]
    key = {"n": len(prompts), "batch": batch, "first": prompts[0] if prompts else [], "max_new": task.max_new}
    state = {"key": key, "preds": {}, "ce": {}, "s": 0.0}
    if path is not None and path.is_file():
        state = json.loads(path.read_text())
        if state["key"] != key:
            raise ValueError(f"{path} holds the scoring of another eval set or batch ({state['key']['n']} prompts, "
                             f"batch {state['key']['batch']}); delete it to score again")
    starts = range(0, len(prompts), batch)
    for i in tqdm([i for i in starts if str(i) not in state["preds"]], desc=f"eval {task.name}/{label}",
                  unit="batch", disable=not progress, leave=False):
        t0 = time.perf_counter()
        state["preds"][str(i)], state["ce"][str(i)] = score_batch(prefill, decoder, task.eval[i: i + batch],
                                                                  task.max_new, task.stop_ids)
        state["s"] += time.perf_counter() - t0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(path)
    preds: List[List[int]] = [p for i in starts for p in state["preds"][str(i)]]
    acc = (task.score or (lambda p, ex: exact_match(p, [e.answer for e in ex])))(preds, task.eval)
    ce = sum(state["ce"].values()) / max(1, len(prompts))
    return {"acc": round(float(acc), 4), "ce": round(ce, 4), "n": len(prompts), "scored_s": state["s"]}


def run_rows(runner: RowRunner, tasks: Sequence[TaskData], rows: Sequence[str],
             after_row: Callable[[dict], None] = lambda results: None, prune: bool = False) -> dict:
    """Every (task, row) cell, task by task in the order given; after_row(results) after each new cell.
    prune: delete a full-copy specialist (a model's worth of disk) once none of `rows` still needs it."""
    for task in tasks:
        runner.store.data["cells"].setdefault(task.name, {})
        for row in rows:
            if runner.run_row(task, row) is not None:
                after_row(runner.store.data)
            if prune:
                _prune(runner, task.name, rows)
    return runner.store.data


def redo_once(runner: RowRunner, cells: Sequence[str]) -> List[str]:
    """Drop each "task:row" cell -- its score, its kept scoring batches and the specialist no other row
    needs (QSUN's, QSUN-LoRA's) -- so that run_rows computes it again. Once per cell: the store lists
    it under meta "redone", and a rerun with the same cells keeps what was computed since."""
    done = runner.store.data["meta"].setdefault("redone", [])
    dropped = []
    for cell in (c for c in cells if c not in done):
        task, row = cell.split(":")
        runner.store.data["cells"].get(task, {}).pop(row, None)
        (runner.out / "scoring" / task / f"{row}.json").unlink(missing_ok=True)
        for name in NEEDS[row][-1:]:
            if not any(name in needs for r, needs in NEEDS.items() if r != row):
                shutil.rmtree(runner.specialist_dir(task, name), ignore_errors=True)
        done.append(cell)
        dropped.append(cell)
    runner.store.save()
    return dropped


def _prune(runner: RowRunner, task: str, rows: Sequence[str]) -> None:
    pending = [r for r in rows if runner.store.get(task, r) is None]
    for name in FULL_COPIES:
        if not any(name in NEEDS[r] for r in pending):
            shutil.rmtree(runner.specialist_dir(task, name), ignore_errors=True)
