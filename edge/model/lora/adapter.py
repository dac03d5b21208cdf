"""A LoRA adapter as tensors: per target linear W [out, in], A [r, in] and B [out, r].

The adapted linear computes y = W x + scale * B (A x), scale = alpha / r (alpha / sqrt(r) with
rsLoRA), exactly as PEFT's LoRA layer does. Tensors are keyed by the module path of our
Transformer (HF's names, "model.layers.3.self_attn.q_proj"), so PEFT's tensor names are
"base_model.model." + path + ".lora_A.weight" and need no mapping table.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from edge.model.lora.error import AdapterError
from edge.model.transformer import ModelConfig, Transformer

# PEFT's target_modules names -> the parent module in a block
TARGET_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ALL_TARGETS = tuple(TARGET_PARENTS)
SHORT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def parse_targets(text: str) -> Tuple[str, ...]:
    """"q,k,v,o,gate,up,down" (or PEFT's full names) -> PEFT names in canonical order."""
    names = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        name = SHORT_NAMES.get(word, word)
        if name not in TARGET_PARENTS:
            raise AdapterError(f"unknown target module {word!r}: use some of "
                               f"{','.join(SHORT_NAMES)} (or {','.join(ALL_TARGETS)})")
        names.append(name)
    if not names:
        raise AdapterError("no target modules given: use e.g. q,k,v,o,gate,up,down")
    return tuple(t for t in ALL_TARGETS if t in names)


def module_path(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{TARGET_PARENTS[target]}.{target}"


def target_shapes(cfg: ModelConfig, targets: Sequence[str] = ALL_TARGETS) -> Dict[str, Tuple[int, int]]:
    """Module path -> (out, in) of every targeted linear of a base with this config."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, m = cfg.hidden_size, cfg.intermediate_size
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}
    return {module_path(i, t): dims[t] for i in range(cfg.num_layers) for t in targets}


@dataclass
class LoraAdapter:
    rank: int
    alpha: float
    targets: Tuple[str, ...]                 # PEFT module names, e.g. ("q_proj", "v_proj")
    lora_a: Dict[str, torch.Tensor]          # module path -> A [rank, in]
    lora_b: Dict[str, torch.Tensor]          # module path -> B [out, rank]
    use_rslora: bool = False
    base_fingerprint: str = ""               # base_fingerprint() of its base; "" = not recorded
    base_model: str = ""                     # PEFT's base_model_name_or_path
    extra: dict = field(default_factory=dict)  # other config keys kept for the manifest

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def parameters(self) -> List[torch.Tensor]:
        """Every A and B, in a fixed order (module path, then A before B): what tuning trains."""
        return [t for k in sorted(self.lora_a) for t in (self.lora_a[k], self.lora_b[k])]

    def named_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(PEFT tensor name, tensor) in the order of parameters()."""
        for k in sorted(self.lora_a):
            yield f"base_model.model.{k}.lora_A.weight", self.lora_a[k]
            yield f"base_model.model.{k}.lora_B.weight", self.lora_b[k]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def to(self, dtype: Optional[torch.dtype] = None, device=None) -> "LoraAdapter":
        """A copy on dtype / device; tensors already there are the same objects (gradients reach them)."""
        return replace(self, lora_a={k: v.to(device=device, dtype=dtype) for k, v in self.lora_a.items()},
                       lora_b={k: v.to(device=device, dtype=dtype) for k, v in self.lora_b.items()})

    def check(self, cfg: ModelConfig) -> None:
        """Refuse (AdapterError) an adapter whose tensors do not fit a base with config `cfg`."""
        if type(self.rank) is not int or self.rank < 1:
            raise AdapterError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        unknown = [t for t in self.targets if t not in TARGET_PARENTS]
        if unknown:
            raise AdapterError(f"unknown target module {unknown[0]!r}: a Llama/Qwen2 base has {','.join(ALL_TARGETS)}")
        want = target_shapes(cfg, self.targets)
        have = set(self.lora_a) | set(self.lora_b)
        missing, extra = sorted(set(want) - have), sorted(have - set(want))
        if extra:
            raise AdapterError(f"adapter has tensors for {extra[0]} ({len(extra)} extra), which this base "
                               f"({cfg.num_layers} layers, targets {','.join(self.targets)}) does not have: "
                               "it was made for another base")
        if missing or set(self.lora_a) != set(self.lora_b):
            gap = missing or sorted(set(self.lora_a) ^ set(self.lora_b))
            raise AdapterError(f"adapter lacks lora_A or lora_B of {gap[0]} ({len(gap)} missing): the file "
                               "is incomplete or made for a base with fewer layers; re-export it")
        for k, (out, inp) in want.items():
            a, b = self.lora_a[k], self.lora_b[k]
            if a.dim() != 2 or b.dim() != 2:
                raise AdapterError(f"{k}: lora_A and lora_B must be matrices, got {tuple(a.shape)} and {tuple(b.shape)}")
            if a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise AdapterError(f"{k}: wrong rank tensors: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                   f"disagree with r={self.rank} in adapter_config.json; the file is damaged")
            if a.shape[1] != inp or b.shape[0] != out:
                raise AdapterError(f"{k}: wrong base shape: this base's linear is [{out}, {inp}], the adapter's "
                                   f"is [{b.shape[0]}, {a.shape[1]}]; it was made for another model")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterError(f"{k}: LoRA tensors must be floating point, got {a.dtype}")


def _new(cfg: ModelConfig, rank: int, alpha: Optional[float], targets: Sequence[str], dtype, device,
         base_fingerprint: str) -> LoraAdapter:
    targets = parse_targets(",".join(targets))
    shapes = target_shapes(cfg, targets)
    a = {k: torch.zeros(rank, i, dtype=dtype, device=device) for k, (o, i) in shapes.items()}
    b = {k: torch.zeros(o, rank, dtype=dtype, device=device) for k, (o, i) in shapes.items()}
    ad = LoraAdapter(rank, float(alpha if alpha is not None else rank), targets, a, b,
                     base_fingerprint=base_fingerprint)
    ad.check(cfg)
    return ad


def zeros_adapter(cfg: ModelConfig, rank: int, alpha: Optional[float] = None,
                  targets: Sequence[str] = ALL_TARGETS, dtype=torch.float32, device=None,
                  base_fingerprint: str = "") -> LoraAdapter:
    """An adapter of all zeros (A and B): it leaves the base exactly as it is."""
    return _new(cfg, rank, alpha, targets, dtype, device, base_fingerprint)


def init_adapter(cfg: ModelConfig, rank: int, alpha: Optional[float] = None,
                 targets: Sequence[str] = ALL_TARGETS, seed: int = 0, dtype=torch.float32, device=None,
                 base_fingerprint: str = "") -> LoraAdapter:
    """PEFT's initialisation (init_lora_weights=True): A kaiming-uniform(a=sqrt 5), B zeros.

    The adapted model starts equal to the base; seeded, so a tuning run is reproducible.
    alpha defaults to the rank (scale 1)."""
    ad = _new(cfg, rank, alpha, targets, dtype, device, base_fingerprint)
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    for k in sorted(ad.lora_a):
        torch.nn.init.kaiming_uniform_(ad.lora_a[k], a=math.sqrt(5), generator=g)
    return ad


def base_fingerprint(model: Transformer) -> str:
    """sha256 of a base's shape config and weights as float32, whatever dtype the model holds.

    The config's `extra` (loader metadata: bos/eos ids, ...) is left out, so the same weights
    loaded by another loader match; a base loaded in float64 or bfloat16 from the same fp32
    file gives the same value. For a config without extras it equals
    edge.model.sun_modules.weights_fingerprint(model.float(), "fp32") -- the fp shared decoder's
    fingerprint when the base is fp32 -- without a float32 copy of the model."""
    h = hashlib.sha256()
    h.update(replace(model.cfg, extra={}).to_json().encode())
    h.update(b"fp32")
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
