"""A device installs only what its role runs (issue 35, point 6).

The install plan (devices/install_recipe.py) for every role x artifact x profile kind: no torch
where the role runs on llama.cpp or onnxruntime, no onnxruntime where it runs on llama.cpp or
torch. And the other half, in a fresh interpreter: what a llama.cpp target (and an onnxruntime
one) really imports, mapped to distributions, is inside the core plus its backend's extra, with
their dependencies -- so the split is not too small either.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from edge.model.resolved import BACKENDS, auto_backend
from devices.install_recipe import BACKEND_EXTRAS, TORCH_CPU_INDEX, describe_size, install_commands, wheel_requirements
from devices.profile import load_profile, tomllib

REPO = Path(__file__).resolve().parents[2]
WHEEL = Path("starsun-0.1.0-py3-none-any.whl")     # absent: the requirements come from pyproject.toml
ROLES = ("target", "draft", "prefill", "decoder")
# the artifacts each role is provisioned with (kind, format), and the backend `edge-agent run` picks for them
ARTIFACTS = {"gguf": ("model", "gguf"), "onnx": ("model", "onnx"), "checkpoint": ("model", "hf"),
             "sun-module": ("module", "sun")}
PROFILES = ("cpu-2core", "jetson-orin-nano-8gb", "rtx4090-workstation")


def _installed_names(cmds) -> set:
    """Distribution names the pip commands install (after the kit's own --no-deps line)."""
    names = set()
    for c in cmds[2:]:
        for word in c.split():
            word = word.strip("'")
            if re.match(r"^[A-Za-z][A-Za-z0-9_.-]*([<>=!~].*)?$", word) and not word.startswith("-"):
                names.add(re.split(r"[<>=!~]", word, 1)[0].lower().replace("_", "-"))
    return names - {"cmake-args", "python", "pip", "install"}


def _plans():
    for role in ROLES:
        for art, (kind, fmt) in ARTIFACTS.items():
            if (kind == "module") != (role in ("prefill", "decoder")):
                continue                                  # SUN roles take modules, StarSD roles models
            backend, _ = auto_backend(fmt, BACKENDS)      # provisioning installs what auto picks
            for backend in {backend, "llamacpp", "onnx", "torch"}:     # and each backend forced (--backend)
                for prof in PROFILES:
                    yield role, art, backend, prof


@pytest.mark.parametrize("role,art,backend,prof", sorted(set(_plans())))
def test_each_role_installs_its_backend_and_nothing_else(role, art, backend, prof):
    profile = load_profile(prof)
    cmds = install_commands(profile, backend, "pypi", "/r", "python3", WHEEL)
    names, text = _installed_names(cmds), " ".join(cmds)
    core = {re.split(r"[<>=!~ ;]", r, 1)[0].lower() for r in wheel_requirements(WHEEL)}
    assert core <= names, f"{role} on {backend} ({prof}) misses core requirements {core - names}"
    for never in ("amqtt", "cryptography", "onnx", "onnxscript", "matplotlib", "transformers"):
        assert never not in names, f"{role} on {backend} ({prof}) installs {never}"
    ort = {"onnxruntime", "onnxruntime-gpu"} & names
    if backend == "torch":
        assert "safetensors" in names and not ort
        if profile.kind == "jetson":
            assert "torch" not in names                     # JetPack's, from the system site packages
        elif profile.kind == "cpu":
            assert f"--index-url {TORCH_CPU_INDEX} 'torch>=" in text    # the CPU build, not 4 GB of CUDA
        else:
            assert "torch" in names and "--index-url" not in text      # a CUDA workstation: PyPI's CUDA torch
    else:
        assert "torch" not in names and "safetensors" not in names
    if backend == "llamacpp":
        assert not ort and "llama-cpp-python" in names
    if backend == "onnx":
        assert ort == {profile.onnxruntime_package} and "llama-cpp-python" not in names


def test_cuda_llama_builds_for_orin_on_a_jetson_and_for_the_card_elsewhere():
    jet = install_commands(load_profile("jetson-orin-nano-8gb"), "llamacpp", "pypi", "/r", "python3", WHEEL)
    hub = install_commands(load_profile("rtx4090-workstation"), "llamacpp", "pypi", "/r", "python3", WHEEL)
    cpu = install_commands(load_profile("cpu-2core"), "llamacpp", "pypi", "/r", "python3", WHEEL)
    assert jet[-1].startswith("CMAKE_ARGS='-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=87'")
    assert hub[-1].startswith("CMAKE_ARGS='-DGGML_CUDA=on' ") and "87" not in hub[-1]
    assert "CMAKE_ARGS" not in cpu[-1] and "llama-cpp-python==" in cpu[-1]
    assert len(cpu) == 4                              # venv, the kit, the core, llama-cpp-python


def test_the_extras_the_plan_and_the_makefile_name_exist():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {e for es in BACKEND_EXTRAS.values() for e in es} <= set(extras)
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if "pip install -q -e" in x)
    named = set(re.search(r'\.\[([^\]]+)\]', line).group(1).split(","))
    assert {"torch", "onnx", "hub", "export", "test"} <= named <= set(extras)
    core = " ".join(wheel_requirements(WHEEL))
    for heavy in ("torch", "onnx", "amqtt", "cryptography", "safetensors"):
        assert not re.search(rf"(^| ){heavy}[<>=]", core), f"{heavy} is back in the core requirements"


def test_install_size_is_reported_in_mib():
    assert describe_size("215040\t/home/nv/starsun/venv\n") == "the venv takes 210 MiB"
    assert "unknown" in describe_size("")


# --- what a role really imports, in a fresh interpreter ----------------------------------------

PROBE = r"""
import importlib, json, sys
from importlib import metadata
for m in ("edge.cli.agent", "edge.cli.agent_run", "edge.cli.agent_roles", "edge.wire.link", "edge.api.openai_http",
          "edge.telemetry.readings", "edge.telemetry.metrics_http", "edge.telemetry.publisher",
          "edge.star.target", "edge.star.remote_drafter", "edge.star.draft_node", "edge.memory.fit"):
    importlib.import_module(m)                     # what `edge-agent run` may load for a target or a draft
from edge.cli.plan_command import check_before_load
from edge.engines.loader import load_engine, open_model
from edge.model.resolved import resolve
ref, backend = sys.argv[1], sys.argv[2]
model = resolve(ref, backend, "target")
kw = check_before_load("target", model, 256, None, "64G")
if ref.endswith(".onnx"):
    engine = load_engine(model, max_len=256, **kw)
else:
    engine, tok = open_model(model, max_len=256, **kw)
    tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
s = engine.new_sequence()
engine.forward_last(s, [5, 6, 7, 8])
blob = engine.export_kv(s)
engine.free(s)
engine.import_kv(blob)
dists = metadata.packages_distributions()
print("RESULT " + json.dumps(sorted({d for m in list(sys.modules) for d in dists.get(m.split(".")[0], [])})))
"""


def _closure(reqs) -> set:
    """The distributions pip would install for reqs, from this venv's metadata (extras' deps left out)."""
    from packaging.requirements import Requirement
    todo, seen = [Requirement(r).name for r in reqs], set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return seen


def _imported(spec, backend) -> set:
    r = subprocess.run([sys.executable, "-c", PROBE, str(spec), backend], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    return {d.lower().replace("_", "-") for d in got}


def _assert_plan_covers(imported: set, extra: str):
    installed = _closure(wheel_requirements(WHEEL) + wheel_requirements(WHEEL, extra)) | {"starsun", "pip",
                                                                                          "setuptools"}
    assert imported - installed == set(), f"the role imports {imported - installed}, which its install lacks"
    assert not imported & {"torch", "onnx", "safetensors", "amqtt", "cryptography"}


def test_a_llamacpp_target_imports_only_the_core_and_llama_cpp():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: `make llama`")
    from edge.model.fetch import model_path
    p = model_path("smollm2-135m")
    if not p.exists():
        pytest.skip("SmolLM2-135M is not fetched: `make models`")
    imported = _imported(p, "llamacpp")
    assert "llama-cpp-python" in imported and "onnxruntime" not in imported
    _assert_plan_covers(imported, "llama")


def test_an_onnxruntime_target_imports_only_the_core_and_onnxruntime(exports):
    pytest.importorskip("onnxruntime")
    imported = _imported(exports.onnx("llama"), "onnx")
    assert "onnxruntime" in imported and "llama-cpp-python" not in imported
    _assert_plan_covers(imported, "onnx")
