"""The accuracy table's adapter rows (export/sun_eval_lora.py) on a tiny model.

SUN-LoRA and QSUN-LoRA are tuned and scored into the same results store as the classic rows;
cells of an earlier results JSON are kept, not recomputed; a rerun trains and scores nothing;
an earlier JSON from another base is refused; the markdown names the adapter rows with the rank.
"""
import json

import pytest
import torch

import export.sun_eval_lora as rows_mod
from export.sun_eval_lora import LORA_ROWS, lora_table, lora_titles
from edge.model.transformer import Transformer, tiny_config
from export.sun_eval import markdown_table
from export.tasks import SYNTHETIC, VOCAB, TaskData, split
from export.tune import TuneConfig, build_decoder

LORA = dict(mode="sun", adapter="lora", rank=4, alpha=8.0, batch_size=8, lr=1e-2, warmup=0, ckpt_every=2)


def tiny_task():
    torch.manual_seed(0)
    base = Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64))
    t = SYNTHETIC["reverse"]
    tr, ev = split(t, 200, 6, seed=2)
    return base, TaskData("reverse", tr, ev, t.max_new, t.stop_ids)


def test_adapter_rows_are_tuned_scored_recorded_and_resumed(tmp_path, monkeypatch):
    base, task = tiny_task()
    _, fp = build_decoder(base.float().eval(), "fp32")
    earlier = tmp_path / "earlier.json"
    kept = {"acc": 0.125, "ce": 1.5, "n": 6}
    earlier.write_text(json.dumps({"meta": {"decoder_fp32": fp},
                                   "cells": {"reverse": {"sun": kept}, "other": {"sun": kept}}}))
    sun, qsun = TuneConfig(steps=3, **LORA), TuneConfig(decoder="int4", steps=2, **LORA)
    res = lora_table(base, [task], sun, qsun, out_dir=tmp_path / "work", eval_batch=4, earlier=earlier,
                     progress=False, log=lambda s: None)
    cells = res["cells"]["reverse"]
    assert cells["sun"] == kept and "other" not in res["cells"]      # reused, only the tasks run
    for r in LORA_ROWS:
        assert cells[r]["n"] == 6 and 0.0 <= cells[r]["acc"] <= 1.0 and cells[r]["ce"] > 0
    assert cells["sun_lora"]["ce"] != cells["qsun_lora"]["ce"]      # different decoders and adapters
    spec = tmp_path / "work" / "specialists" / "reverse"
    for name, kind in (("sun_lora", "sun-lora"), ("qsun_lora", "qsun-lora")):
        man = json.loads((spec / name / "manifest.json").read_text())
        assert man["kind"] == kind and man["adapter"]["rank"] == 4
    on_disk = json.loads((tmp_path / "work" / "results.json").read_text())
    assert on_disk["cells"]["reverse"]["sun_lora"] == cells["sun_lora"]

    def must_not_run(*a, **k):
        raise AssertionError("a finished cell was recomputed")
    monkeypatch.setattr(rows_mod, "tune", must_not_run)
    monkeypatch.setattr(rows_mod, "_score", must_not_run)
    again = lora_table(base, [task], sun, qsun, out_dir=tmp_path / "work", eval_batch=4, earlier=earlier,
                       progress=False, log=lambda s: None)
    assert again["cells"]["reverse"] == cells

    md = markdown_table(again, ("sun",) + LORA_ROWS, titles=lora_titles(4))
    assert "SUN-LoRA (prefill-only adapter, rank 4)" in md and "QSUN-LoRA" in md and "0.125" in md


def test_a_saved_adapter_is_scored_again_as_tuned(tmp_path, monkeypatch):
    base, task = tiny_task()
    sun, qsun = TuneConfig(steps=3, **LORA), TuneConfig(decoder="int4", steps=2, **LORA)
    first = lora_table(base, [task], sun, qsun, out_dir=tmp_path / "w", rows=("sun_lora",), eval_batch=4,
                       progress=False, log=lambda s: None)
    (tmp_path / "w" / "results.json").unlink()                       # keep the adapter, drop the cell
    monkeypatch.setattr(rows_mod, "tune", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    second = lora_table(base, [task], sun, qsun, out_dir=tmp_path / "w", rows=("sun_lora",), eval_batch=4,
                        progress=False, log=lambda s: None)
    assert second["cells"]["reverse"]["sun_lora"] == first["cells"]["reverse"]["sun_lora"]


def test_an_earlier_json_from_another_base_is_refused(tmp_path):
    base, task = tiny_task()
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"meta": {"decoder_fp32": "0" * 64}, "cells": {}}))
    with pytest.raises(ValueError, match="another base"):
        lora_table(base, [task], TuneConfig(steps=1, **LORA), TuneConfig(decoder="int4", steps=1, **LORA),
                   out_dir=tmp_path / "w", earlier=earlier, progress=False, log=lambda s: None)


def test_the_results_json_records_repo_relative_paths(tmp_path):
    from argparse import Namespace

    from benchmarks.lib.results import ROOT
    from benchmarks.sun.sun_accuracy import recorded_args
    args = Namespace(work=str(ROOT / "runs" / "w"), out=str(ROOT / "benchmarks/results/sun_accuracy/v"), rank=16)
    rec = recorded_args(args)
    assert rec["work"] == "runs/w" and rec["out"] == "benchmarks/results/sun_accuracy/v" and rec["rank"] == 16
    assert args.out.startswith("/")                                  # the run's own args are untouched
    outside = recorded_args(Namespace(work="runs/w", out=str(tmp_path / "v")))
    assert outside["out"] == str(tmp_path / "v")                     # outside the repo: kept as given


def test_the_lr_probe_trains_on_training_pairs_only_and_reports_loss_and_step_time():
    from benchmarks.lib.sun_lora_probe import lr_probe, probe_markdown
    base, task = tiny_task()
    held_out = list(task.eval)
    p = lr_probe(base, task, [1e-4, 3e-2], steps=4, rank=4, alpha=8.0, batch_size=8, held=16, log=lambda s: None)
    assert task.eval == held_out and p["held"] == 16 and [r["lr"] for r in p["runs"]] == [1e-4, 3e-2]
    assert all(r["s_per_step"] > 0 for r in p["runs"])
    slow, fast = p["runs"]
    assert fast["loss"] < p["base_loss"] and fast["loss"] < slow["loss"]   # the larger lr learns in 4 steps
    md = probe_markdown("tiny", [p], "here", 1)
    assert "| reverse | 4 | 0.03 |" in md and "| reverse | 0 | base |" in md
