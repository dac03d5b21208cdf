"""The star-on-one-machine demo (server/demos/star_demo.py) on tiny models: hub, targets, table, check, plot."""
from __future__ import annotations

import io

import torch
from click.testing import CliRunner

from edge.engines.torch_engine import TorchEngine
from server.cli import main as hub_main
from server.demos.star_demo import run_star_demo

from tiny_models import tiny_model

torch.set_num_threads(1)


def test_star_demo_runs_three_targets_and_checks_them(tmp_path):
    target = tiny_model(0)
    draft = tiny_model(1, noise=0.05, base=target)
    prompts = [[5, 17, 42], [9, 3, 8, 1], [100, 7]]
    out = io.StringIO()
    rep = run_star_demo(TorchEngine(draft, "draft"), [TorchEngine(target, "target") for _ in range(3)], "tok-tiny",
                        prompts, labels=["a", "b", "c"], max_new=12, gamma=3, check=True,
                        plot_path=tmp_path / "star.png", out=out, refresh_s=0.05, broker="embedded")
    text = out.getvalue()
    assert [t["error"] for t in rep["targets"]] == [None] * 3
    assert all(len(t["tokens"]) == 12 for t in rep["targets"])
    assert rep["all_equal"], [(t["name"], t["agree_prefix"]) for t in rep["targets"]]
    assert rep["draft"]["requests"] > 3 and sum(t["acceptance"] or 0 for t in rep["targets"]) > 0
    assert "draft" in text and "identical" in text and "target2" in text
    assert (tmp_path / "star.png").stat().st_size > 1000 and rep["timeline"]


def test_star_command_has_help():
    res = CliRunner().invoke(hub_main, ["demo", "--help"])
    assert res.exit_code == 0 and "--check" in res.output and "--targets" in res.output


def test_logit_gap_reads_one_call_over_the_context():
    from server.demos.star_demo import _logit_gap
    eng = TorchEngine(tiny_model(3), "t")
    seq = eng.new_sequence()
    row = eng.forward(seq, [4, 5, 6])[-1]
    assert abs(_logit_gap(eng, [4, 5, 6], 7, 9) - (row[7] - row[9])) < 1e-9
    assert eng.active_sequences == 1            # its own sequence is freed
