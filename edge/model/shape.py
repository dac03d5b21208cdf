"""A model's dimensions and stored weight bytes, read from its files without loading it.

What the memory planner (edge/memory/fit.py) needs of a model: layers, widths,
heads, vocabulary, parameter count and the bytes its weights take as the chosen
backend holds them. Sources: a GGUF (its header), a Hugging Face or SUN module
directory (config.json / the module's manifest + safetensors headers), an .onnx graph
(the config export/onnx.py writes into its metadata), or a bundle (the artifact the
resolved model picked for its role and backend, from the manifest it read once).
Nothing here imports torch. `shape_of` reads a ResolvedModel's (its `shape`).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from edge.model.errors import EngineError


@dataclass(frozen=True)
class ModelShape:
    name: str
    kind: str                 # gguf | hf | sun | onnx | bundle
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int               # weight elements (tied embeddings counted once)
    stored_bytes: int         # the artifact's weight bytes as stored (GGUF blocks, ONNX int4, safetensors)
    quant: str                # e.g. Q4_K_M, int4-q4_0-g32, float32
    max_position: int
    path: str = ""
    tied: bool = True         # the output projection is the embedding (one matrix, read by every step)
    graph: str = "model"      # onnx: model | prefill (returns the last logits only) | decoder

    def kv_elements_per_token(self) -> int:
        """K and V elements of one token of one sequence, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim


def params_from_dims(layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied, qkv_bias) -> int:
    attn = hidden * head_dim * (heads * 2 + kv_heads * 2) + (head_dim * (heads + 2 * kv_heads) if qkv_bias else 0)
    block = attn + 3 * hidden * intermediate + 2 * hidden
    return layers * block + vocab * hidden * (1 if tied else 2) + hidden


def _from_config(name, kind, c: dict, stored: int, quant: str, path) -> ModelShape:
    """ModelConfig JSON (ours: num_layers, ...) or a Hugging Face config.json."""
    hf = "num_hidden_layers" in c
    heads = c["num_attention_heads"] if hf else c["num_heads"]
    kv = (c.get("num_key_value_heads") if hf else c.get("num_kv_heads")) or heads
    hidden = c["hidden_size"]
    hd = c.get("head_dim") or hidden // heads
    layers = c["num_hidden_layers"] if hf else c["num_layers"]
    tied = bool(c.get("tie_word_embeddings", c.get("model_type") != "qwen2") if hf else c.get("tie_embeddings", True))
    bias = (c.get("model_type") == "qwen2" or bool(c.get("attention_bias"))) if hf else bool(c.get("qkv_bias"))
    params = params_from_dims(layers, hidden, c["intermediate_size"], heads, kv, hd, c["vocab_size"], tied, bias)
    return ModelShape(name, kind, layers, hidden, c["intermediate_size"], heads, kv, hd, c["vocab_size"], params,
                      stored, quant, int(c.get("max_position_embeddings" if hf else "max_position", 2048)), str(path),
                      tied)


def _gguf_shape(p: Path, kind: str = "gguf") -> ModelShape:
    from edge.model.gguf_header import GGUFHeaderError, read_gguf_header
    try:
        h = read_gguf_header(p)
    except (GGUFHeaderError, OSError, KeyError, ValueError) as e:
        raise EngineError(f"{p}: cannot read its GGUF header ({e})") from None
    a = h.get("general.architecture")
    heads = h.get(f"{a}.attention.head_count")
    hidden = h.get(f"{a}.embedding_length")
    if not (heads and hidden):
        raise EngineError(f"{p}: GGUF metadata lacks {a}.attention.head_count / embedding_length")
    emb = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
    vocab = h.get(f"{a}.vocab_size") or h.get("tokenizer.ggml.tokens") or (emb.shape[1] if emb else 0)
    file_type = h.get("general.file_type")
    return ModelShape(p.name, kind, int(h.get(f"{a}.block_count")), int(hidden),
                      int(h.get(f"{a}.feed_forward_length")), int(heads),
                      int(h.get(f"{a}.attention.head_count_kv") or heads),
                      int(h.get(f"{a}.attention.key_length") or hidden // heads), int(vocab),
                      sum(t.n_elements for t in h.tensors), sum(t.n_bytes for t in h.tensors),
                      _FILE_TYPES.get(file_type, f"file_type {file_type}"),
                      int(h.get(f"{a}.context_length") or 2048), str(p),
                      tied=not any(t.name == "output.weight" for t in h.tensors))


# llama_ftype names of the common ones (llama.h)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               12: "Q3_K_M", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def safetensors_bytes(files) -> int:
    """Payload bytes of safetensors files, read from their headers (8-byte length + JSON)."""
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")
    return total


def _hf_shape(p: Path) -> ModelShape:
    files = sorted(p.glob("*.safetensors"))
    stored = safetensors_bytes(files)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise EngineError(f"{p} has no config.json or manifest.json: not a model directory")
    c = json.loads(cfg.read_text())
    return _from_config(p.name, "hf", c, stored, str(c.get("torch_dtype", "float32")), p)


def _onnx_shape(p: Path, quant: Optional[str] = None, cfg: Optional[dict] = None, stored: int = 0,
                graph: Optional[str] = None) -> ModelShape:
    if cfg is None:
        from edge.model.onnx_metadata import META_CONFIG, META_GRAPH, META_QUANT, OnnxMetadataError, read_onnx_metadata
        try:
            meta = read_onnx_metadata(p)
        except OnnxMetadataError as e:
            raise EngineError(str(e)) from None
        if META_CONFIG not in meta:
            raise EngineError(f"{p} was not written by edge-export onnx (no {META_CONFIG} metadata)")
        cfg, quant, graph = json.loads(meta[META_CONFIG]), meta.get(META_QUANT, "fp32"), meta.get(META_GRAPH)
    if not stored:
        stored = p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.name + ".data*"))
    return replace(_from_config(p.name, "onnx", cfg, stored, quant or "fp32", p), graph=graph or "model")


def _sun_shape(p: Path, manifest: dict) -> ModelShape:
    """A SUN module (edge-export tune): its manifest's config, its safetensors' bytes."""
    stored = safetensors_bytes(sorted(p.glob("*.safetensors")))
    return _from_config(p.name, "sun", manifest["config"], stored, "float32", p)


def _bundle_shape(d: Path, a: dict) -> ModelShape:
    """The shape of a bundle's artifact (the one picked for the role and backend)."""
    stored = sum(f["bytes"] for f in a["files"])
    main = d / a["files"][0]["path"]
    if a["backend"] == "gguf":
        return _gguf_shape(main, "bundle")
    return _onnx_shape(main, a.get("quant"), a.get("config"), stored, a.get("graph"))


def shape_of(model: "ResolvedModel") -> ModelShape:
    """The shape of a resolved model (read from its files; a bundle's from the manifest it carries)."""
    p = model.path
    if model.format == "bundle":
        if model.artifact is None:
            raise EngineError(f"{p} is a bundle of exported artifacts (onnx / gguf): the torch backend does not "
                              "run it; choose --backend onnx or llamacpp")
        return _bundle_shape(p, model.artifact)
    if model.format == "sun":
        return _sun_shape(p, model.manifest)
    if model.format == "hf":
        return _hf_shape(p)
    if model.format == "onnx":
        return _onnx_shape(p)
    return _gguf_shape(p)
