"""The kit's wheel, and the commands that install it into a venv on the device.

The wheel is built from the tracked (and untracked, not ignored) files copied to a temporary
directory, so a stale build/ never leaks into it, with SOURCE_DATE_EPOCH fixed: the same
sources give the same bytes, which is what lets a second provisioning see "unchanged".

How dependencies come (`--deps`):
  pypi    the kit with --no-deps, then its core requirements and the extra of the role's backend
          only (BACKEND_EXTRAS: a llama.cpp role gets llama-cpp-python, never torch or
          onnxruntime), less what the profile brings otherwise: on a Jetson torch is JetPack's (the
          venv sees the system site packages), onnxruntime becomes the profile's onnxruntime-gpu
          from the Jetson wheel index (--ort-index), llama-cpp-python is built with CUDA for sm_87
          when the profile lists llamacpp-cuda; off a Jetson torch comes from PyTorch's CPU index
          unless the profile has a CUDA GPU (PyPI's default Linux torch pulls ~4 GB of CUDA);
  device  the device's Python already has them (a prepared image): the kit alone, --no-deps,
          into a venv over the system site packages; an import check says what is missing.
--wheels DIR adds local wheels (e.g. NVIDIA's) as --find-links to every pip call.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parent.parent
WHEEL_EPOCH = "315532800"           # 1980-01-01, the earliest a zip can say
JETSON_ORT_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"
BACKEND_IMPORT = {"llamacpp": "llama_cpp", "onnx": "onnxruntime", "torch": "torch"}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# the kit's extras a role on each backend imports; "auto" is a bundle, whose artifact the loader
# picks at start (ONNX or GGUF, never torch)
BACKEND_EXTRAS = {"llamacpp": ("llama",), "onnx": ("onnx",), "torch": ("torch",), "auto": ("onnx", "llama")}


def build_wheel(out_dir: Path, repo: Path = REPO) -> Path:
    """pip wheel --no-deps of the kit's sources (git's view of them), reproducibly."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                           capture_output=True, check=True).stdout.decode().split("\0")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="starsun-src-") as tmp:
        for rel in filter(None, files):
            src, dst = repo / rel, Path(tmp) / rel
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(src.read_bytes())
                os.utime(dst, (0, int(WHEEL_EPOCH)))
        env = {**os.environ, "SOURCE_DATE_EPOCH": WHEEL_EPOCH}
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out_dir), tmp], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"pip wheel failed: {r.stderr.strip() or r.stdout.strip()}")
    return max(out_dir.glob("starsun-*.whl"), key=lambda p: p.stat().st_mtime)


def wheel_requirements(wheel: Path, extra: Optional[str] = None, python: str = "3.10",
                       machine: Optional[str] = None) -> List[str]:
    """Requires-Dist of the wheel that apply on a device (markers as pip would evaluate them
    there: its Python, Linux, its machine -- `uname -m`, e.g. aarch64 on a Jetson; None: this
    PC's; `extra` selects one optional group)."""
    from packaging.requirements import Requirement
    if Path(wheel).is_file():
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
    else:                               # not built yet (a dry run): what pyproject.toml says it will hold
        lines = _pyproject_requires()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        env = {"python_version": python, "sys_platform": "linux", "platform_system": "Linux", "extra": extra or ""}
        if machine:                     # else packaging fills in the PC's, wrong for an aarch64 device
            env["platform_machine"] = machine
        if requirement.marker is None or requirement.marker.evaluate(env):
            if (requirement.marker is not None and "extra" in str(requirement.marker)) != bool(extra):
                continue                # an extra's requirement, or a base one when asking for the extra
            requirement.marker = None
            out.append(str(requirement))
    return out


def _pyproject_requires() -> List[str]:
    """pyproject.toml's requirements as Requires-Dist lines (extras marked as a wheel marks them)."""
    from devices.profile import tomllib
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [f"Requires-Dist: {r}" for r in proj.get("dependencies", [])]
    for extra, reqs in proj.get("optional-dependencies", {}).items():
        for r in reqs:
            sep = " and " if ";" in r else "; "
            lines.append(f"Requires-Dist: {r}{sep}extra == \"{extra}\"")
    return lines


def _name(requirement: str) -> str:
    """The distribution a requirement names ("llama_cpp_python>=0.3; ..." -> "llama-cpp-python")."""
    return re.split(r"[<>=!~ \[;]", requirement, 1)[0].lower().replace("_", "-")


def install_commands(profile, backend: str, deps: str, root: str, python: str, wheel: Path,
                     wheels_dir: Optional[str] = None, ort_index: Optional[str] = None,
                     system_pip: bool = False, python_version: str = "3.10",
                     machine: Optional[str] = None) -> List[str]:
    """sh commands, in order, that build the venv at root/venv and install the kit into it: the
    core requirements and the extras of `backend` only (BACKEND_EXTRAS).
    system_pip: the interpreter has pip, so a venv over the system site packages uses it (no
    ensurepip: seconds less on a small board). python_version / machine: the device's (its
    probe's facts), for the requirements' markers."""
    venv, q = f"{root}/venv", shlex.quote
    pip = f"{q(venv)}/bin/python -m pip install --disable-pip-version-check -q"
    links = f" --find-links {q(wheels_dir)}" if wheels_dir else ""
    jetson = profile.kind == "jetson"
    system_site = jetson or deps == "device"
    remote_wheel = f"{root}/wheels/{wheel.name}"
    flags = (" --system-site-packages" + (" --without-pip" if system_pip else "")) if system_site else ""
    cmds = [f"{q(python)} -m venv{flags} {q(venv)}",
            f"{pip}{links} --no-deps --force-reinstall {q(remote_wheel)}"]
    if deps != "pypi":
        return cmds
    extras = BACKEND_EXTRAS.get(backend, ())
    core = wheel_requirements(wheel, python=python_version, machine=machine)
    if "torch" in extras:
        torch_reqs = wheel_requirements(wheel, "torch", python_version, machine)
        core += [r for r in torch_reqs if _name(r) != "torch"]            # safetensors
        torch = " ".join(q(r) for r in torch_reqs if _name(r) == "torch") or "torch"
        if not jetson:                  # a Jetson's torch is JetPack's, from the system site packages
            cmds.append(_torch_command(profile, pip + links, torch))
    cmds.append(f"{pip}{links} " + " ".join(q(r) for r in core))
    if "onnx" in extras:
        cmds.append(_onnxruntime_command(profile, pip + links, ort_index, jetson, wheel, python_version, machine))
    if "llama" in extras:
        llama_reqs = wheel_requirements(wheel, "llama", python_version, machine)
        llama = " ".join(q(r) for r in llama_reqs) or "llama-cpp-python"
        if "llamacpp-cuda" in profile.backends:   # Orin is sm_87; no CUDA aarch64 wheel on PyPI
            arch = " -DCMAKE_CUDA_ARCHITECTURES=87" if jetson else ""
            cmds.append(f"CMAKE_ARGS='-DGGML_CUDA=on{arch}' {pip}{links} --no-binary llama-cpp-python {llama}")
        else:
            cmds.append(f"{pip}{links} {llama}")
    return cmds


def _torch_command(profile, pip: str, torch: str) -> str:
    """torch off a Jetson: PyPI's Linux build (CUDA) for a profile with a CUDA GPU, else the CPU
    build from PyTorch's index -- first and alone, so nothing after it resolves torch from PyPI
    (its default Linux wheels pull ~4 GB of nvidia-* and triton)."""
    if any(b.endswith("-cuda") for b in profile.backends):
        return f"{pip} {torch}"
    return f"{pip} --index-url {TORCH_CPU_INDEX} {torch}"


def _onnxruntime_command(profile, pip: str, ort_index: Optional[str], jetson: bool, wheel: Path,
                         python_version: str = "3.10", machine: Optional[str] = None) -> str:
    """The profile's onnxruntime: PyPI's, or onnxruntime-gpu (the Jetson AI Lab index on a Jetson);
    never both, they provide the same module."""
    ort = profile.onnxruntime_package
    if ort == "onnxruntime":
        return f"{pip} " + " ".join(shlex.quote(r) for r in wheel_requirements(wheel, "onnx", python_version, machine))
    index = ort_index or (JETSON_ORT_INDEX if jetson else None)
    return pip + (f" --extra-index-url {shlex.quote(index)}" if index else "") + f" {shlex.quote(ort)}"


def venv_size_command(root: str) -> str:
    """What the venv takes on the device, in KiB (its own files: not the system site packages)."""
    return f"du -sk {shlex.quote(root + '/venv')} | cut -f1"


def describe_size(du_output: str) -> str:
    """du -sk's answer as the flash output says it."""
    try:
        return f"the venv takes {int(du_output.split()[0]) / 1024:.0f} MiB"
    except (ValueError, IndexError):
        return "the venv's size is unknown (du said nothing)"


def check_command(root: str, backend: str, profile) -> str:
    """A read-only check that the installed agent and its backend import (and, on a Jetson with
    torch, that JetPack's torch sees CUDA); the config step then runs `edge-agent run`."""
    py = shlex.quote(f"{root}/venv/bin/python")
    mods = ["edge.cli.agent_run", "devices.profile"] + ([BACKEND_IMPORT[backend]] if backend in BACKEND_IMPORT else [])
    cmd = f"{py} -c {shlex.quote('import ' + ', '.join(mods))}"
    if profile.kind == "jetson" and backend == "torch":
        probe = 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA: install JetPack\'s torch")'
        cmd += f" && {py} -c {shlex.quote(probe)}"
    return cmd
