"""Provisioning's placement: what agent.toml says about where the model runs, and the final check
that reads the agent's own start lines to confirm a GPU device decodes on its GPU.

A profile with a GPU (a Jetson, a GPU workstation) gets an explicit placement in the config:
`accelerator = "cuda"` (and, for llama.cpp, `gpu_layers = "all"`), so a device whose runtime cannot
reach the GPU refuses to start with the fix instead of decoding on its CPU in silence; a CPU
profile gets `accelerator = "cpu"`. The agent prints `placement: ...` and then `loaded ...: <where>`
(edge/cli/placing.py, edge/cli/startup.py); judge_start_lines reads those lines: layers on the
GPU, a CPU-only build (a wrong build, reported as such), or no start line yet.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

GPU_KINDS = ("jetson", "gpu")
_LOADED = re.compile(r"^loaded .*?: (?P<where>.*)$", re.M)
_REFUSED = re.compile(r"^Error: (?P<why>(--accelerator cuda|--gpu-layers).*)$", re.M)


def placement_values(profile, backend: str) -> dict:
    """The config keys of the placement a profile asks for (profile: devices.profile.DeviceProfile)."""
    if profile.kind not in GPU_KINDS:
        return {"accelerator": "cpu"}
    return {"accelerator": "cuda", **({"gpu_layers": "all"} if backend == "llamacpp" else {})}


def start_lines_command(system: bool, lines: int = 40) -> str:
    """The agent's latest start lines from its unit's journal (run on the device)."""
    journal = "sudo -n journalctl" if system else "journalctl --user"
    return (f"{journal} -u starsun-agent.service -b --no-pager -o cat -n {int(lines)} 2>/dev/null "
            "| grep -E '^(placement|loaded|warning|Error)' ; true")


def judge_start_lines(text: str, backend: str) -> Tuple[Optional[bool], str]:
    """(True: on the GPU, False: not on the GPU, None: no start line yet; what the lines say)."""
    refused = [m.group("why") for m in _REFUSED.finditer(text)]
    if refused:
        return False, f"wrong build: the agent refused to start: {refused[-1]}"
    loaded = [m.group("where") for m in _LOADED.finditer(text)]
    if not loaded:
        return None, "no start line from the agent yet"
    where = loaded[-1]
    if backend == "llamacpp":
        m = re.search(r"(\d+) of (\d+) layers on the GPU", where)
        if m and int(m.group(1)) > 0:
            return True, where
        return False, (f"wrong build: {where}: the device's llama-cpp-python cannot offload; rebuild it there with "
                       "CMAKE_ARGS='-DGGML_CUDA=on' pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36")
    if backend == "onnx":
        ok = "CUDAExecutionProvider" in where or "TensorrtExecutionProvider" in where
        return ok, where if ok else f"wrong build: {where}: install onnxruntime-gpu (NVIDIA's Jetson wheel)"
    ok = "torch device cuda" in where
    return ok, where if ok else f"wrong build: {where}: install JetPack's torch (NVIDIA's PyTorch for Jetson)"


def confirm_on_gpu(remote, profile, backend: str, system: bool, systemd: bool) -> str:
    """The final check of a GPU profile: the agent's start lines say its model is on the GPU. Raises
    RuntimeError when they say otherwise (a wrong build); a CPU profile has nothing to confirm."""
    if profile.kind not in GPU_KINDS:
        return "CPU profile: the model runs on the CPU (accelerator = \"cpu\")"
    if not systemd:
        return ("not confirmed: no systemd journal on the device; the agent's start line `loaded ...` says where "
                "the model runs")
    ok, what = judge_start_lines(remote.sh(start_lines_command(system)), backend)
    if ok is False:
        raise RuntimeError(what)
    return f"on the GPU: {what}" if ok else f"not confirmed: {what} (see journalctl -u starsun-agent)"



def why_not_joined(remote, backend: str, system: bool, systemd: bool) -> str:
    """What the agent's start lines add when it did not join: a refused placement or a CPU build
    (its fix included), else nothing."""
    if not systemd:
        return ""
    ok, what = judge_start_lines(remote.sh(start_lines_command(system)), backend)
    return f"; the agent's start line: {what}" if ok is False else ""
