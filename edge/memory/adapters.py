"""What LoRA specialists cost in memory, and how many fit beside one base (issue 37 point 4).

A prefill-only LoRA adapter holds, per targeted linear per layer, A [rank, in] and B [out, rank]:

    bytes = layers x sum over targets of rank x (in + out) x itemsize

exactly what edge.model.lora.save_adapter writes (its tensor payload) and what a GGUF LoRA of that
dtype holds. A full-copy specialist (edge-export tune without --adapter) is the whole prefill
module again: the model's weight bytes once per task. Torch-free: the planner imports this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from edge.memory.model_shape import ModelShape

# PEFT target names (edge/model/lora/adapter.py's, repeated here so the planner needs no torch)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SHORT = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
          "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ADAPTER_ITEMSIZE = {"F32": 4, "F16": 2, "float32": 4, "float16": 2, "bfloat16": 2}


def parse_targets(text: str) -> Tuple[str, ...]:
    """'q,k,v,o,gate,up,down' (or PEFT's names) -> PEFT names in canonical order; ValueError if unknown."""
    names = [_SHORT.get(w.strip(), w.strip()) for w in str(text).split(",") if w.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        why = f"unknown adapter target {bad[0]!r}" if bad else "no adapter targets given"
        raise ValueError(f"{why}; use some of {','.join(_SHORT)}")
    return tuple(t for t in TARGETS if t in names)


def linear_dims(shape: ModelShape) -> dict:
    """PEFT target name -> (out, in) of that linear in one layer."""
    q, kv, h, m = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}


def adapter_bytes(shape: ModelShape, rank: int, targets: Sequence[str] = TARGETS, itemsize: int = 4) -> int:
    """Tensor bytes of one rank-`rank` LoRA adapter over `targets` of every layer."""
    if type(rank) is not int or rank < 1:
        raise ValueError(f"adapter rank must be a positive integer, got {rank!r}")
    dims = linear_dims(shape)
    per_layer = sum(rank * (dims[t][0] + dims[t][1]) for t in parse_targets(",".join(targets)))
    return shape.layers * per_layer * itemsize


@dataclass(frozen=True)
class SpecialistFit:
    """How many task specialists fit what is left of a budget once the base roles are held."""
    left_bytes: int             # budget less the prefill worker (and its base) without specialists
    full_copy_bytes: int        # one full-copy specialist: the prefill module's weights again
    adapter_bytes: int          # one adapter
    full_copies: int
    adapters: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def specialists_that_fit(left_bytes: int, full_copy_bytes: int, one_adapter_bytes: int) -> SpecialistFit:
    """The base is held once either way; a full copy adds a module per task, an adapter its tensors.
    One full copy serves as the first specialist's module (the base itself is the shared decoder's)."""
    left = max(0, int(left_bytes))
    return SpecialistFit(left, full_copy_bytes, one_adapter_bytes,
                         left // full_copy_bytes if full_copy_bytes else 0,
                         left // one_adapter_bytes if one_adapter_bytes else 0)
