"""The SUN demo's memory lines: each specialist as the prefill-only LoRA adapter it is served as,
beside what it would take as a full copy of the prefill module (the base's shapes again), both
read from the saved files; and what the one prefill worker holds in tensors, measured on it."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from edge.memory.model_shape import safetensors_bytes
from edge.model.lora.files import WEIGHTS_FILE


def specialist_memory(base_dir: Path, adapters: Dict[str, Path]) -> dict:
    """Tensor bytes as saved: the base (= one full copy of the prefill module) and per task its adapter."""
    full = safetensors_bytes(sorted(Path(base_dir).glob("*.safetensors")))
    return {"base_bytes": full,
            "tasks": {t: {"adapter_bytes": safetensors_bytes([Path(d) / WEIGHTS_FILE]), "full_copy_bytes": full}
                      for t, d in adapters.items()}}


def held_bytes(backend) -> dict:
    """Tensor bytes a TorchAdapterBackend holds: its base's once, and each task's adapter."""
    base = sum(t.numel() * t.element_size() for t in backend.base.state_dict().values())
    return {"base_bytes": base, "adapter_bytes": {t: backend.view.adapter(t).nbytes for t in backend.tasks}}


def _kb(n: int) -> str:
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def memory_lines(mem: dict, held: Optional[dict] = None) -> List[str]:
    """Per specialist: adapter vs full copy; then all of them on one worker vs as full copies."""
    lines = ["memory per specialist (tensor bytes as saved): the prefill-only LoRA adapter it is served as "
             "vs a full copy of the prefill module"]
    for task, m in mem["tasks"].items():
        lines.append(f"  {task:<8} adapter {_kb(m['adapter_bytes']):>9}   full copy {_kb(m['full_copy_bytes']):>9}"
                     f"   ({m['full_copy_bytes'] / m['adapter_bytes']:.1f}x less)")
    n, ads = len(mem["tasks"]), sum(m["adapter_bytes"] for m in mem["tasks"].values())
    full = sum(m["full_copy_bytes"] for m in mem["tasks"].values())
    lines.append(f"  all {n} on one prefill worker: the base once {_kb(mem['base_bytes'])} + {n} adapters {_kb(ads)} "
                 f"= {_kb(mem['base_bytes'] + ads)};  as full copies {n} x {_kb(mem['base_bytes'])} = {_kb(full)}  (a real "
                 "model on a device: edge-agent plan --adapters)")
    if held is not None:
        got = held["base_bytes"] + sum(held["adapter_bytes"].values())
        lines.append(f"  measured on the serving worker's tensors: base {_kb(held['base_bytes'])} + "
                     f"{len(held['adapter_bytes'])} adapters {_kb(sum(held['adapter_bytes'].values()))} = {_kb(got)}")
    return lines
