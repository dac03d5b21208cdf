"""Export our transformer as ONNX graphs that onnxruntime runs (fp32 or int4 MatMulNBits).

Three graphs, all from edge/model/transformer.py's modules via `torch.onnx.export(dynamo=True)`:

* ``model``   - tokens + past KV -> logits of every new token + present KV
                (draft and target roles; a target verifies gamma tokens in one call);
* ``prefill`` - tokens -> logits of the last real token + present KV (SUN prefill module);
* ``decoder`` - the ``model`` graph exported from the shared decoder's weights
                (SUN decode module; usually ``int4``).

Names follow optimum / onnxruntime-genai: ``input_ids``, ``attention_mask``,
``position_ids``, ``past_key_values.{i}.key|value``, ``logits``,
``present.{i}.key|value``; axes ``batch_size``, ``sequence_length``,
``past_sequence_length``, ``total_sequence_length`` are dynamic.

Ragged batches use right padding, as edge/model/transformer.py does: ``attention_mask``
[B, P+T] marks valid keys (row b: its first L_b past entries and its T new
ones), ``position_ids`` [B, T] are L_b .. L_b+T-1. ``int4`` rewrites the
projections chosen by export/quant.py as com.microsoft MatMulNBits nodes that
carry exactly quant.py's codes and scales (the QSUN grid).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx
import torch

from edge.engines.onnx_engine import META_CONFIG, META_EXTRA, META_FINGERPRINT, META_GRAPH, META_QUANT
from edge.model.transformer import Transformer
from export.onnx_graph import (OnnxExportError, optimize_graph, replicate, rewrite_linears,
                               trace, input_names, output_names)
from export.quant import is_quantised_linear, quantize_q4, to_matmulnbits

GRAPH_KINDS = ("model", "prefill", "decoder")
QUANT_INT4 = "int4-q4_0-g32"   # names the grid: llama.cpp Q4_0, groups of 32 (export/quant.py)
EXTERNAL_DATA_BYTES = 1 << 30   # above this, weights go to a side file (protobuf stops at 2 GB)

__all__ = ["export_onnx", "export_all", "artifact_files", "int4_names", "input_names",
           "output_names", "OnnxExportError", "GRAPH_KINDS", "QUANT_INT4"]


def _fix_axis_names(proto: onnx.ModelProto, kind: str) -> None:
    """Give the mask's free symbol and the present length their conventional names."""
    total = "sequence_length" if kind == "prefill" else "total_sequence_length"
    for vi in list(proto.graph.input) + list(proto.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.name == "attention_mask":
            dims[1].dim_param = total
        elif vi.name.startswith("present."):
            dims[2].dim_param = total
        elif vi.name == "logits" and kind == "prefill":
            dims[1].ClearField("dim_param")
            dims[1].dim_value = 1


def int4_names(model: Transformer, lm_head: bool = False) -> List[str]:
    """State-dict names the int4 export quantises: quant.py's choice, plus lm_head if asked.

    For a tied model "lm_head.weight" means an untied int4 copy of the embedding
    (the embedding itself stays float for its lookup).
    """
    names = [n for n in model.state_dict() if is_quantised_linear(n)]
    if lm_head:
        names.append("lm_head.weight")
    return names


def _weight_arrays(model: Transformer, sd: dict, src: str, forms: Sequence[str]) -> Dict[str, np.ndarray]:
    """Data for initializers "m.<src>[::form]": form "" (as is), "T" (transposed), "q4*" (int4 parts)."""
    if src == "inv_freq":
        return {"": model.inv_freq.detach().float().numpy()}
    w = (model.output_weight() if src == "lm_head.weight" else sd[src]).detach().float()
    out = {}
    if "" in forms:
        out[""] = w.numpy()
    if "T" in forms:
        out["T"] = w.T.contiguous().numpy()
    if any(f.startswith("q4") for f in forms):
        b, scales, zp = to_matmulnbits(quantize_q4(w))
        out.update({"q4": b, "q4_scales": scales, "q4_zp": zp})
    return out


def _fill_weights(proto: onnx.ModelProto, model: Transformer, data_path: Optional[Path]) -> None:
    """Write every model weight into its initializer: inline, or appended to data_path."""
    sd = model.state_dict()
    by_src: Dict[str, list] = {}
    for t in proto.graph.initializer:
        if t.name.startswith("m."):
            src, _, form = t.name[2:].partition("::")
            by_src.setdefault(src, []).append((form, t))
    f = open(data_path, "wb") if data_path else None
    try:
        for src, items in by_src.items():  # one weight at a time: quantised once, freed after
            arrays = _weight_arrays(model, sd, src, [form for form, _ in items])
            for form, t in items:
                arr = arrays[form]
                if tuple(arr.shape) != tuple(t.dims):
                    raise OnnxExportError(f"weight {t.name}: shape {arr.shape} does not fit the graph's "
                                          f"{tuple(t.dims)}")
                t.ClearField("raw_data")
                t.ClearField("float_data")
                raw = np.ascontiguousarray(arr).tobytes()
                if f is None or len(raw) < 1024:
                    t.raw_data = raw
                    continue
                f.seek((f.tell() + 4095) // 4096 * 4096)  # page-aligned, so ORT can map it
                off = f.tell()
                f.write(raw)
                t.data_location = onnx.TensorProto.EXTERNAL
                del t.external_data[:]
                for k, v in (("location", data_path.name), ("offset", str(off)), ("length", str(len(raw)))):
                    t.external_data.append(onnx.StringStringEntryProto(key=k, value=v))
    finally:
        if f:
            f.close()


def export_onnx(model: Transformer, path: str | os.PathLike, kind: str = "model", int4: bool = False,
                int4_lm_head: bool = False, fingerprint: str = "", accuracy_level: int = 0,
                external_data: Optional[bool] = None, extra: Optional[dict] = None) -> Path:
    """Write one graph of `model` to `path` (an .onnx file; weights may go to `path`.data).

    int4: the projections of export/quant.py (plus lm_head with int4_lm_head) as
    MatMulNBits on quant.py's grid. accuracy_level 0 computes in float from the
    exact int4 weights (what QSUN trained against); 4 lets ORT quantise the
    activations to int8 as well: faster on CPUs, no longer bit-faithful.
    external_data: None = only when the weights exceed 1 GiB.
    fingerprint: stored in the graph's metadata; engines stamp KV blobs with it.
    """
    if kind not in GRAPH_KINDS:
        raise OnnxExportError(f"unknown graph {kind!r}; choose one of {', '.join(GRAPH_KINDS)}")
    if int4_lm_head and not int4:
        raise OnnxExportError("int4_lm_head needs int4")
    model = model.eval()
    if next(model.parameters()).dtype != torch.float32:
        raise OnnxExportError("export a float32 model (call .float()); int4 is chosen with int4=True")
    c = model.cfg
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    proto = trace(model, kind)
    names = int4_names(model, int4_lm_head) if int4 else []
    layer0 = {n for n in names if n.startswith("model.layers.0.")} | {n for n in names if not n.startswith("model.layers.")}
    rewrite_linears(proto, sorted(layer0), accuracy_level)
    replicate(proto, c.num_layers)
    proto = optimize_graph(proto)
    _fix_axis_names(proto, kind)
    quant = QUANT_INT4 if int4 else "fp32"
    n_q4 = sum(1 for t in proto.graph.initializer if t.name.endswith("::q4"))
    if n_q4 != len(names):
        raise OnnxExportError(f"int4: {len(names)} weights chosen but {n_q4} found as MatMul inputs in the graph")
    meta = {META_GRAPH: kind, META_CONFIG: c.to_json(), META_FINGERPRINT: fingerprint, META_QUANT: quant,
            META_EXTRA: json.dumps({"int4_weights": n_q4, "int4_lm_head": bool(int4_lm_head),
                                    "accuracy_level": accuracy_level, **(extra or {})}, sort_keys=True)}
    del proto.metadata_props[:]
    for k, v in meta.items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=k, value=v))
    size = sum(p.numel() * 4 for p in model.parameters())
    if external_data is None:
        external_data = size > EXTERNAL_DATA_BYTES
    data_path = path.parent / (path.name + ".data")
    if data_path.exists():
        data_path.unlink()
    _fill_weights(proto, model, data_path if external_data else None)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    return path


def artifact_files(path: str | os.PathLike) -> List[Path]:
    """The .onnx file and the external-data files it names (what a bundle must carry)."""
    path = Path(path)
    proto = onnx.load_model(str(path), load_external_data=False)
    locs = set()
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                locs.add(e.value)
    return [path] + [path.parent / loc for loc in sorted(locs)]


def export_all(model: Transformer, out_dir: str | os.PathLike, kinds: Sequence[str] = ("model",),
               **kw) -> Dict[str, Path]:
    """Several graphs of one model into out_dir as {kind}[.int4].onnx."""
    out_dir = Path(out_dir)
    tag = ".int4" if kw.get("int4") else ""
    return {k: export_onnx(model, out_dir / f"{k}{tag}.onnx", kind=k, **kw) for k in kinds}
