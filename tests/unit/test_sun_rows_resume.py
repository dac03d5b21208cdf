"""The accuracy table row by row (export/sun_rows.py) on a tiny random model: every row is
computed once and recorded, a finished row is never recomputed, a killed training resumes from
its checkpoint (and ends where an uninterrupted one does), a killed scoring resumes at its batch,
and the table shows missing rows as "-" with a line naming them."""
import json

import pytest
import torch

import export.sun_rows as rows_mod
import export.tune as tune_mod
from benchmarks.sun.sun_accuracy_report import write
from edge.model.transformer import Transformer, tiny_config
from export.sun_rows import ALL_ROWS, RowPlan, RowRunner, run_rows
from export.tasks import SYNTHETIC, VOCAB, TaskData, split
from export.tune import TuneConfig

FAST = dict(batch_size=4, lr=1e-2, warmup=0, ckpt_every=2)
LORA = dict(FAST, adapter="lora", rank=4, alpha=8.0)


def tiny():
    torch.manual_seed(0)
    base = Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64, arch="qwen2"))
    t = SYNTHETIC["reverse"]
    tr, ev = split(t, 100, 6, seed=2)
    return base, TaskData("reverse", tr, ev, t.max_new, t.stop_ids)


def plan(**over) -> RowPlan:
    mem = dict(micro_batch=2, freeze_embeddings=True)
    return RowPlan(full=TuneConfig(mode="full", steps=4, **FAST, **mem), sun=TuneConfig(steps=4, **FAST, **mem),
                   qsun=TuneConfig(decoder="int4", steps=2, **FAST, **mem), sun_lora=TuneConfig(steps=4, **LORA),
                   qsun_lora=TuneConfig(decoder="int4", steps=2, **LORA), eval_batch=4, **over)


def quiet(base, work, p=None):
    return RowRunner(base, work, p or plan(), progress=False, log=lambda s: None)


def never(*a, **k):
    raise AssertionError("a finished row was recomputed")


def test_every_row_is_recorded_once_and_never_recomputed(tmp_path, monkeypatch):
    base, task = tiny()
    seen = []
    res = run_rows(quiet(base, tmp_path), [task], ALL_ROWS, lambda r: seen.append(len(r["cells"]["reverse"])))
    cells = res["cells"]["reverse"]
    assert seen == list(range(1, len(ALL_ROWS) + 1))             # the table is rewritten after every row
    for r in ALL_ROWS:
        assert cells[r]["n"] == 6 and 0 <= cells[r]["acc"] <= 1 and cells[r]["ce"] > 0 and cells[r]["score_s"] >= 0
    assert cells["full_ft"]["trained"] == ["full"] and cells["naive_reuse"]["trained"] == []
    assert cells["qsun"]["trained"] == ["qsun"] and cells["qsun_lora"]["trained"] == ["qsun_lora"]
    assert cells["full_ft"]["train_s"] > 0 and cells["naive_reuse"]["train_s"] == 0
    assert cells["sun"]["ce"] != cells["int4_rtn"]["ce"]           # same prefill, the other decoder

    monkeypatch.setattr(rows_mod, "score_resumable", never)
    monkeypatch.setattr(tune_mod, "tune", never)
    again = run_rows(quiet(base, tmp_path), [task], ALL_ROWS, never)
    assert again["cells"]["reverse"] == cells


def test_pruning_keeps_what_a_pending_row_needs_and_no_checkpoint(tmp_path):
    base, task = tiny()
    spec = tmp_path / "specialists" / "reverse"
    seen = []

    def look(results):
        seen.append(sorted(p.name for p in spec.iterdir()) if spec.is_dir() else [])
    run_rows(quiet(base, tmp_path), [task], ("full_ft", "sun", "naive_reuse", "sun_lora", "qsun"), look, prune=True)
    # after full_ft: full kept (naive_reuse pends); after sun: sun kept (qsun pends); full gone once
    # naive_reuse is done; adapters are kept; sun and qsun gone at the end
    assert seen == [["full"], ["full", "sun"], ["full", "sun"], ["sun", "sun_lora"], ["qsun", "sun", "sun_lora"]]
    assert sorted(p.name for p in spec.iterdir()) == ["sun_lora"]
    assert not (spec / "sun_lora" / "checkpoint").exists()


def test_a_dropped_row_is_recomputed_from_its_kept_specialists(tmp_path, monkeypatch):
    base, task = tiny()
    first = run_rows(quiet(base, tmp_path), [task], ("sun", "qsun"))["cells"]["reverse"]
    store = tmp_path / "results.json"
    data = json.loads(store.read_text())
    del data["cells"]["reverse"]["qsun"]
    store.write_text(json.dumps(data))
    (tmp_path / "scoring" / "reverse" / "qsun.json").unlink()     # scored again, from the kept specialist
    import export.sun_eval as eval_mod
    monkeypatch.setattr(eval_mod, "tune", never)
    got = run_rows(quiet(base, tmp_path), [task], ("sun", "qsun"))["cells"]["reverse"]
    assert got["qsun"]["acc"] == first["qsun"]["acc"] and got["qsun"]["ce"] == first["qsun"]["ce"]
    assert got["qsun"]["trained"] == [] and got["sun"] == first["sun"]


class Killed(Exception):
    pass


def kill_after(monkeypatch, module, name, calls):
    """Make module.name raise Killed on call number `calls` + 1 (the process dies there)."""
    real, n = getattr(module, name), [0]

    def wrapped(*a, **k):
        n[0] += 1
        if n[0] > calls:
            raise Killed
        return real(*a, **k)
    monkeypatch.setattr(module, name, wrapped)
    return n


@pytest.mark.parametrize("row", ["full_ft", "sun_lora"])
def test_a_killed_training_resumes_from_its_checkpoint(tmp_path, monkeypatch, row):
    base, task = tiny()
    whole = run_rows(quiet(base, tmp_path / "whole"), [task], (row,))["cells"]["reverse"][row]
    import export.tune_memory as mem
    with monkeypatch.context() as m:                 # two micro-batches a step: dies inside step 4
        kill_after(m, mem, "accumulate", 3)
        with pytest.raises(Killed):
            run_rows(quiet(base, tmp_path / "cut"), [task], (row,))
    name = {"full_ft": "full", "sun_lora": "sun_lora"}[row]
    state = json.loads((tmp_path / "cut" / "specialists" / "reverse" / name / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2                         # ckpt_every=2: the last checkpoint before the kill
    calls = kill_after(monkeypatch, mem, "accumulate", 10 ** 6)
    resumed = run_rows(quiet(base, tmp_path / "cut"), [task], (row,))["cells"]["reverse"][row]
    assert calls[0] == 2                              # steps 3 and 4 only
    assert resumed["acc"] == whole["acc"] and resumed["ce"] == pytest.approx(whole["ce"], abs=1e-6)


def test_a_killed_scoring_resumes_at_its_batch(tmp_path, monkeypatch):
    base, task = tiny()
    whole = run_rows(quiet(base, tmp_path / "whole"), [task], ("base",))["cells"]["reverse"]["base"]
    with monkeypatch.context() as m:
        kill_after(m, rows_mod, "greedy_from_prefill", 1)  # eval_batch 4 of 6 prompts: dies in the second batch
        with pytest.raises(Killed):
            run_rows(quiet(base, tmp_path / "cut"), [task], ("base",))
    calls = kill_after(monkeypatch, rows_mod, "greedy_from_prefill", 10 ** 6)
    got = run_rows(quiet(base, tmp_path / "cut"), [task], ("base",))["cells"]["reverse"]["base"]
    assert calls[0] == 1 and got["acc"] == whole["acc"] and got["ce"] == pytest.approx(whole["ce"])
    with pytest.raises(ValueError, match="another eval set"):    # kept batches of another batch size
        rows_mod.score_resumable(task, base, base, 2, tmp_path / "cut" / "scoring" / "reverse" / "base.json")


def test_one_prefill_scores_as_split_generate_and_split_loss_do():
    from edge.model.sun_modules import split_generate
    from export.sun_eval import _score
    base, task = tiny()
    sun = Transformer(base.cfg)
    sun.load_state_dict({k: v + 0.01 * torch.randn_like(v) for k, v in base.state_dict().items()})
    ref = _score(task, sun, base, 4)
    got = rows_mod.score_resumable(task, sun, base, 4, None)
    assert (got["acc"], got["ce"], got["n"]) == (ref["acc"], ref["ce"], ref["n"])
    preds, _ = rows_mod.score_batch(sun, base, task.eval[:4], task.max_new, task.stop_ids)
    assert preds == split_generate(sun, base, [e.prompt for e in task.eval[:4]], task.max_new, task.stop_ids)


def test_another_base_is_refused_in_the_same_work_directory(tmp_path):
    base, task = tiny()
    quiet(base, tmp_path)
    torch.manual_seed(1)
    other = Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64, arch="qwen2"))
    with pytest.raises(ValueError, match="another base"):
        quiet(other, tmp_path)


def test_the_table_shows_missing_rows_and_names_them(tmp_path):
    base, task = tiny()
    res = run_rows(quiet(base, tmp_path / "w"), [task], ("base",))
    md = write(res, tmp_path / "t0.5b", ["reverse", "code"], ["base", "full_ft"], {}, "tiny", "notes\n", {})
    assert "Pending rows: reverse: full_ft; code: base, full_ft." in md and "**Partial.**" in md
    assert "| full fine-tuning (one model per task) | - | - | - |" in md
    doc = json.loads((tmp_path / "t0.5b.json").read_text())     # a dot in the name is kept
    assert doc["pending"] == {"reverse": ["full_ft"], "code": ["base", "full_ft"]} and doc["machine"]["cpus"]
    assert (tmp_path / "t0.5b.png").is_file() and (tmp_path / "t0.5b.md").read_text() == md
