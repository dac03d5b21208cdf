"""benchmarks/lib/two_device_report.py, starsd_two_device's report: one table column group and one
bar series a γ mode, medians over passes, the drafts asked and sent side by side."""
from types import SimpleNamespace

from benchmarks.lib.two_device_report import merge_passes, write


def _row(speedup, gamma_mean, sent, same=True):
    return {"tok_s": 5.0 * speedup, "speedup": speedup, "acceptance": 0.9, "tokens_per_verify": 1.5,
            "wait_overhead_ms": 2.0, "wait_per_draft_ms": 30.0, "gamma_mean": gamma_mean,
            "gamma_zero_share": 0.1, "sent_mean": sent, "same_text": same, "split_at": None if same else 7,
            "margin_at_split": None if same else 0.02}


def test_the_report_has_every_mode_and_the_passes_medians(tmp_path):
    gammas = ["3", "auto", "auto-asked"]
    passes = [{"kind": "mtbench", "prompt": "p|q", "alone_tok_s": 5.0, "step_ms": 200.0,
               "g3": _row(s, 3.0, 1.4), "gauto": _row(s + 0.1, 6.0, 1.6, same=False),
               "gauto-asked": _row(s - 0.1, 1.0, 0.9)} for s in (1.1, 1.3, 1.2)]
    row = merge_passes(passes, gammas)
    assert row["g3"]["speedup"] == 1.2 and row["g3"]["speedups"] == [1.1, 1.3, 1.2]
    assert row["gauto"]["split_at"] == 7 and abs(row["gauto-asked"]["sent_mean"] - 0.9) < 1e-12
    args = SimpleNamespace(out=tmp_path / "two", target="t", target_format="F16", draft="d", draft_format="Q4_0",
                           new=64, rounds=3, star_rounds=1, passes=3, ahead=True, drafter="model", draft_p_min=None)
    write([row, dict(row, kind="code")], gammas, args)
    md = (tmp_path / "two.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| set"))
    assert header.count("| sent |") == 3 and "γ=auto-asked tok/s" in header
    table = [line for line in md.splitlines() if line.startswith("| mtbench") or line.startswith("| code")]
    assert len(table) == 2 and all(line.count("|") == header.count("|") for line in table)
    assert "p/q" in table[0] and "- code, γ=auto-asked: median 1.10×" in md
    assert (tmp_path / "two.png").stat().st_size > 0 and (tmp_path / "two.json").exists()
