"""GGUF LoRA adapters as llama.cpp reads them, checked here before llama.cpp sees them (no torch).

llama.cpp's loader (src/llama-adapter.cpp) wants `general.type = adapter`, `adapter.type =
lora`, `adapter.lora.alpha` (f32), a `general.architecture` equal to the base model's, and for
each adapted base tensor NAME a pair NAME.lora_a (ne [in, rank]) and NAME.lora_b (ne [rank,
out]); at run time it adds alpha / rank * B(A x) to NAME's product. When a file breaks a rule
it only logs the reason and returns NULL, so `check_adapter` reads the file with the `gguf`
package first and says what is wrong (wrong base, wrong ranks, a module it does not know).
"""
from __future__ import annotations

import struct

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from edge.model.errors import EngineError

# llama.cpp tensor kind -> the short target name SUN's tuning uses (--targets q,k,v,o,gate,up,down)
TARGETS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
           "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
TASK_KEY = "starsun.adapter.task"       # our own metadata: which SUN task the adapter serves

Shape = Tuple[int, int]                 # ggml ne order: (ne0 = in, ne1 = out) for a weight


class AdapterError(EngineError):
    """A LoRA adapter file that llama.cpp would refuse, or that belongs to another base model."""


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter file holds: for the manifest, `describe` and the serving side."""
    path: str
    arch: str
    alpha: float
    ranks: Tuple[int, ...]              # distinct ranks of its pairs (one for a plain LoRA)
    targets: Tuple[str, ...]            # short names, e.g. ("q", "v")
    layers: Tuple[int, ...]
    pairs: int
    task: Optional[str]
    bytes: int


def _reader(path: Path, what: str):
    import gguf
    if not Path(path).is_file():
        raise AdapterError(f"no {what} file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:  # the gguf package's errors on a bad file
        raise AdapterError(f"{path} is not a readable GGUF file ({str(e)[:200]}); re-export it") from None


def _field(r, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def base_shapes(path) -> Tuple[str, Dict[str, Shape]]:
    """(architecture, {tensor name: ne[:2]}) of a base GGUF from its header alone (edge/model/gguf_header.py):
    gguf.GGUFReader maps the whole file and its tensor views touched ~450 MiB of a 0.5B Q4_0 base
    (the colocated agent's startup peak, above llama-server's)."""
    from edge.model.gguf_header import GGUFHeaderError, read_gguf_header
    if not Path(path).is_file():
        raise AdapterError(f"no base model file at {path}")
    try:
        h = read_gguf_header(path)
    except (GGUFHeaderError, OSError, struct.error) as e:
        raise AdapterError(f"{path} is not a readable GGUF file ({str(e)[:200]}); re-export it") from None
    return str(h.get("general.architecture")), {t.name: (int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1)
                                                for t in h.tensors}


def _split(name: str) -> Tuple[str, str]:
    for suffix in (".lora_a", ".lora_b"):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise AdapterError(f"tensor {name!r} is not a LoRA pair part (.lora_a / .lora_b): not a LoRA adapter "
                       "this kit writes; re-export it with `edge-export adapter`")


def _kind(base_name: str) -> Tuple[int, str]:
    """(layer, short target) of 'blk.{i}.{kind}.weight'; other tensors are not ours to adapt."""
    parts = base_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in TARGETS:
        return int(parts[1]), TARGETS[parts[2]]
    raise AdapterError(f"the adapter adapts {base_name!r}, a module LoRA adapters may not target here "
                       f"(only the projections {', '.join(TARGETS)} of blk.N)")


def read_adapter(path) -> Tuple[AdapterInfo, Dict[str, Tuple[Shape, Shape]]]:
    """The adapter's metadata and {base tensor: (lora_a ne, lora_b ne)}, checked for form."""
    path = Path(path)
    r = _reader(path, "LoRA adapter")
    if _field(r, "general.type") != "adapter" or _field(r, "adapter.type") != "lora":
        raise AdapterError(f"{path} is not a LoRA adapter (general.type {_field(r, 'general.type')!r}, "
                           f"adapter.type {_field(r, 'adapter.type')!r}); a base model goes to --model")
    alpha = _field(r, "adapter.lora.alpha")
    if not isinstance(alpha, float):
        raise AdapterError(f"{path} has no float adapter.lora.alpha; llama.cpp needs it to scale the update")
    parts: Dict[str, Dict[str, Tuple[int, ...]]] = {}
    for t in r.tensors:
        base, suffix = _split(t.name)
        if len(t.shape) != 2:
            raise AdapterError(f"{path}: {t.name} has {len(t.shape)} dimensions, a LoRA factor has 2")
        parts.setdefault(base, {})[suffix] = (int(t.shape[0]), int(t.shape[1]))
    if not parts:
        raise AdapterError(f"{path} holds no LoRA tensors")
    pairs, layers, targets, ranks = {}, set(), set(), set()
    for base, ab in sorted(parts.items()):
        if set(ab) != {".lora_a", ".lora_b"}:
            raise AdapterError(f"{path}: {base} has only {', '.join(ab)}; a LoRA pair needs lora_a and lora_b")
        a, b = ab[".lora_a"], ab[".lora_b"]
        if a[1] != b[0]:
            raise AdapterError(f"{path}: {base} has lora_a rank {a[1]} but lora_b rank {b[0]}")
        layer, target = _kind(base)
        pairs[base] = (a, b)
        layers.add(layer)
        targets.add(target)
        ranks.add(a[1])
    order = list(TARGETS.values())
    info = AdapterInfo(path=str(path), arch=str(_field(r, "general.architecture")), alpha=float(alpha),
                       ranks=tuple(sorted(ranks)), targets=tuple(sorted(targets, key=order.index)),
                       layers=tuple(sorted(layers)), pairs=len(pairs), task=_field(r, TASK_KEY),
                       bytes=path.stat().st_size)
    return info, pairs


def check_pairs_fit(pairs: Dict[str, Tuple[Shape, Shape]], arch: str, base_arch: str,
                    shapes: Dict[str, Shape], what: str) -> None:
    """Every pair adapts a tensor the base has, with the base's in/out sizes (llama.cpp's rule)."""
    if arch != base_arch:
        raise AdapterError(f"{what} is for architecture {arch!r}, the base model is {base_arch!r}")
    for base, (a, b) in pairs.items():
        if base not in shapes:
            raise AdapterError(f"{what} adapts {base}, which the base model does not have: it was made "
                               "for another base (more layers?)")
        ne_in, ne_out = shapes[base]
        if (a[0], b[1]) != (ne_in, ne_out):
            raise AdapterError(f"{what} adapts {base} as {a[0]} -> {b[1]}, but the base's is {ne_in} -> "
                               f"{ne_out}: it was made for another base shape")


def check_adapter(path, base_path) -> AdapterInfo:
    """Read the adapter at `path` and check it fits the base GGUF at `base_path`; AdapterError if not."""
    info, pairs = read_adapter(path)
    base_arch, shapes = base_shapes(base_path)
    check_pairs_fit(pairs, info.arch, base_arch, shapes, f"adapter {path}")
    return info
