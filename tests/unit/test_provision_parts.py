"""The pieces of `make flash-jetson` that need no device: recovery-mode detection, the device
checks, the install commands per profile, and the agent config `edge-agent run --config` reads."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from devices.agent_files import Layout, agent_config, exec_start_of, unit_text
from devices.device_checks import DeviceFacts, check_facts, recovery_boards
from devices.install_recipe import install_commands, wheel_requirements
from devices.profile import load_profile
from edge.cli.agent_config import read_config
from edge.cli.agent_run import run

LSUSB = """Bus 001 Device 002: ID 046d:c52b Logitech, Inc. Unifying Receiver
Bus 001 Device 007: ID 0955:7523 NVIDIA Corp. APX
"""


def _usb(root, name, vid, pid):
    d = root / name
    d.mkdir()
    (d / "idVendor").write_text(vid + "\n")
    (d / "idProduct").write_text(pid + "\n")


def test_a_board_in_recovery_mode_is_found_in_lsusb_or_sysfs(tmp_path):
    assert recovery_boards(tmp_path, lsusb_text=LSUSB) == ["Jetson Orin Nano 8GB (USB 0955:7523)"]
    _usb(tmp_path, "1-1", "046d", "c52b")
    _usb(tmp_path, "1-2", "0955", "7023")       # AGX Orin in recovery
    _usb(tmp_path, "1-3", "0955", "7020")       # an NVIDIA device that is not an Orin in recovery
    assert recovery_boards(tmp_path, lsusb_text="") == ["Jetson AGX Orin (USB 0955:7023)"]
    assert recovery_boards(tmp_path / "none", lsusb_text="Bus 001 Device 003: ID 0955:7020 NVIDIA") == []


def _facts(**kw):
    base = dict(home="/home/nv", user="nv", host="jet", arch="aarch64", python="3.10.12", venv=True,
                disk_bytes=50 * 10**9, mem_total=8 * 10**9, mem_available=6 * 10**9, rsync=True, sha256sum=True,
                sudo=True, systemd=True)
    return DeviceFacts(**{**base, **kw})


def test_device_checks_say_what_to_do():
    jet = load_profile("jetson-orin-nano-8gb")
    assert check_facts(_facts(), jet, "python3", 10**9, 2 * 10**9) == ([], [])
    stop, _ = check_facts(_facts(python="3.8.10"), jet, "python3", 10**9, 10**9)
    assert "JetPack 5 ships 3.8" in stop[0]
    stop, _ = check_facts(_facts(venv=False), jet, "python3", 10**9, 10**9)
    assert "apt-get install python3-venv" in stop[0]
    stop, _ = check_facts(_facts(arch="x86_64"), jet, "python3", 10**9, 10**9)
    assert "aarch64" in stop[0]
    stop, warn = check_facts(_facts(disk_bytes=10**8), jet, "python3", 10**9, 7 * 10**9)
    assert "free some space" in stop[0] and "available now" in warn[0]
    stop, _ = check_facts(_facts(), jet, "python3", 10**9, 9 * 10**9)
    assert "8.00 GB in all" in stop[0]


def test_probe_output_parses():
    f = DeviceFacts.parse("home=/home/nv\nuser=nv\narch=aarch64\npython=3.10.12\nvenv=yes\ndisk_kb=1000\n"
                          "memtotal=7800000\nmemavailable=5000000\nsudo=no\nsystemd=yes\nboard=NVIDIA Jetson Orin Nano\n")
    assert (f.arch, f.venv, f.sudo, f.systemd, f.disk_bytes, f.mem_total) == ("aarch64", True, False, True, 1024000,
                                                                               7800000 * 1024)


def test_jetson_install_keeps_jetpack_torch_and_takes_onnxruntime_gpu_and_cuda_llama(tmp_path):
    jet = load_profile("jetson-orin-nano-8gb")
    wheel = tmp_path / "starsun-0.1.0-py3-none-any.whl"      # absent: the requirements come from pyproject.toml
    cmds = install_commands(jet, "llamacpp", "pypi", "/home/nv/starsun", "python3", wheel)
    assert cmds[0] == "python3 -m venv --system-site-packages /home/nv/starsun/venv"
    assert "--no-deps --force-reinstall /home/nv/starsun/wheels/" + wheel.name in cmds[1]
    deps = cmds[2]
    assert "'numpy>=1.24'" in deps and "torch" not in deps and "'onnxruntime" not in deps
    assert len(cmds) == 4 and "onnxruntime" not in " ".join(cmds)      # a llama.cpp role: no onnxruntime
    assert cmds[3].startswith("CMAKE_ARGS='-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87'")
    assert "llama-cpp-python==" in cmds[3]
    onnx = install_commands(jet, "onnx", "pypi", "/home/nv/starsun", "python3", wheel)
    assert "--extra-index-url https://pypi.jetson-ai-lab.io/jp6/cu126 onnxruntime-gpu" in onnx[3]
    cpu = install_commands(load_profile("cpu-2core"), "onnx", "device", "/r", "python3", wheel)
    assert len(cpu) == 2 and "--system-site-packages" in cpu[0]
    assert "tomli>=2.0" in wheel_requirements(wheel, python="3.10")
    assert "tomli>=2.0" not in wheel_requirements(wheel, python="3.12")


def test_the_config_file_is_what_edge_agent_run_reads(tmp_path):
    values = {"role": "draft", "broker": "mqtt://hub:1883", "client_id": "jet1", "model": "/m/x.gguf",
              "backend": "llamacpp", "max_len": 512, "max_sessions": 4, "profile": "jetson-orin-nano-8gb",
              "password_file": "/home/nv/starsun/credentials/mqtt.password", "memory_budget": None}
    p = tmp_path / "agent.toml"
    p.write_text(agent_config(values, "test"))
    got = read_config(p, run)
    assert got == {"role": "draft", "hub_url": "mqtt://hub:1883", "client_id": "jet1", "model": "/m/x.gguf",
                   "backend": "llamacpp", "max_len": 512, "max_sessions": 4, "profile": "jetson-orin-nano-8gb",
                   "password_file": "/home/nv/starsun/credentials/mqtt.password"}


def test_edge_agent_run_config_errors_and_command_line_override(tmp_path):
    p = tmp_path / "agent.toml"
    p.write_text('role = "draft"\nbroker = "mqtt://127.0.0.1:1"\npasword_file = "x"\n')
    r = CliRunner().invoke(run, ["--config", str(p)])
    assert r.exit_code == 2 and "unknown key 'pasword_file'" in r.output and "password_file" in r.output
    p.write_text('role = "draft"\nbroker = "mqtt://127.0.0.1:1"\npassword = "hunter2"\n')
    r = CliRunner().invoke(run, ["--config", str(p)])
    assert r.exit_code == 2 and "would put a secret in the config file" in r.output
    p.write_text('role = "draft"\nbroker = "mqtt://127.0.0.1:1"\n')
    r = CliRunner().invoke(run, ["--config", str(p)])        # the file's role and hub satisfy the required options
    assert r.exit_code == 2 and "--role draft needs --model" in r.output
    r = CliRunner().invoke(run, ["--config", str(p), "--role", "prefill"])    # the command line wins
    assert r.exit_code == 2 and "--role prefill needs --module" in r.output


@pytest.mark.parametrize("system", [False, True])
def test_unit_runs_the_agent_from_its_config(system):
    lay = Layout("/home/nv")
    unit = unit_text(lay, "target", "jet1", "mqtt://hub:1883", system, "nv")
    assert exec_start_of(unit) == "/home/nv/starsun/venv/bin/edge-agent run --config /home/nv/starsun/agent.toml"
    assert ("User=nv" in unit) == system and ("WantedBy=multi-user.target" in unit) == system
    assert "RestartPreventExitStatus=2" in unit
