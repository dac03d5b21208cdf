"""Where a role's model runs: one decision per role, from what was asked, the device profile and
what the installed runtime can do.

    decide_placement(backend, device="auto", gpu_layers=None, device_facts=None, caps=probe(backend),
                     repack="auto")

`device`: auto | cpu | cuda (`--accelerator`); `gpu_layers`: llama.cpp's layers on the GPU
(`--gpu-layers N|all`, all = -1); `repack`: whether llama.cpp repacks the weights it keeps on the
CPU (`--repack auto|on|off|both`, edge/engines/llamacpp_repack.py; both: llamacpp_twin.py), carried to the engine with the
rest. `auto` puts every layer on the GPU where the runtime can use one (llama.cpp built with a
GPU backend, onnxruntime with CUDAExecutionProvider, torch with CUDA) and the profile has a GPU;
without a profile the runtime decides (a CUDA build on a workstation is what its user built it
for); a CPU profile stays on the CPU. What cannot be honoured is refused with the fix
(PlacementError), never run on the CPU in silence.

The decision is pure (capabilities are injected, probe_capabilities reads them), so the whole
table is tested on a CPU machine. Only the runtime of the chosen backend is imported: a
llama.cpp or onnxruntime role must not load torch (~0.2 GB of RSS).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from edge.engines.base import EngineError

DEVICES = ("auto", "cpu", "cuda")
REPACK = ("auto", "on", "off", "both")   # --repack: llama.cpp's CPU weight repacking (llamacpp_repack.py)
ALL_LAYERS = -1                      # llama.cpp: n_gpu_layers < 0 offloads every layer
GPU_KINDS = ("jetson", "gpu")        # devices/profiles/*.toml `kind`s that have a GPU
CUDA_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")

# what to install when the runtime cannot reach the GPU (docs: docs/devices.md)
FIXES = {
    "llamacpp": "this llama-cpp-python is CPU-only: rebuild it with CUDA, "
                "`make llama LLAMA_CMAKE_ARGS=\"-DLLAVA_BUILD=OFF -DGGML_CUDA=ON\"` "
                "(on a device: CMAKE_ARGS='-DGGML_CUDA=on' pip install --no-binary llama-cpp-python "
                "llama-cpp-python==0.3.36)",
    "onnx": "this onnxruntime has no CUDAExecutionProvider: `pip install onnxruntime-gpu` in place of "
            "onnxruntime (Jetson: NVIDIA's wheel, pip install --index-url https://pypi.jetson-ai-lab.io/jp6/cu126 "
            "onnxruntime-gpu)",
    "torch": "this torch has no CUDA: on a Jetson install JetPack's torch (NVIDIA's PyTorch for Jetson wheel, "
             "or https://pypi.jetson-ai-lab.io/jp6/cu126); on a PC `pip install torch --index-url "
             "https://download.pytorch.org/whl/cu124`",
}


class PlacementError(EngineError):
    """A placement the runtime or the request cannot honour; the message names the fix."""


@dataclass(frozen=True)
class Capabilities:
    """What the installed runtime of a backend can do (None: not asked / not installed)."""
    llama_gpu_offload: Optional[bool] = None     # llama_cpp.llama_supports_gpu_offload()
    ort_providers: Tuple[str, ...] = ()          # onnxruntime.get_available_providers()
    torch_cuda: Optional[bool] = None            # torch.cuda.is_available()


@dataclass(frozen=True)
class DeviceFacts:
    """What a device profile says about its GPU (edge/ reads profiles only through the CLI)."""
    name: str
    has_gpu: bool
    jetson: bool = False
    unified_memory: bool = False

    @classmethod
    def from_profile(cls, profile) -> "DeviceFacts":
        """From a devices.profile.DeviceProfile (duck-typed: its kind and unified_memory)."""
        kind = getattr(profile, "kind", "cpu")
        return cls(profile.name, kind in GPU_KINDS, kind == "jetson",
                   bool(getattr(profile, "unified_memory", kind == "jetson")))


@dataclass(frozen=True)
class Placement:
    """Where one role's model runs, and why."""
    backend: str
    device: str                          # cpu | cuda
    reason: str
    gpu_layers: int = 0                  # llama.cpp n_gpu_layers (ALL_LAYERS: all)
    ort_providers: Tuple[str, ...] = ()
    torch_device: str = "cpu"
    warnings: Tuple[str, ...] = field(default_factory=tuple)
    repack: str = "auto"                 # llama.cpp's CPU weight repacking: auto | on | off | both (--repack)
    exact_rows: bool = False             # llama.cpp: pad calls so rows round alike (--exact-rows, llamacpp_rows.py)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def engine_kwargs(self) -> dict:
        """What the backend's engine takes for this placement (load_engine passes them on)."""
        if self.backend == "llamacpp":
            from edge.engines.llamacpp_repack import repack_kwargs
            kw = {"n_gpu_layers": self.gpu_layers, **({"exact_rows": True} if self.exact_rows else {})}
            return {**kw, **repack_kwargs(self.repack)}
        if self.backend == "onnx":
            return {"providers": list(self.ort_providers)}
        return {"device": self.torch_device}

    def describe(self) -> str:
        """The decision in words (the start line adds what the loaded engine reports)."""
        if self.backend == "llamacpp":
            where = ("all layers on the GPU" if self.gpu_layers == ALL_LAYERS
                     else f"{self.gpu_layers} layers on the GPU" if self.gpu_layers else "all layers on the CPU")
            where += f", --repack {self.repack}" if self.repack != "auto" else ""
            where += ", --exact-rows" if self.exact_rows else ""
        elif self.backend == "onnx":
            where = "providers " + ", ".join(self.ort_providers)
        else:
            where = f"torch device {self.torch_device}"
        return f"{self.backend} on {self.device}: {where} ({self.reason})"


def parse_gpu_layers(value) -> Optional[int]:
    """`--gpu-layers`: None (not given), `all` (-1) or a count >= 0."""
    if value is None or value == "":
        return None
    text = str(value).strip().lower()
    if text == "all":
        return ALL_LAYERS
    try:
        n = int(text)
    except ValueError:
        n = -2
    if n < 0:
        raise PlacementError(f"--gpu-layers {value!r}: give a number of layers (0 or more) or `all`")
    return n


def probe_capabilities(backend: str) -> Capabilities:
    """Ask the installed runtime of `backend` (only that one) what it can do."""
    if backend == "llamacpp":
        try:
            import llama_cpp
        except ImportError:
            return Capabilities()
        return Capabilities(llama_gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()))
    if backend == "onnx":
        try:
            import onnxruntime
        except ImportError:
            return Capabilities()
        return Capabilities(ort_providers=tuple(onnxruntime.get_available_providers()))
    import torch
    return Capabilities(torch_cuda=bool(torch.cuda.is_available()))


def _can_use_gpu(backend: str, caps: Capabilities) -> bool:
    if backend == "llamacpp":
        return bool(caps.llama_gpu_offload)
    if backend == "onnx":
        return "CUDAExecutionProvider" in caps.ort_providers
    return bool(caps.torch_cuda)


def _on(backend: str, device: str, reason: str, gpu_layers: int, warnings=()) -> Placement:
    gpu = device == "cuda"
    return Placement(backend, device, reason, gpu_layers=gpu_layers if backend == "llamacpp" else 0,
                     ort_providers=CUDA_PROVIDERS if gpu else ("CPUExecutionProvider",),
                     torch_device="cuda" if gpu else "cpu", warnings=tuple(warnings))


def decide_placement(backend: str, device: str = "auto", gpu_layers: Optional[int] = None,
                     facts: Optional[DeviceFacts] = None, caps: Optional[Capabilities] = None,
                     repack: str = "auto", exact_rows: bool = False) -> Placement:
    """The placement of one role's model (module doc). gpu_layers: parse_gpu_layers' value; it
    speaks only for llama.cpp (other backends place the whole model), as do repack and exact_rows."""
    if repack not in REPACK:
        raise PlacementError(f"--repack {repack!r}: use auto, on, off or both")
    p = _decide(backend, device, gpu_layers, facts, caps)
    if backend != "llamacpp":
        ignored = ([f"--repack {repack}"] if repack != "auto" else []) + (["--exact-rows"] if exact_rows else [])
        return replace(p, warnings=p.warnings + tuple(f"{o} is for llama.cpp models; {backend} ignores it"
                                                      for o in ignored))
    if repack == "both" and exact_rows:
        raise PlacementError("--repack both cannot go with --exact-rows: the unrepacked copy's rows round unlike "
                             "the repacked model's; use --repack on or off with --exact-rows")
    return replace(p, repack=repack, exact_rows=bool(exact_rows))


def _decide(backend: str, device: str, gpu_layers: Optional[int], facts: Optional[DeviceFacts],
            caps: Optional[Capabilities]) -> Placement:
    if device not in DEVICES:
        raise PlacementError(f"unknown device {device!r}; use auto, cpu or cuda")
    caps = caps if caps is not None else probe_capabilities(backend)
    can = _can_use_gpu(backend, caps)
    layers = gpu_layers if backend == "llamacpp" else None
    warnings = []
    if facts is not None and facts.jetson and backend == "llamacpp" and not can:
        warnings.append(f"profile {facts.name} is a Jetson but {FIXES['llamacpp']}; "
                        "every layer decodes on the ARM cores until then")
    if device == "cpu":
        if layers:
            raise PlacementError(f"--accelerator cpu with --gpu-layers {'all' if layers < 0 else layers}: "
                                 "pick one (--gpu-layers 0 or --accelerator cuda)")
        return _on(backend, "cpu", "asked for --accelerator cpu", 0, warnings)
    wants_gpu = device == "cuda" or bool(layers)
    if wants_gpu and not can:
        asked = "--accelerator cuda" if device == "cuda" else f"--gpu-layers {'all' if layers < 0 else layers}"
        raise PlacementError(f"{asked} on {backend}, but {FIXES[backend]}; or run it on the CPU with --accelerator cpu")
    if wants_gpu:
        n = ALL_LAYERS if layers is None else layers
        why = "asked for --accelerator cuda" if device == "cuda" else f"asked for --gpu-layers {'all' if n < 0 else n}"
        return _on(backend, "cuda", why, n, warnings)
    # auto, nothing forced
    if layers == 0:
        return _on(backend, "cpu", "asked for --gpu-layers 0", 0, warnings)
    if not can:
        return _on(backend, "cpu", f"auto: this {_runtime(backend)} cannot use a GPU", 0, warnings)
    if facts is not None and not facts.has_gpu:
        return _on(backend, "cpu", f"auto: profile {facts.name} has no GPU", 0, warnings)
    where = f"profile {facts.name} has a GPU" if facts is not None else "no profile says otherwise"
    return _on(backend, "cuda", f"auto: this {_runtime(backend)} can use the GPU and {where}", ALL_LAYERS, warnings)


def _runtime(backend: str) -> str:
    return {"llamacpp": "llama.cpp build", "onnx": "onnxruntime", "torch": "torch"}.get(backend, backend)
