"""Where a role's bytes live once it is placed (edge/engines/placement.py), and whether each side fits.

    host  the process (runtime, tokenizer) and whatever of the model stays on the CPU
    gpu   the offloaded share of the weights and the KV (llama.cpp: the layers on the GPU, whose
          KV is offloaded with them) and the compute buffers of a model on the GPU

On a Jetson (unified memory) the GPU and the CPU share one pool: the profile's usable memory
holds both sides together. On a discrete GPU the card's memory (the profile's gpu_memory_gb)
and host RAM (host_memory_gb, when the profile says it) are separate budgets, each checked
on its own. On a CPU placement everything is host. The CUDA context itself (~0.3-0.5 GB on
the host of a discrete GPU, public figures) is not counted: not measured here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from edge.memory.fit import Estimate

GB = 1e9
_HOST_ALWAYS = ("runtime", "tokenizer", "saved prompts")   # the process itself and its host-memory KV copies


@dataclass(frozen=True)
class MemorySides:
    """The budgets of a device: host RAM, GPU memory, or one shared pool (unified)."""
    name: str
    host: Optional[int]                 # bytes; None: not checked
    gpu: Optional[int] = None           # bytes on a discrete GPU; None: no GPU or unified
    unified: bool = False

    @classmethod
    def of_profile(cls, profile, budget: Optional[int] = None) -> "MemorySides":
        """A devices.profile.DeviceProfile's sides (duck-typed); `budget` (--memory-budget) stands
        for the side the model is placed on (the pool of a unified device)."""
        kind = getattr(profile, "kind", "cpu")
        unified = bool(getattr(profile, "unified_memory", False)) or kind == "jetson"
        usable = int(profile.usable_memory_gb * GB)
        if kind != "gpu" or unified:
            return cls(profile.name, budget or usable, None, unified)
        gpu_gb = getattr(profile, "gpu_memory_gb", 0.0) or profile.usable_memory_gb
        host_gb = getattr(profile, "host_memory_gb", 0.0)
        return cls(profile.name, int(host_gb * GB) if host_gb else None, budget or int(gpu_gb * GB), False)


def gpu_fraction(placement, layers: int) -> float:
    """Share of the weights and KV a placement puts on the GPU (llama.cpp: its layers of `layers`)."""
    if placement is None or not placement.on_gpu:
        return 0.0
    if placement.backend == "llamacpp" and placement.gpu_layers >= 0:
        return min(placement.gpu_layers, layers) / max(1, layers)
    return 1.0


def split(e: Estimate, fraction: float) -> Tuple[int, int]:
    """(host bytes, GPU bytes) of an estimate when `fraction` of the model is on the GPU."""
    host = gpu = 0
    for part, n in e.parts.items():
        if part in _HOST_ALWAYS or fraction == 0.0:
            host += n
        elif part == "compute":                  # the compute buffers follow the model onto the GPU
            gpu += n
        else:                                    # weights, kv, loading
            on = int(round(n * fraction))
            gpu, host = gpu + on, host + n - on
    return host, gpu


def check_sides(e: Estimate, fraction: float, sides: MemorySides) -> Optional[str]:
    """None when each side fits its budget, else why not (the side, what it needs, what it has)."""
    host, gpu = split(e, fraction)
    if sides.unified or sides.gpu is None:
        need = host + gpu
        if sides.host is not None and need > sides.host:
            shared = " (CPU and GPU share it)" if sides.unified else ""
            return (f"needs {need / GB:.2f} GB (host {host / GB:.2f} + GPU {gpu / GB:.2f}) of {sides.name}'s "
                    f"{sides.host / GB:.2f} GB{shared}")
        return None
    if gpu > sides.gpu:
        return (f"needs {gpu / GB:.2f} GB on the GPU (weights, KV and compute placed there) and {sides.name}'s GPU "
                f"has {sides.gpu / GB:.2f} GB")
    if sides.host is not None and host > sides.host:
        return f"needs {host / GB:.2f} GB of host RAM and {sides.name} has {sides.host / GB:.2f} GB"
    return None


def planned_placement(backend: str, device: str, gpu_layers, profile, repack: str = "auto"):
    """The placement `edge-agent plan` assumes for a profile (the device's runtime as provisioning
    installs it: GPU builds where the profile has a GPU), decided as a role would decide it."""
    from edge.engines.placement import Capabilities, DeviceFacts, decide_placement, parse_gpu_layers
    facts = DeviceFacts.from_profile(profile) if profile is not None else None
    gpu = bool(facts and facts.has_gpu)
    caps = Capabilities(llama_gpu_offload=gpu, torch_cuda=gpu,
                        ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider") if gpu
                        else ("CPUExecutionProvider",))
    return decide_placement(backend, device, parse_gpu_layers(gpu_layers), facts, caps, repack)


def placed_report(e: Estimate, placement, sides: MemorySides) -> dict:
    """Where the estimate's bytes live under `placement` and whether each side fits (plan's rows)."""
    frac = gpu_fraction(placement, e.shape.layers)
    host, gpu = split(e, frac)
    return {"device": placement.device, "reason": placement.reason, "gpu_layers": placement.gpu_layers,
            "repack": placement.repack,
            "gpu_fraction": frac, "host_bytes": host, "gpu_bytes": gpu, "unified": sides.unified,
            "host_budget_bytes": sides.host, "gpu_budget_bytes": sides.gpu, "refusal": check_sides(e, frac, sides)}
