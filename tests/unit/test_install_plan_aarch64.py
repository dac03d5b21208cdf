"""The install plan for an aarch64 device, made on this x86 PC (issue 35, point 10's cheap check).

The full run -- `make flash-jetson` into an arm64 root under qemu, the agent joining a hub here
and decoding the x86 text -- is benchmarks/device/aarch64_device.py (tens of minutes). Here: what
provisioning decides for such a device without running it. The requirements' markers are read
for the device's machine and Python (its probe's facts), not the PC's; the kit's wheel is pure,
so pip picks the wheel built here for an aarch64 device; an aarch64 CPU device on onnxruntime
gets PyPI's onnxruntime (aarch64 wheels) and nothing of torch or llama.cpp.
"""
from __future__ import annotations

import platform
import subprocess
import sys
import zipfile
from pathlib import Path

from devices import agent_files as files
from devices.artifact_check import Artifact
from devices.device_checks import DeviceFacts, check_facts
from devices.install_recipe import build_wheel, install_commands, wheel_requirements
from devices.profile import load_profile
from devices.steps import Options, Provisioning

AARCH64_PROBE = ("home=/home/nvidia\nuser=nvidia\nhost=arm\narch=aarch64\npython=3.11.2\nvenv=yes\npip=no\n"
                 "disk_kb=60000000\nmemtotal=8000000\nmemavailable=6000000\nrsync=yes\nsha256sum=yes\nsudo=no\n"
                 "systemd=no\n")


def _wheel_with(tmp_path: Path, requires) -> Path:
    """A real (metadata-only) wheel whose Requires-Dist lines are `requires`."""
    w = tmp_path / "demo-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", meta)
        z.writestr("demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return w


def test_markers_are_read_for_the_devices_machine_not_the_pcs(tmp_path):
    w = _wheel_with(tmp_path, ['x86only>=1; platform_machine == "x86_64"',
                               'armonly>=1; platform_machine == "aarch64"',
                               'oldpy>=1; python_version < "3.11"', "everywhere>=1"])
    arm = wheel_requirements(w, python="3.11", machine="aarch64")
    assert arm == ["armonly>=1", "everywhere>=1"]
    assert wheel_requirements(w, python="3.10", machine="x86_64") == ["x86only>=1", "oldpy>=1", "everywhere>=1"]
    if platform.machine() == "x86_64":       # here: without the device's machine the PC's would leak in
        assert "x86only>=1" in wheel_requirements(w, python="3.11")
    cmds = install_commands(load_profile("cpu-2core"), "onnx", "pypi", "/r", "python3", w,
                            python_version="3.11", machine="aarch64")
    assert "'armonly>=1'" in cmds[2] and "x86only" not in " ".join(cmds) and "oldpy" not in " ".join(cmds)


def _provisioning_for(probe: str, profile: str, backend: str, wheel: Path) -> Provisioning:
    p = Provisioning(Options("nvidia@arm", load_profile(profile), "target", "mqtt://127.0.0.1:1883"))
    p.facts = DeviceFacts.parse(probe)
    p.layout = files.Layout(p.facts.home)
    p.artifact = Artifact("bundle", Path("/b"), backend, 10**9, None, "")
    p.wheel = wheel
    return p


def test_provisioning_plans_with_the_probed_aarch64_facts(tmp_path):
    wheel = tmp_path / "starsun-0.1.0-py3-none-any.whl"      # absent: the requirements come from pyproject.toml
    p = _provisioning_for(AARCH64_PROBE, "cpu-2core", "onnx", wheel)
    stop, _ = check_facts(p.facts, p.o.profile, "python3", 10**9, 10**9)
    assert stop == []                                        # a CPU profile takes an aarch64 device
    cmds = p.install_commands()
    text = " ".join(cmds)
    assert cmds[0] == "python3 -m venv /home/nvidia/starsun/venv"      # no pip on the device: ensurepip
    assert "'tomli" not in text                              # Python 3.11 has tomllib
    assert cmds[3].endswith("'onnxruntime>=1.18'")           # PyPI's: it has aarch64 wheels
    for absent in ("onnxruntime-gpu", "torch", "llama-cpp-python", "jetson-ai-lab", "CMAKE_ARGS"):
        assert absent not in text
    jet = _provisioning_for(AARCH64_PROBE.replace("python=3.11.2", "python=3.10.12"), "jetson-orin-nano-8gb",
                            "onnx", wheel)
    jet_text = " ".join(jet.install_commands())
    assert "'tomli>=2.0'" in jet_text and "onnxruntime-gpu" in jet_text    # JetPack 6's Python 3.10


def test_pip_picks_the_kit_wheel_built_here_for_an_aarch64_device(tmp_path):
    wheel = build_wheel(tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as z:
        info = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Tag: py3-none-any" in info and "Root-Is-Purelib: true" in info
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-index",
                        "--find-links", str(wheel.parent), "--only-binary=:all:", "--no-deps",
                        "--platform", "manylinux2014_aarch64", "--python-version", "3.10", "--implementation", "cp",
                        "-d", str(tmp_path / "got"), "starsun"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in (tmp_path / "got").iterdir()] == [wheel.name]

