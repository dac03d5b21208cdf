"""`edge-export tune`'s learning rate by what is trained (export/tune_cli.py): a LoRA adapter
defaults to 1e-3 (at the full copy's 2e-5 it learned nothing in 60 steps of a new task), a full
prefill copy or --full to 2e-5; --help and the start line say so, and an explicit --lr wins."""
import json

import pytest
from click.testing import CliRunner

from export.tune_cli import FULL_LR, LORA_LR, default_lr
from export.tune_cli import tune as tune_cmd


def test_the_default_depends_on_the_adapter():
    assert (default_lr("lora"), default_lr(None)) == (LORA_LR, FULL_LR) == (1e-3, 2e-5)


def test_help_shows_both_defaults():
    out = CliRunner().invoke(tune_cmd, ["--help"], terminal_width=200).output
    assert "[default: 0.001 with --adapter lora, else 2e-05]" in " ".join(out.split())


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from harness.tiny_hf import hf_dir
    tmp = tmp_path_factory.mktemp("tune-lr")
    base_dir, _ = hf_dir(tmp / "base")
    data = tmp / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"say {i}", "answer": f"{i} {i}"}) for i in range(12)))
    return ["--base", str(base_dir), "--data", str(data), "--steps", "1", "--batch-size", "2", "--n-eval", "2",
            "--eval-every", "0", "--ckpt-every", "0"]


@pytest.mark.parametrize("more, lr, said", [
    (["--adapter", "lora", "--rank", "4"], 1e-3, "lr 0.001 (the default with --adapter lora; --lr sets it)"),
    (["--adapter", "lora", "--rank", "4", "--lr", "5e-4"], 5e-4, "lr 0.0005 (--lr)"),
    ([], 2e-5, "lr 2e-05 (the default; --lr sets it)"),
])
def test_the_start_line_and_the_manifest_carry_the_rate_used(tiny_base, tmp_path, more, lr, said):
    run = CliRunner().invoke(tune_cmd, tiny_base + more + ["--out", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output
    first = run.output.splitlines()[0]
    assert first.startswith("tuning ") and said in first, first
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["tune"]["lr"] == lr


def test_select_every_keeps_the_best_step_and_says_which(tiny_base, tmp_path):
    args = tiny_base + ["--adapter", "lora", "--rank", "4", "--steps", "2", "--select-every", "1", "--select-n", "3"]
    run = CliRunner().invoke(tune_cmd, args + ["--out", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output
    final = json.loads((tmp_path / "out" / "manifest.json").read_text())["history_tail"][-1]
    assert [j["step"] for j in final["judged"]] == [0, 1, 2] and final["picked_step"] in (0, 1, 2)
    bad = CliRunner().invoke(tune_cmd, args[:-1] + ["100", "--out", str(tmp_path / "bad")])
    assert bad.exit_code != 0 and "cannot hold back 100" in bad.output
