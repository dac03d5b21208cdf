"""Provisioning writes the placement into agent.toml (a Jetson: on the GPU, explicitly) and its final
check reads the agent's own start lines: layers on the GPU, or a wrong build reported as such."""
import os
import subprocess

import pytest
from click.testing import CliRunner

from devices.gpu_confirm import confirm_on_gpu, judge_start_lines, placement_values, why_not_joined
from devices.profile import load_profile
from devices.provision import main as provision
from edge.model.fetch import model_path

SMOL = "smollm2-135m"


def test_placement_values_per_profile_and_backend():
    jet, rtx, cpu = (load_profile(n) for n in ("jetson-orin-nano-8gb", "rtx4090-workstation", "cpu-2core"))
    assert placement_values(jet, "llamacpp") == {"accelerator": "cuda", "gpu_layers": "all"}
    assert placement_values(jet, "onnx") == {"accelerator": "cuda"}
    assert placement_values(rtx, "torch") == {"accelerator": "cuda"}
    assert placement_values(cpu, "llamacpp") == {"accelerator": "cpu"}


@pytest.mark.parametrize("profile,lines", [
    ("jetson-orin-nano-8gb", ('accelerator = "cuda"', 'gpu_layers = "all"')),
    ("cpu-2core", ('accelerator = "cpu"',)),
])
def test_dry_run_writes_the_placement_into_the_config(profile, lines):
    smol = model_path(SMOL)
    if not smol.exists():
        pytest.skip(f"{SMOL} is not fetched (make test-models)")
    r = CliRunner().invoke(provision, ["--ssh", "nvidia@jetson.invalid", "--profile", profile, "--role", "target",
                                       "--broker", "mqtt://hub.local:1883", "--model", str(smol), "--dry-run"])
    assert r.exit_code == 0, r.output
    config = [ln.strip() for ln in r.output.splitlines()]
    for line in lines:
        assert line in config, r.output
    assert ("gpu_layers" in r.output) == (len(lines) == 2)


def test_the_config_placement_is_what_edge_agent_run_reads(tmp_path):
    """The keys provisioning writes are `edge-agent run` options (the device's agent checks the same)."""
    from click.testing import CliRunner as Runner

    from edge.cli.agent_run import run
    cfg = tmp_path / "agent.toml"
    cfg.write_text('role = "target"\nbroker = "mqtt://127.0.0.1:1"\nmodel = "m"\naccelerator = "cuda"\ngpu_layers = "all"\n')
    r = Runner().invoke(run, ["--config", str(cfg), "--help"])
    assert r.exit_code == 0, r.output


def _start_lines(exports, capsys, **kw):
    """The lines a real agent prints as it places and loads a model (edge/cli/startup.py)."""
    from edge.cli.startup import open_model_for_command
    from edge.model.resolved import resolve
    eng, _ = open_model_for_command(resolve(exports.gguf("llama"), "llamacpp"), "float32", None, 64, n_seq_max=1, **kw)
    eng.close()
    return capsys.readouterr().err


def test_a_cpu_build_is_reported_as_a_wrong_build(exports, capsys):
    ok, what = judge_start_lines(_start_lines(exports, capsys), "llamacpp")
    assert ok is False and what.startswith("wrong build:") and "layers on the CPU" in what
    assert "-DGGML_CUDA=on" in what


def test_a_refused_start_is_a_wrong_build(exports, capsys):
    import click
    with pytest.raises(click.ClickException) as e:
        _start_lines(exports, capsys, device="cuda")
    ok, what = judge_start_lines(f"Error: {e.value.message}\n", "llamacpp")
    assert ok is False and "refused to start: --accelerator cuda on llamacpp" in what


def test_layers_on_the_gpu_are_confirmed_and_silence_is_not():
    line = ("placement: llamacpp on cuda: all layers on the GPU (asked for --accelerator cuda)\n"
            "loaded m.gguf on llamacpp (vocab 49152) in 0.6s: 30 of 30 layers on the GPU (n_gpu_layers=-1)\n")
    assert judge_start_lines(line, "llamacpp") == (True, "30 of 30 layers on the GPU (n_gpu_layers=-1)")
    ort = "loaded m.onnx on onnx (vocab 320) in 0.1s: onnxruntime providers CUDAExecutionProvider, CPUExecutionProvider"
    assert judge_start_lines(ort, "onnx")[0] is True
    torch_cpu = "loaded m on torch (vocab 320) in 0.1s: torch device cpu (the CPU), float32"
    assert judge_start_lines(torch_cpu, "torch")[0] is False
    assert judge_start_lines("", "llamacpp") == (None, "no start line from the agent yet")


class LocalShell:
    """A device's shell run here: a `journalctl` on PATH that prints what the agent's unit logged
    (with the noise a journal has), so the check runs its real command through bash and grep."""

    def __init__(self, tmp_path, journal: str):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(parents=True)
        (tmp_path / "journal.txt").write_text("Started starsun-agent.service\n" + journal + "metrics on http://x\n")
        script = bin_dir / "journalctl"
        script.write_text(f"#!/bin/sh\ncat {tmp_path / 'journal.txt'}\n")
        script.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def sh(self, cmd, check=True):
        return subprocess.run(["bash", "-c", cmd], env=self.env, capture_output=True, text=True, check=check).stdout


def test_final_check_confirms_the_gpu_or_fails_a_wrong_build(tmp_path, exports, capsys):
    jet = load_profile("jetson-orin-nano-8gb")
    gpu = ("placement: llamacpp on cuda: all layers on the GPU (asked for --accelerator cuda)\n"
           "loaded m.gguf on llamacpp (vocab 49152) in 0.6s: 30 of 30 layers on the GPU (n_gpu_layers=-1)\n")
    assert confirm_on_gpu(LocalShell(tmp_path / "a", gpu), jet, "llamacpp", False, True) == (
        "on the GPU: 30 of 30 layers on the GPU (n_gpu_layers=-1)")
    cpu_lines = _start_lines(exports, capsys)              # what this CPU build's agent really prints
    with pytest.raises(RuntimeError, match="wrong build: all 2 layers on the CPU"):
        confirm_on_gpu(LocalShell(tmp_path / "b", cpu_lines), jet, "llamacpp", False, True)
    assert why_not_joined(LocalShell(tmp_path / "c", cpu_lines), "llamacpp", False, True).startswith(
        "; the agent's start line: wrong build")
    assert "not confirmed" in confirm_on_gpu(LocalShell(tmp_path / "d", ""), jet, "llamacpp", False, True)
    assert confirm_on_gpu(None, load_profile("cpu-2core"), "llamacpp", False, True).startswith("CPU profile")
