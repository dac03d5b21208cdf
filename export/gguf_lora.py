"""A PEFT LoRA adapter directory -> the GGUF LoRA file llama.cpp loads beside its base model.

    edge-export adapter runs/task-a/adapter out/task-a.lora.gguf --base out/smol-f16.gguf

Input: PEFT's on-disk format (adapter_config.json with peft_type LORA, r, lora_alpha,
target_modules; adapter_model.safetensors with base_model.model.model.layers.{i}.self_attn.
q_proj.lora_A.weight [r, in] and lora_B.weight [out, r], likewise k/v/o and mlp gate/up/down).
Output follows llama.cpp's convert_lora_to_gguf.py: general.type adapter, adapter.type lora,
adapter.lora.alpha, tensors blk.{i}.attn_q.weight.lora_a / .lora_b holding A and B as they are
(gguf reverses the shape, so ne = [in, r] and [r, out]); for arch llama the rows of B of q and
k are permuted like the base's q/k rows (export/gguf.py: permute(W) = permute(B) A).

llama.cpp scales every pair by alpha / rank; a PEFT adapter whose scale differs per module
(rank_pattern, alpha_pattern) or is alpha / sqrt(r) (use_rslora) has the difference folded
into B, so the product is what PEFT computes. The base decides the architecture, the head
counts for the permutation and the shapes every pair is checked against.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import gguf
import numpy as np

from edge.engines.lora_gguf import TASK_KEY, AdapterError, base_shapes, check_pairs_fit
from edge.model.tokenizer import open_gguf

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name after "model.layers.{i}." -> llama.cpp's tensor kind
MODULES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$")
# PEFT options whose adapters are not a plain W + s B A on these modules
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out (Conv1D)",
                "modules_to_save": "modules_to_save (fully trained copies)", "target_parameters": "target_parameters",
                "trainable_token_indices": "trainable tokens"}
FILE_TYPES = ("F32", "F16")


class AdapterExportError(AdapterError, ValueError):
    """The adapter directory, its base or the output cannot make a GGUF LoRA file."""


@dataclass
class PeftLora:
    """A PEFT LoRA adapter read from disk: per module (layer, PEFT module) its A, B and scale."""
    directory: Path
    rank: int
    alpha: float
    targets: list
    pairs: Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class BaseModel:
    """What the adapter is checked against: the base GGUF's architecture, heads and tensor shapes."""
    path: Path
    arch: str
    n_head: int
    n_head_kv: int
    shapes: dict


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern rule: a key matches a module name suffix (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(d: Path) -> dict:
    if not d.is_dir():
        raise AdapterExportError(f"no adapter directory at {d}")
    if not (d / CONFIG).is_file():
        raise AdapterExportError(f"{d} has no {CONFIG}: not a PEFT adapter directory")
    if not (d / WEIGHTS).is_file():
        extra = " (adapter_model.bin is a pickle: save it as safetensors)" if (d / "adapter_model.bin").exists() else ""
        raise AdapterExportError(f"{d} has no {WEIGHTS}{extra}")
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except ValueError as e:
        raise AdapterExportError(f"{d / CONFIG} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise AdapterExportError(f"{d / CONFIG}: peft_type must be LORA, got "
                                 f"{(cfg.get('peft_type') if isinstance(cfg, dict) else cfg)!r}")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key) not in (None, False, [], {}, "none"):
            raise AdapterExportError(f"{d}: {what} ({key}) cannot be expressed as a llama.cpp LoRA")
    if cfg.get("bias", "none") != "none":
        raise AdapterExportError(f"{d}: bias={cfg['bias']!r} trains biases, which a llama.cpp LoRA cannot carry")
    if not isinstance(cfg.get("r"), int) or cfg["r"] <= 0 or not isinstance(cfg.get("lora_alpha"), (int, float)) \
            or cfg["lora_alpha"] <= 0:
        raise AdapterExportError(f"{d / CONFIG}: r must be a positive integer and lora_alpha a positive number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        known = {m.split(".")[-1] for m in MODULES}
        unknown = [t for t in targets if str(t).split(".")[-1] not in known]
        if unknown:
            raise AdapterExportError(f"{d}: target_modules {unknown} are not modules a llama.cpp LoRA can adapt "
                                     f"here (only {', '.join(sorted(known))})")
    return cfg


def _module_scale(cfg: dict, module: str, rank: int) -> float:
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def read_peft_lora(directory) -> PeftLora:
    """Read and check a PEFT LoRA directory: names, pairs, ranks, finite values."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    d = Path(directory)
    cfg = _read_config(d)
    try:
        tensors = load_file(str(d / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterExportError(f"{d / WEIGHTS} is not a readable safetensors file ({e})") from None
    parts: Dict[Tuple[int, str], dict] = {}
    for name, t in tensors.items():
        m = _PEFT_NAME.match(name)
        if not m or m.group(2) not in MODULES:
            raise AdapterExportError(f"{d}: tensor {name!r} is not a LoRA factor of a module this kit adapts "
                                     f"(model.layers.N.{{{', '.join(MODULES)}}}.lora_A/lora_B)")
        if t.ndim != 2 or not np.isfinite(t).all():
            raise AdapterExportError(f"{d}: tensor {name!r} must be a finite 2-D matrix")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.astype(np.float32)
    if not parts:
        raise AdapterExportError(f"{d / WEIGHTS} holds no LoRA tensors")
    out = PeftLora(d, rank=cfg["r"], alpha=float(cfg["lora_alpha"]), targets=sorted({k[1] for k in parts}))
    for (layer, module), ab in sorted(parts.items()):
        where = f"{d}: model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterExportError(f"{where} has only lora_{''.join(ab)}; a pair needs lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        want = int(_pattern_value(cfg.get("rank_pattern"), f"model.layers.{layer}.{module}", cfg["r"]))
        if a.shape[0] != b.shape[1] or a.shape[0] != want:
            raise AdapterExportError(f"{where}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}, the config "
                                     f"says {want}: wrong rank tensors")
        out.pairs[(layer, module)] = (a, b, _module_scale(cfg, f"model.layers.{layer}.{module}", want))
    return out


def read_base(path) -> BaseModel:
    """The base GGUF the adapter will be served with (any file type: only headers are read)."""
    p = Path(path)
    if p.suffix != ".gguf":
        raise AdapterExportError(f"--base must be the base model's GGUF file (write one with `edge-export "
                                 f"gguf`), got {path}")
    arch, shapes = base_shapes(p)
    r = open_gguf(p)              # the stock reader takes seconds on a real vocabulary
    heads = r.fields.get(f"{arch}.attention.head_count")
    kv = r.fields.get(f"{arch}.attention.head_count_kv")
    if heads is None:
        raise AdapterExportError(f"{p} has no {arch}.attention.head_count: not a base model GGUF")
    n_head = int(heads.contents())
    return BaseModel(p, arch, n_head, int(kv.contents()) if kv is not None else n_head, shapes)


def _permute_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """export.gguf.permute_qk on B's rows: HF rotate-half -> llama.cpp interleaved RoPE order."""
    out, r = b.shape
    return b.reshape(n_head, 2, out // n_head // 2, r).swapaxes(1, 2).reshape(out, r)


def gguf_pairs(lora: PeftLora, base: BaseModel) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{base tensor name: (A, B)} as llama.cpp wants them: B permuted for llama q/k, scale folded."""
    out = {}
    for (layer, module), (a, b, scale) in lora.pairs.items():
        rank = a.shape[0]
        llama_scale = lora.alpha / rank          # what llama.cpp will multiply by
        if scale != llama_scale:
            b = b * np.float32(scale / llama_scale)
        if base.arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            b = _permute_rows(b, base.n_head if module == "self_attn.q_proj" else base.n_head_kv)
        out[f"blk.{layer}.{MODULES[module]}.weight"] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return out


def write_gguf_lora(lora: PeftLora, base: BaseModel, out, ftype: str = "F32", task: Optional[str] = None,
                    name: Optional[str] = None) -> Path:
    """Write `lora` as a GGUF LoRA for `base` (checked against its shapes first)."""
    if ftype not in FILE_TYPES:
        raise AdapterExportError(f"adapter file type must be one of {', '.join(FILE_TYPES)}, got {ftype!r}")
    pairs = gguf_pairs(lora, base)
    ne = {n: ((a.shape[1], a.shape[0]), (b.shape[1], b.shape[0])) for n, (a, b) in pairs.items()}
    check_pairs_fit(ne, base.arch, base.arch, base.shapes, f"adapter {lora.directory}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), base.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora.alpha))
    w.add_name(name or lora.directory.name)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if ftype == "F32" else gguf.LlamaFileType.MOSTLY_F16))
    if task:
        w.add_string(TASK_KEY, task)
    dtype = np.float32 if ftype == "F32" else np.float16
    for tensor, (a, b) in pairs.items():
        w.add_tensor(tensor + ".lora_a", a.astype(dtype))
        w.add_tensor(tensor + ".lora_b", b.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # never a half-written adapter under the final name
    return out


def export_adapter(adapter_dir, base, out, ftype: str = "F32", task: Optional[str] = None,
                   log: Callable[[str], None] = print) -> Path:
    """`edge-export adapter`: read, check against the base, write; progress lines through `log`."""
    lora = read_peft_lora(adapter_dir)
    log(f"read {adapter_dir}: rank {lora.rank}, alpha {lora.alpha:g}, {len(lora.pairs)} modules "
        f"({', '.join(m.split('.')[-1] for m in lora.targets)})")
    b = read_base(base)
    log(f"base {b.path}: {b.arch}, {b.n_head}/{b.n_head_kv} heads")
    path = write_gguf_lora(lora, b, out, ftype=ftype, task=task)
    log(f"wrote {path} ({ftype}, {path.stat().st_size / 2**20:.2f} MiB)")
    return path
