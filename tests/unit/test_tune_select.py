"""Keeping the best step of a re-tune (export/tune_select.py): the held-back pairs are a seeded draw
never trained on, the start (step 0) competes, the module ends at the judged step of lowest held-back
CE with exactly that step's weights, a killed run resumes with the best it had, and the accuracy
table's --redo recomputes a cell once (export/sun_rows.redo_once)."""
import json

import pytest
import torch

from edge.model.transformer import Transformer, tiny_config
from export.sun_eval_lora import seed_from
from export.sun_rows import RowPlan, RowRunner, redo_once, run_rows
from export.tasks import SYNTHETIC, VOCAB, TaskData, split
from export.tune import TuneConfig, TuneError, tune
from export.tune_select import hold_back

BASE = dict(batch_size=4, warmup=0, seed=3)


def setup():
    torch.manual_seed(0)
    base = Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64, arch="qwen2"))
    tr, ev = split(SYNTHETIC["reverse"], 64, 6, seed=1)
    return base, tr, ev


def start(base, tr):
    """A tuned prefill module to re-tune from (as QSUN starts from SUN)."""
    return tune(base, tr, TuneConfig(steps=6, lr=1e-2, **BASE), progress=False).prefill


def test_the_held_back_pairs_are_a_seeded_draw_apart_from_training():
    _, tr, _ = setup()
    kept, held = hold_back(tr, 8, seed=3)
    again_kept, again_held = hold_back(tr, 8, seed=3)
    assert len(held) == 8 and len(kept) == len(tr) - 8
    assert [e.prompt for e in held] == [e.prompt for e in again_held]
    assert not {id(e) for e in held} & {id(e) for e in kept}
    assert [e.prompt for e in hold_back(tr, 8, seed=4)[1]] != [e.prompt for e in held]
    with pytest.raises(ValueError, match="hold back"):
        hold_back(tr, len(tr), seed=3)
    with pytest.raises(TuneError, match="select_every and select_n"):
        TuneConfig(select_every=2)


def test_a_retune_that_only_gets_worse_ends_where_it_started():
    base, tr, _ = setup()
    init = start(base, tr)
    wild = dict(BASE, steps=4, lr=3.0, decoder="int4")        # a rate that wrecks the module at once
    plain = tune(base, tr, TuneConfig(**wild), init=init, progress=False).prefill.state_dict()
    res = tune(base, tr, TuneConfig(select_every=2, select_n=8, **wild), init=init, progress=False)
    final = res.history[-1]
    assert [j["step"] for j in final["judged"]] == [0, 2, 4]
    assert final["picked_step"] == 0 and final["val_ce"] == min(j["val_ce"] for j in final["judged"])
    ref = init.state_dict()
    for k, v in res.prefill.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
    assert any(not torch.equal(v, ref[k]) for k, v in plain.items())    # without selection it moved


def test_the_picked_step_is_the_lowest_judged_and_its_weights_are_that_steps():
    base, tr, _ = setup()
    init = start(base, tr)
    flat = dict(BASE, lr=3e-2, min_lr_frac=1.0)        # a constant rate: a shorter run is this run's prefix
    res = tune(base, tr, TuneConfig(select_every=1, select_n=8, steps=5, **flat), init=init, progress=False)
    final = res.history[-1]
    ces = {j["step"]: j["val_ce"] for j in final["judged"]}
    assert sorted(ces) == [0, 1, 2, 3, 4, 5] and final["picked_step"] == min(ces, key=ces.get)
    kept, _ = hold_back(tr, 8, seed=3)                  # the same pairs, the same batches, stopped there
    ref = (tune(base, kept, TuneConfig(steps=final["picked_step"], **flat), init=init, progress=False).prefill
           if final["picked_step"] else init).state_dict()
    for k, v in res.prefill.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def test_a_killed_run_resumes_with_the_best_it_had(tmp_path):
    base, tr, _ = setup()
    init = start(base, tr)
    cfg = TuneConfig(select_every=2, select_n=8, steps=6, lr=3e-2, ckpt_every=2, decoder="int4", **BASE)
    whole = tune(base, tr, cfg, init=init, progress=False)

    def die(step):
        if step == 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tune(base, tr, cfg, init=init, out_dir=tmp_path, progress=False, on_step=die)
    meta = json.loads((tmp_path / "checkpoint" / "best.json").read_text())
    assert [s["step"] for s in meta["seen"]] == [0, 2, 4]
    resumed = tune(base, tr, cfg, init=init, out_dir=tmp_path, progress=False)
    got, want = resumed.history[-1], whole.history[-1]
    assert [j["step"] for j in got["judged"]] == [0, 2, 4, 6]
    assert got["picked_step"] == want["picked_step"] and got["val_ce"] == pytest.approx(want["val_ce"], abs=1e-5)
    for k, v in resumed.prefill.state_dict().items():
        torch.testing.assert_close(v, whole.prefill.state_dict()[k], rtol=0, atol=0)


def test_redo_recomputes_a_cell_once_and_keeps_its_start(tmp_path):
    base, tr, ev = setup()
    task = TaskData("reverse", tr, ev, SYNTHETIC["reverse"].max_new, SYNTHETIC["reverse"].stop_ids)
    fast = dict(BASE, lr=1e-2, micro_batch=2, freeze_embeddings=True)
    p = RowPlan(sun=TuneConfig(steps=3, **fast), qsun=TuneConfig(decoder="int4", steps=2, **fast), eval_batch=4)
    runner = RowRunner(base, tmp_path, p, progress=False, log=lambda s: None)
    run_rows(runner, [task], ("sun", "qsun"))
    earlier = tmp_path / "earlier.json"
    earlier.write_text((tmp_path / "results.json").read_text())
    assert redo_once(runner, ["reverse:qsun"]) == ["reverse:qsun"]
    assert runner.store.get("reverse", "qsun") is None and runner.store.get("reverse", "sun") is not None
    assert not (tmp_path / "scoring" / "reverse" / "qsun.json").exists()
    assert not runner.specialist_dir("reverse", "qsun").exists() and runner.specialist_dir("reverse", "sun").exists()
    seed_from(runner.store, earlier, ["reverse"])        # an earlier table never brings the old cell back
    assert runner.store.get("reverse", "qsun") is None
    run_rows(runner, [task], ("sun", "qsun"))
    new = runner.store.get("reverse", "qsun")
    assert new is not None and new["trained"] == ["qsun"]
    again = RowRunner(base, tmp_path, p, progress=False, log=lambda s: None)
    assert redo_once(again, ["reverse:qsun"]) == [] and again.store.get("reverse", "qsun") == new


def test_the_tables_command_line_takes_redo_cells_and_selects_re_tunes_only():
    from benchmarks.sun.sun_accuracy import parse, plan
    args = parse(["--redo", "tools:qsun-lora,code:qsun", "--select-every", "5", "--select-n", "16"])
    assert args.redo == ["tools:qsun_lora", "code:qsun"]
    p = plan(args)
    assert (p.qsun.select_every, p.qsun.select_n, p.qsun_lora.select_every, p.qsun_lora.select_n) == (5, 16, 5, 16)
    assert p.sun.select_every == p.sun_lora.select_every == p.full.select_every == 0
    assert plan(parse(["--select-every", "0"])).qsun_lora.select_n == 0
    with pytest.raises(SystemExit):
        parse(["--redo", "tools:nonsense"])


def test_a_cell_records_its_cpu_and_the_kept_step_and_the_table_says_both(tmp_path):
    from benchmarks.sun.sun_accuracy_report import write
    from edge.telemetry.cpu_info import cpu_name
    base, tr, ev = setup()
    task = TaskData("reverse", tr, ev, SYNTHETIC["reverse"].max_new, SYNTHETIC["reverse"].stop_ids)
    fast = dict(BASE, lr=1e-2, micro_batch=2, freeze_embeddings=True)
    p = RowPlan(sun=TuneConfig(steps=3, **fast), eval_batch=4,
                qsun=TuneConfig(decoder="int4", steps=2, select_every=1, select_n=8, **fast))
    res = run_rows(RowRunner(base, tmp_path, p, progress=False, log=lambda s: None), [task], ("sun", "qsun"))
    cells = res["cells"]["reverse"]
    assert cells["sun"]["cpu"] == cells["qsun"]["cpu"] == cpu_name() and "picked_step" not in cells["sun"]
    kept = cells["qsun"]["picked_step"]["qsun"]
    assert kept in (0, 1, 2)
    res["cells"]["reverse"]["base"] = {"acc": 0.1, "ce": 1.0, "n": 6}      # a cell from before cells said their CPU
    md = write(res, tmp_path / "t", ["reverse"], ["base", "sun", "qsun"], {}, "tiny", "notes\n", {})
    assert f"* {cpu_name()}: reverse SUN (prefill-only tuning), reverse QSUN (re-tuned for the int4 decoder) " \
           f"(step {kept} kept)" in md
    assert "* not recorded in the cell: reverse base model" in md
