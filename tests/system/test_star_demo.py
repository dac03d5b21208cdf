"""The star-on-one-machine demo (server/demos/star_demo.py) on tiny models: hub, targets, table, check, plot."""
from __future__ import annotations

import io

import torch
from click.testing import CliRunner

from edge.engines.torch_engine import TorchEngine
from server.hub_cli import main as hub_main
from server.demos.star_demo import run_star_demo

from harness.tiny_models import tiny_model

torch.set_num_threads(1)


def test_star_demo_runs_three_targets_and_checks_them(tmp_path):
    target = tiny_model(0)
    draft = tiny_model(1, noise=0.05, base=target)
    prompts = [[5, 17, 42], [9, 3, 8, 1], [100, 7]]
    out = io.StringIO()
    rep = run_star_demo(TorchEngine(draft, "draft"), [TorchEngine(target, "target") for _ in range(3)], "tok-tiny",
                        prompts, labels=["a", "b", "c"], max_new=12, gamma=3, check=True,
                        plot_path=tmp_path / "star.png", out=out, refresh_s=0.05, broker="embedded",
                        notes=["draft memory: a note"], decode=lambda ids: "\n".join(f"w{t}" for t in ids))
    text = out.getvalue()
    assert [t["error"] for t in rep["targets"]] == [None] * 3
    assert all(len(t["tokens"]) == 12 for t in rep["targets"])
    assert rep["all_equal"], [(t["name"], t["agree_prefix"]) for t in rep["targets"]]
    assert rep["draft"]["requests"] > 3 and sum(t["acceptance"] or 0 for t in rep["targets"]) > 0
    assert "draft" in text and "identical" in text and "target2" in text
    assert (tmp_path / "star.png").stat().st_size > 1000 and rep["timeline"]
    assert "draft memory: a note" in text                          # the notes under the final table
    for t in rep["targets"]:                                       # a line of each target's text
        assert f"  {t['name']}: " + " ⏎ ".join(f"w{x}" for x in t["tokens"])[:95] in text
        assert 0 < t["tok_s"] < 1e5                                # the generation's own rate


def test_star_command_has_help():
    res = CliRunner().invoke(hub_main, ["demo", "--help"])
    assert res.exit_code == 0 and "--check" in res.output and "--targets" in res.output
    assert "--two-device" in res.output and "auto" in res.output
    res = CliRunner().invoke(hub_main, ["demo", "--two-device-gammas", "often"])   # refused before loading
    assert res.exit_code == 2 and "--two-device-gammas" in res.output and "auto" in res.output
    res = CliRunner().invoke(hub_main, ["demo", "--gamma", "0"])
    assert res.exit_code == 2 and "auto" in res.output


def test_logit_gap_reads_one_call_over_the_context():
    from server.demos.star_demo import _logit_gap
    eng = TorchEngine(tiny_model(3), "t")
    seq = eng.new_sequence()
    row = eng.forward(seq, [4, 5, 6])[-1]
    assert abs(_logit_gap(eng, [4, 5, 6], 7, 9) - (row[7] - row[9])) < 1e-9
    assert eng.active_sequences == 1            # its own sequence is freed


def test_live_rates_wait_for_a_span_and_final_rates_are_the_generations():
    """Drafts accepted in one round land microseconds apart: no rate over them (it read 300000)."""
    from types import SimpleNamespace

    from server.demos.star_demo import MIN_RATE_S, _Target
    x = _Target("t", TorchEngine(tiny_model(0), "t"), [1, 2], "p")
    x.on_token(5)
    x.on_token(6)
    assert x.tps() is None
    x.t_first -= 2 * MIN_RATE_S
    assert 0 < x.tps() < 2 / MIN_RATE_S
    x.result = SimpleNamespace(tokens_per_s=12.5)
    assert x.tps() == 12.5


def test_two_devices_target_alone_vs_the_star_on_another_core(tmp_path):
    """The demo's first part: real hub and draft processes on a second core, the target on the first,
    alone and through the star with γ fixed and auto; greedy float64: the same text."""
    from edge.engines.loader import open_model
    from server.demos.two_device import parse_modes, run_two_device, two_cores

    from harness.tiny_hf import hf_pair
    target_dir, draft_dir = hf_pair(tmp_path / "models")
    engine, tok = open_model(str(target_dir), dtype="float64", threads=1, max_len=512)
    prompts = [tok.encode("the the he", add_special=True), tok.encode("hello there", add_special=True)]
    out = io.StringIO()
    rep = run_two_device(engine, tok.fingerprint(), prompts, ["a", "b"], str(draft_dir), modes=parse_modes("2,auto"),
                         max_new=16, backend="torch", dtype="float64", logdir=tmp_path / "logs", out=out,
                         baseline=("same", engine),      # the demo's Q4_K_M next to its F16 copy; here itself
                         p_min=0.0)                      # a tiny random draft is never sure: draft every γ
    text = out.getvalue()
    if two_cores() is None:
        assert rep["skipped"] and "needs two" in text
        return
    assert [r["label"] for r in rep["rows"]] == ["a", "b"]
    for r in rep["rows"]:
        assert r["g2"]["same_text"] and r["gauto"]["same_text"], r
        assert r["alone_tok_s"] > 0 and r["g2"]["answered_rounds"].split("/")[0] != "0"
        assert r["g2"]["gamma_mean"] == 2 and 0 <= r["gauto"]["gamma_mean"] <= 8
        assert r["verify_steps"][1] == 1.0 and 3 in r["verify_steps"]
    assert "γ=auto" in text and "median" in text and "why:" in text and "same" in text
    assert all(r["baseline_tok_s"] > 0 for r in rep["rows"]) and "for scale: the same file alone" in text
