"""Tracing for export/onnx.py: one traced layer, stamped out, linears rewritten, cleaned up.

Tracing with `torch.onnx.export(dynamo=True)` costs seconds per layer, so we
trace a ONE-layer copy of the model (same config, same tensors) and stamp its
layer out num_layers times: the exporter tags every node with the module it
came from (name scopes), which tells the layer's nodes apart from the
prologue (embedding, RoPE, mask) and the epilogue (final norm, lm_head).
Weights are dataless placeholders named after their source
("m.<state-dict name>[::T|::q4|::q4_scales|::q4_zp]"); export/onnx.py writes
them. Traces and optimised graphs are kept in memory and on disk, keyed by their
input, this code and the tool versions (export/onnx_cache.py).
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import replace
from typing import Dict, List, Sequence

import onnx
import torch
import torch.nn.functional as F
from onnx import helper
from torch import nn

from edge.model.transformer import Transformer
from export.onnx_cache import cached_graph, graph_name
from export.quant import GROUP


class OnnxExportError(ValueError):
    """The model cannot be exported as asked."""


def input_names(kind: str, layers: int) -> List[str]:
    if kind == "prefill":
        return ["input_ids", "attention_mask"]
    return ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def output_names(layers: int) -> List[str]:
    return ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


class _Graph(nn.Module):
    """The traced forward: edge/model/transformer.py's blocks with the mask built from attention_mask."""

    def __init__(self, model: Transformer, kind: str):
        super().__init__()
        self.m = model
        self.kind = kind

    def forward(self, input_ids, attention_mask, position_ids=None, past=None):
        m, B, T = self.m, input_ids.shape[0], input_ids.shape[1]
        if position_ids is None:  # prefill starts every row at position 0
            position_ids = torch.arange(T, device=input_ids.device)[None, :].expand(B, T)
        P = 0 if past is None else past[0][0].shape[2]
        x = m.model.embed_tokens(input_ids)
        ang = position_ids[..., None].to(torch.float32) * m.inv_freq
        ang = torch.cat((ang, ang), dim=-1)[:, None]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        # past entry j sits at position j; a key is visible if valid and not in the future
        kpos = position_ids
        if past is not None:
            kpos = torch.cat((torch.arange(P, device=input_ids.device)[None, :].expand(B, P), position_ids), 1)
        mask = attention_mask.bool()[:, None, :] & (kpos[:, None, :] <= position_ids[:, :, None])
        mask = mask[:, None]
        present = []
        for i, layer in enumerate(m.model.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[i])
            present.append(kv)
        h = m.model.norm(x)
        if self.kind == "prefill":  # the last real token of each right-padded row
            last = attention_mask.sum(-1) - 1
            h = h.gather(1, last[:, None, None].expand(B, 1, h.shape[-1]))
        return F.linear(h, m.output_weight()), present


def _sample(model: Transformer, kind: str):
    """Sample inputs: batch 2, distinct sizes, so no axis gets specialised to a constant."""
    c = model.cfg
    B, T, P = 2, 3, 5
    dt = next(model.parameters()).dtype
    ids = torch.randint(0, c.vocab_size, (B, T))
    if kind == "prefill":
        return (ids, torch.ones(B, T, dtype=torch.long))
    pos = torch.arange(P, P + T)[None].expand(B, T).contiguous()
    past = [(torch.randn(B, c.num_kv_heads, P, c.head_dim, dtype=dt),
             torch.randn(B, c.num_kv_heads, P, c.head_dim, dtype=dt)) for _ in range(c.num_layers)]
    return (ids, torch.ones(B, P + T, dtype=torch.long), pos, past)


def _dynamic_shapes(kind: str, layers: int):
    D = torch.export.Dim
    batch, seq = D("batch_size"), D("sequence_length")
    if kind == "prefill":
        return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    past = D("past_sequence_length")
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: D.DYNAMIC},
            "position_ids": {0: batch, 1: seq},
            "past": [({0: batch, 2: past}, {0: batch, 2: past}) for _ in range(layers)]}


_SCOPE = "pkg.torch.onnx.name_scopes"
_LAYER0 = "m.model.layers.0."


def _structure_key(cfg, kind: str) -> tuple:
    d = json.loads(cfg.to_json())
    for k in ("extra", "num_layers", "max_position"):
        d.pop(k, None)
    return (json.dumps(d, sort_keys=True), kind)


def _one_layer(model: Transformer) -> Transformer:
    """A 1-layer Transformer that shares model's tensors (no copy, no random init)."""
    cfg1 = replace(model.cfg, num_layers=1)
    with torch.device("meta"):
        m1 = Transformer(cfg1)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    m1.load_state_dict(sd, strict=True, assign=True)
    m1.register_buffer("inv_freq", model.inv_freq.detach().clone(), persistent=False)
    return m1.eval()


def trace(model: Transformer, kind: str) -> onnx.ModelProto:
    """The traced 1-layer graph of `model`'s structure, weights stripped (kept: export/onnx_cache.py)."""
    import edge.model.transformer
    kind = "model" if kind == "decoder" else kind  # the same graph, other weights
    key = _structure_key(model.cfg, kind)
    # this file holds the traced forward, transformer.py the layers
    name = graph_name(kind, json.dumps(key).encode(), (__file__, edge.model.transformer.__file__))
    proto = onnx.ModelProto()
    proto.ParseFromString(cached_graph(name, lambda: _trace(model, kind)))
    return proto


def _trace(model: Transformer, kind: str) -> tuple:
    m1 = _one_layer(model)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        for lg in ("torch.onnx", "torch.export", "torch._export", "onnxscript"):
            logging.getLogger(lg).setLevel(logging.ERROR)
        prog = torch.onnx.export(_Graph(m1, kind).eval(), _sample(m1, kind), dynamo=True, verbose=False,
                                 dynamic_shapes=_dynamic_shapes(kind, 1), input_names=input_names(kind, 1),
                                 output_names=output_names(1), optimize=False, report=False)
    proto = prog.model_proto
    for t in proto.graph.initializer:  # weights come back by name at write time
        if t.name.startswith("m."):
            t.ClearField("raw_data")
    return proto.SerializeToString(), True


def _placeholder(name: str, dims, dtype) -> onnx.TensorProto:
    """A weight initializer without data; _fill_weights writes it (its name says from what)."""
    t = onnx.TensorProto(name=name, data_type=dtype)
    t.dims.extend(int(d) for d in dims)
    return t


def rewrite_linears(proto: onnx.ModelProto, q4: Sequence[str], accuracy_level: int) -> int:
    """Transpose(W) -> MatMul becomes MatMul(W^T) (fp) or MatMulNBits(quant.py's codes) (int4).

    The exporter writes each nn.Linear as MatMul(x, Transpose(W)) with W an
    initializer "m.<state-dict name>". The replacements are placeholders named
    "m.<name>::T" (transposed copy) or "m.<name>::q4|q4_scales|q4_zp"; a tied
    model's lm_head becomes an untied "m.lm_head.weight::..." (ORT would make
    the transposed copy at load anyway). Returns the number of int4 weights.
    """
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    users: Dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    q4 = set(q4)
    replaced, new_inits, dropped, n_q4 = {}, [], set(), 0
    for n in g.node:
        if n.op_type != "Transpose" or not n.input[0].startswith("m.") or n.input[0] not in inits:
            continue
        us = users.get(n.output[0], [])
        if not us or any(u.op_type != "MatMul" or u.input[1] != n.output[0] for u in us):
            continue
        src = n.input[0][2:]
        key = "lm_head.weight" if src == "model.embed_tokens.weight" else src
        N, K = inits[n.input[0]].dims
        base = "m." + key
        replaced[id(n)] = []
        if src != "model.embed_tokens.weight":
            dropped.add(n.input[0])
        if key in q4:
            if K % GROUP:
                raise OnnxExportError(f"int4: {key} has in={K}, not a multiple of {GROUP}")
            nb = K // GROUP
            new_inits += [_placeholder(base + "::q4", (N, nb, GROUP // 2), onnx.TensorProto.UINT8),
                          _placeholder(base + "::q4_scales", (N * nb,), onnx.TensorProto.FLOAT),
                          _placeholder(base + "::q4_zp", (N * ((nb + 1) // 2),), onnx.TensorProto.UINT8)]
            for u in us:
                replaced[id(u)] = [helper.make_node(
                    "MatMulNBits", [u.input[0], base + "::q4", base + "::q4_scales", base + "::q4_zp"],
                    list(u.output), domain="com.microsoft", name=(u.name or base) + "_q4",
                    K=K, N=N, bits=4, block_size=GROUP, accuracy_level=accuracy_level)]
                for e in u.metadata_props:
                    replaced[id(u)][0].metadata_props.append(e)
            n_q4 += 1
        else:
            new_inits.append(_placeholder(base + "::T", (K, N), onnx.TensorProto.FLOAT))
            for u in us:
                u.input[1] = base + "::T"
    nodes = [m for n in g.node for m in replaced.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    keep = [t for t in g.initializer if t.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(keep + new_inits)
    if n_q4 and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return n_q4


def _in_layer0(n: onnx.NodeProto) -> bool:
    for e in n.metadata_props:
        if e.key == _SCOPE:
            return "'m.model.layers.0'" in e.value
    return False


def replicate(proto: onnx.ModelProto, layers: int) -> None:
    """Stamp the traced layer 0 out as layers 0..layers-1, chained through the hidden state."""
    g = proto.graph
    # constants are shared, not stamped out: the exporter reuses them beyond the layer (eps, axes)
    pos = next((k for k, n in enumerate(g.node) if _in_layer0(n)), 0)
    consts = [n for n in g.node if _in_layer0(n) and n.op_type == "Constant"]
    for n in consts:
        del n.metadata_props[:]
    body = [n for n in g.node if _in_layer0(n)]
    if not body:
        raise OnnxExportError("cannot find the layer's nodes in the traced graph (the exporter did not "
                              "record module scopes); this torch version is not supported by export/onnx.py")
    inside = {o for n in body for o in n.output}
    graph_out = {o.name for o in g.output}
    rest = [n for n in g.node if not _in_layer0(n)]
    leaving = {i for n in rest for i in n.input if i in inside} | (inside & graph_out)
    hidden_out = [t for t in leaving if not t.startswith("present.")]
    emb = [n.output[0] for n in rest if n.op_type == "Gather" and n.input[0] == "m.model.embed_tokens.weight"]
    entering = {i for n in body for i in n.input if i not in inside}
    if len(hidden_out) != 1 or len(emb) != 1 or emb[0] not in entering:
        raise OnnxExportError("unexpected traced layer structure (one hidden state in and out expected)")
    x_in, x_out = emb[0], hidden_out[0]

    def rename(name: str, i: int, prev_out: str) -> str:
        if name == x_in:
            return prev_out
        if name.startswith(("past_key_values.0.", "present.0.")):
            return name.replace(".0.", f".{i}.", 1)
        if name.startswith(_LAYER0):
            return "m.model.layers." + str(i) + "." + name[len(_LAYER0):]
        if name in inside:
            return f"{name}__l{i}"
        return name  # shared: RoPE tables, mask, shape scalars, small constants

    new_body, prev = list(body), x_out
    for i in range(1, layers):
        for n in body:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = f"{n.name}__l{i}" if n.name else ""
            for k, v in enumerate(n.input):
                c.input[k] = rename(v, i, prev) if v else v
            for k, v in enumerate(n.output):
                c.output[k] = rename(v, i, prev)
            new_body.append(c)
        prev = rename(x_out, i, prev)
    for n in rest:  # the epilogue reads the last layer's output
        for k, v in enumerate(n.input):
            if v == x_out:
                n.input[k] = prev
    cids = {id(n) for n in consts}
    before = [n for n in g.node[:pos] if not _in_layer0(n)] + consts
    after = [n for n in g.node[pos:] if not _in_layer0(n) and id(n) not in cids]
    del g.node[:]
    g.node.extend(before + new_body + after)
    for t in [t for t in g.initializer if t.name.startswith(_LAYER0)]:
        for i in range(1, layers):
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = rename(t.name, i, prev)
            g.initializer.append(c)
    for coll in (g.input, g.output):
        vis = list(coll)
        out = []
        for v in vis:
            out.append(v)
            if v.name.startswith(("past_key_values.0.", "present.0.")) and v.name.endswith(".value"):
                for i in range(1, layers):
                    for kv in ("key", "value"):
                        c = onnx.ValueInfoProto()
                        c.CopyFrom(next(x for x in vis if x.name == v.name[: -len("value")] + kv))
                        c.name = c.name.replace(".0.", f".{i}.", 1)
                        out.append(c)
        del coll[:]
        coll.extend(out)
    del g.value_info[:]  # shapes of intermediate values are re-inferred by the optimizer and ORT
    for n in g.node:
        del n.metadata_props[:]  # stack traces: big and no longer true after replication


def optimize_graph(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's cleanup (constants, casts, dead shape code) without touching weights; the result
    is kept under the input graph's bytes (export/onnx_cache.py: ~15 s for a 30-layer graph)."""
    name = graph_name("optimized", proto.SerializeToString(), (__file__,))
    out = onnx.ModelProto()
    out.ParseFromString(cached_graph(name, lambda: _optimize(proto)))
    return out


def _optimize(proto: onnx.ModelProto) -> tuple:
    """-> (the optimised graph's bytes, whether to keep them: not where the optimizer failed).
    The weights are dataless placeholders here; the optimizer would fold or deduplicate
    equal-looking ones, so they go in as graph inputs and come back out as initializers."""
    g = proto.graph
    weights = {t.name: t for t in g.initializer if t.name.startswith("m.")}
    keep = [t for t in g.initializer if t.name not in weights]
    del g.initializer[:]
    g.initializer.extend(keep)
    n_inputs = len(g.input)
    for t in weights.values():
        g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    optimized = True
    try:
        import onnxscript.optimizer as oso
        proto = oso.optimize(proto, input_size_limit=64, output_size_limit=4096)
    except Exception as e:  # the graph is valid without it; ORT optimises at load as well
        warnings.warn(f"onnxscript optimizer skipped: {e}")
        optimized = False
    g = proto.graph
    real = [i for i in g.input if i.name not in weights]
    used = {i for n in g.node for i in n.input}
    del g.input[:]
    g.input.extend(real)
    if len(real) != n_inputs:
        raise OnnxExportError("the ONNX optimizer changed the graph inputs; cannot export")
    g.initializer.extend(t for name, t in weights.items() if name in used)
    return proto.SerializeToString(), optimized
