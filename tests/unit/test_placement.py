"""The placement decision (edge/engines/placement.py): profile x runtime capability -> placement,
with the capabilities injected, and the refusals naming their fix."""
import pytest

from devices.profile import load_profile
from edge.engines.placement import (ALL_LAYERS, Capabilities, DeviceFacts, PlacementError, decide_placement,
                                    parse_gpu_layers, probe_capabilities)

CUDA_ALL = Capabilities(llama_gpu_offload=True, ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
                        torch_cuda=True)
CPU_ONLY = Capabilities(llama_gpu_offload=False, ort_providers=("CPUExecutionProvider",), torch_cuda=False)
JETSON = DeviceFacts.from_profile(load_profile("jetson-orin-nano-8gb"))
RTX = DeviceFacts.from_profile(load_profile("rtx4090-workstation"))
CPU_BOX = DeviceFacts.from_profile(load_profile("x86-cpu-generic"))


def test_profiles_say_whether_they_have_a_gpu():
    assert (JETSON.has_gpu, JETSON.jetson, JETSON.unified_memory) == (True, True, True)
    assert (RTX.has_gpu, RTX.jetson, RTX.unified_memory) == (True, False, False)
    assert not CPU_BOX.has_gpu


# (backend, profile, capabilities) -> (device, llama.cpp layers, ORT providers, torch device)
TABLE = [
    ("llamacpp", JETSON, CUDA_ALL, "cuda", ALL_LAYERS),
    ("llamacpp", RTX, CUDA_ALL, "cuda", ALL_LAYERS),
    ("llamacpp", None, CUDA_ALL, "cuda", ALL_LAYERS),       # no profile: the runtime decides
    ("llamacpp", CPU_BOX, CUDA_ALL, "cpu", 0),              # a CPU profile stays on the CPU
    ("llamacpp", JETSON, CPU_ONLY, "cpu", 0),
    ("llamacpp", None, CPU_ONLY, "cpu", 0),
    ("onnx", JETSON, CUDA_ALL, "cuda", 0),
    ("onnx", RTX, CPU_ONLY, "cpu", 0),
    ("onnx", CPU_BOX, CUDA_ALL, "cpu", 0),
    ("torch", RTX, CUDA_ALL, "cuda", 0),
    ("torch", JETSON, CPU_ONLY, "cpu", 0),
    ("torch", None, CPU_ONLY, "cpu", 0),
]


@pytest.mark.parametrize("backend,facts,caps,device,layers", TABLE)
def test_auto_decision_table(backend, facts, caps, device, layers):
    p = decide_placement(backend, "auto", None, facts, caps)
    assert p.device == device
    assert p.gpu_layers == layers
    assert p.torch_device == ("cuda" if device == "cuda" else "cpu")
    assert p.ort_providers == (("CUDAExecutionProvider", "CPUExecutionProvider") if device == "cuda"
                               else ("CPUExecutionProvider",))
    assert p.reason.startswith("auto")


def test_engine_kwargs_per_backend():
    assert decide_placement("llamacpp", "auto", None, JETSON, CUDA_ALL).engine_kwargs() == {"n_gpu_layers": -1}
    assert decide_placement("llamacpp", "auto", 12, JETSON, CUDA_ALL).engine_kwargs() == {"n_gpu_layers": 12}
    assert decide_placement("onnx", "cpu", None, RTX, CUDA_ALL).engine_kwargs() == {
        "providers": ["CPUExecutionProvider"]}
    assert decide_placement("torch", "cuda", None, None, CUDA_ALL).engine_kwargs() == {"device": "cuda"}


def test_explicit_requests_win_over_the_profile():
    assert decide_placement("llamacpp", "cpu", None, JETSON, CUDA_ALL).gpu_layers == 0
    assert decide_placement("llamacpp", "auto", 0, JETSON, CUDA_ALL).device == "cpu"
    p = decide_placement("llamacpp", "cuda", None, CPU_BOX, CUDA_ALL)
    assert (p.device, p.gpu_layers, p.reason) == ("cuda", ALL_LAYERS, "asked for --accelerator cuda")


@pytest.mark.parametrize("backend,device,layers,fix", [
    ("llamacpp", "cuda", None, "-DGGML_CUDA=ON"),
    ("llamacpp", "auto", ALL_LAYERS, "-DGGML_CUDA=ON"),
    ("llamacpp", "auto", 8, "make llama LLAMA_CMAKE_ARGS="),
    ("onnx", "cuda", None, "pip install onnxruntime-gpu"),
    ("torch", "cuda", None, "JetPack's torch"),
])
def test_absent_gpu_is_refused_with_the_fix(backend, device, layers, fix):
    with pytest.raises(PlacementError) as e:
        decide_placement(backend, device, layers, JETSON, CPU_ONLY)
    assert fix in str(e.value)
    assert "--accelerator cpu" in str(e.value)


def test_contradictions_and_bad_values_are_refused():
    with pytest.raises(PlacementError, match="pick one"):
        decide_placement("llamacpp", "cpu", ALL_LAYERS, None, CUDA_ALL)
    with pytest.raises(PlacementError, match="unknown device"):
        decide_placement("torch", "tpu", None, None, CUDA_ALL)
    for bad in ("-3", "some", "1.5"):
        with pytest.raises(PlacementError, match="--gpu-layers"):
            parse_gpu_layers(bad)
    assert [parse_gpu_layers(v) for v in (None, "all", "ALL", "0", 24)] == [None, ALL_LAYERS, ALL_LAYERS, 0, 24]


def test_a_jetson_with_a_cpu_only_llama_cpp_warns():
    p = decide_placement("llamacpp", "auto", None, JETSON, CPU_ONLY)
    assert p.device == "cpu"
    assert len(p.warnings) == 1 and "Jetson" in p.warnings[0] and "-DGGML_CUDA=ON" in p.warnings[0]
    assert decide_placement("llamacpp", "auto", None, JETSON, CUDA_ALL).warnings == ()
    assert decide_placement("llamacpp", "auto", None, RTX, CPU_ONLY).warnings == ()


@pytest.mark.parametrize("backend", ["llamacpp", "onnx", "torch"])
def test_auto_picks_the_cpu_on_this_machine(backend):
    """This machine has no GPU and CPU-only runtimes: the real probe leads to the CPU."""
    caps = probe_capabilities(backend)
    p = decide_placement(backend, "auto", None, JETSON, caps)
    assert p.device == "cpu" and p.gpu_layers == 0 and p.torch_device == "cpu"
    assert p.ort_providers == ("CPUExecutionProvider",)
