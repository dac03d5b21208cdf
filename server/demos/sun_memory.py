"""The SUN demo's memory line: each specialist as a full copy (what the demo serves) beside what it
would take as a prefill-only LoRA adapter over the one base (edge/memory/adapters.py's arithmetic)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from edge.memory.adapters import TARGETS, adapter_bytes
from edge.memory.model_shape import read_shape, safetensors_bytes

RANKS = (8, 16)


def specialist_memory(specialists: Dict[str, Path]) -> dict:
    """Per task: its full copy's tensor bytes (as saved) and a rank-r adapter's (F32, all seven linears)."""
    out = {}
    for task, d in specialists.items():
        shape = read_shape(str(d))
        out[task] = {"full_copy_bytes": safetensors_bytes(sorted(Path(d).glob("*.safetensors"))),
                     "adapter_bytes": {r: adapter_bytes(shape, r, TARGETS, 4) for r in RANKS}}
    return out


def memory_lines(mem: dict) -> List[str]:
    """What the demo prints: per specialist and for all of them, full copies vs adapters."""
    def kb(n):
        return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"
    lines = ["memory per specialist (tensor bytes): full copy of the prefill module vs a prefill-only LoRA "
             "adapter over the one base (F32, q,k,v,o,gate,up,down)"]
    for task, m in mem.items():
        ads = ", ".join(f"rank {r}: {kb(b)} ({m['full_copy_bytes'] / b:.1f}x less)" for r, b in m["adapter_bytes"].items())
        lines.append(f"  {task:<8} full copy {kb(m['full_copy_bytes'])};  as an adapter {ads}")
    full = sum(m["full_copy_bytes"] for m in mem.values())
    r8 = sum(m["adapter_bytes"][RANKS[0]] for m in mem.values())
    lines.append(f"  all {len(mem)}: full copies {kb(full)}, rank-{RANKS[0]} adapters {kb(r8)} "
                 "(the demo serves the full copies; see edge-agent plan --adapters for a device)")
    return lines
