"""The onnxruntime engine: graphs written by export/onnx.py behind the Engine interface.

KV caches live on the host as numpy arrays, one [kv_heads, S, head_dim] array
per layer and k/v, of which the first `length` entries are valid. After a call
the sequence simply keeps the graph's `present` outputs (row b of a batch is a
contiguous view), so a batch-1 decode step feeds its cache back without a copy;
a ragged batch is right-padded to its longest sequence, exactly as
edge/model/transformer.py does. Inputs and outputs go through IO binding.

torch is never imported: KV blobs (edge/model/kv_blob.py's format, so a KV cache moves between the
torch and ORT engines) are written and read with numpy.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError

# metadata keys export/onnx.py writes into every graph (defined with their reader)
from edge.model.onnx_metadata import META_CONFIG, META_EXTRA, META_FINGERPRINT, META_GRAPH, META_QUANT  # noqa: F401

_PREFERENCE = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def choose_providers(device: str = "auto") -> List[str]:
    """onnxruntime providers for a device: auto (CUDA if present, else CPU), cpu, cuda, tensorrt."""
    import onnxruntime as ort
    have = set(ort.get_available_providers())
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "auto":
        return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in have]
    want = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}.get(device)
    if want is None:
        raise EngineError(f"unknown device {device!r}; use auto, cpu, cuda or tensorrt")
    if want not in have:
        raise EngineError(f"onnxruntime here has no {want} (available: {', '.join(sorted(have))}); "
                          "install onnxruntime-gpu (Jetson: the JetPack wheel) or use device='cpu'")
    return _PREFERENCE[_PREFERENCE.index(want):]


@dataclass
class _Seq:
    kv: List[np.ndarray] = field(default_factory=list)  # 2*layers arrays [kv_heads, S >= length, hd]
    length: int = 0
    tokens: List[int] = field(default_factory=list)


class OnnxEngine(Engine):
    name = "onnx"

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: Optional[int] = None,
                 fingerprint: Optional[str] = None, max_len: Optional[int] = None,
                 providers: Optional[List[str]] = None, spin: bool = True):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        if not spin:  # on shared CPUs busy-waiting threads steal time from other roles
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), so, providers=providers or choose_providers(device))
        except Exception as e:  # protobuf / missing-data errors are long and cryptic
            raise EngineError(f"onnxruntime cannot load {path}: {str(e).splitlines()[0][:300]}") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if META_CONFIG not in meta:
            raise EngineError(f"{path} was not written by edge-export onnx (no {META_CONFIG} metadata)")
        self.path = str(path)
        # edge.model.transformer.ModelConfig's fields, read without importing torch (devices may lack it)
        self.cfg = SimpleNamespace(**json.loads(meta[META_CONFIG]))
        self.graph = meta.get(META_GRAPH, "model")
        self.quant = meta.get(META_QUANT, "fp32")
        self.extra = json.loads(meta.get(META_EXTRA, "{}"))
        self.fingerprint = meta.get(META_FINGERPRINT, "") if fingerprint is None else fingerprint
        self.vocab_size = self.cfg.vocab_size
        self.max_len = int(max_len or self.cfg.max_position)
        self.providers = self.session.get_providers()
        self._in = [i.name for i in self.session.get_inputs()]
        self._out = [o.name for o in self.session.get_outputs()]
        self._past_names = [n for n in self._in if n.startswith("past_key_values.")]
        # the prefill graph returns only the last position's logits
        self.last_logits_only = self.graph == "prefill"
        self._seqs: Dict[int, _Seq] = {}
        self._ids = itertools.count(1)

    def where(self) -> str:
        return "onnxruntime providers " + ", ".join(self.providers)

    # -- sequences ---------------------------------------------------------------
    def _get(self, seq: int) -> _Seq:
        return self._known(self._seqs, seq)

    def new_sequence(self) -> int:
        sid = next(self._ids)
        self._seqs[sid] = _Seq()
        return sid

    def free(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def tokens(self, seq: int) -> list:
        return list(self._get(seq).tokens)

    def truncate(self, seq: int, n: int) -> None:
        s = self._get(seq)
        if not 0 <= n <= s.length:
            raise EngineError(f"cannot truncate to {n}: the sequence holds {s.length} tokens")
        s.length = n  # entries past n are ignored and overwritten by the next call
        del s.tokens[n:]

    @property
    def active_sequences(self) -> int:
        return len(self._seqs)

    def kv_bytes(self) -> int:
        return sum(a.nbytes for s in self._seqs.values() for a in s.kv)

    # -- running the graph -------------------------------------------------------
    def _check_ids(self, tokens):
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _run(self, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
        io = self.session.io_binding()
        for name in self._in:
            io.bind_cpu_input(name, feeds[name])
        for name in self._out:
            io.bind_output(name)
        self.session.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()

    def _empty_past(self, B: int) -> np.ndarray:
        c = self.cfg
        return np.zeros((B, c.num_kv_heads, 0, c.head_dim), dtype=np.float32)

    def forward(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        s = self._get(seq)
        tokens = [int(t) for t in tokens]
        if not tokens:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        self._check_ids(tokens)
        self.check_room(seq, len(tokens))
        T, L = len(tokens), s.length
        ids = np.asarray([tokens], dtype=np.int64)
        if self.graph == "prefill":
            if L:
                raise EngineError("this is a prefill-only graph: it starts sequences but cannot extend "
                                  "one; load the 'model' or 'decoder' graph to continue a sequence")
            out = self._run({"input_ids": ids, "attention_mask": np.ones((1, T), dtype=np.int64)})
            # rows before the last are not computed by this graph: NaN, so misuse shows
            logits = np.full((T, self.vocab_size), np.nan, dtype=np.float32)
            logits[-1] = out[0][0, 0]
        else:
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, L + T), dtype=np.int64),
                     "position_ids": np.arange(L, L + T, dtype=np.int64)[None]}
            for name, a in zip(self._past_names, s.kv or [None] * len(self._past_names)):
                feeds[name] = self._empty_past(1) if a is None else (
                    a[None] if a.shape[1] == L else np.ascontiguousarray(a[None, :, :L]))
            out = self._run(feeds)
            logits = out[0][0]
        s.kv = [p[0] for p in out[1:]]
        s.length = L + T
        s.tokens.extend(tokens)
        return logits

    def step(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if not self._check_step(seqs, tokens):
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        if self.graph == "prefill":
            raise EngineError("a prefill-only graph cannot step sequences; load the 'model' or 'decoder' graph")
        ss = [self._get(q) for q in seqs]
        tokens = [int(t) for t in tokens]
        self._check_ids(tokens)
        for q in seqs:
            self.check_room(q, 1)
        if len(ss) == 1:
            return self.forward(seqs[0], tokens)
        B = len(ss)
        lens = np.array([s.length for s in ss], dtype=np.int64)
        P = int(lens.max())
        c = self.cfg
        mask = np.zeros((B, P + 1), dtype=np.int64)
        mask[:, P] = 1
        mask[:, :P] = np.arange(P)[None, :] < lens[:, None]
        feeds = {"input_ids": np.asarray(tokens, dtype=np.int64)[:, None], "attention_mask": mask,
                 "position_ids": lens[:, None].copy()}
        for j, name in enumerate(self._past_names):
            buf = np.zeros((B, c.num_kv_heads, P, c.head_dim), dtype=np.float32)
            for b, s in enumerate(ss):
                if s.length:
                    buf[b, :, : s.length] = s.kv[j][:, : s.length]
            feeds[name] = buf
        out = self._run(feeds)
        for b, (s, tok) in enumerate(zip(ss, tokens)):
            if s.length == P:   # the longest rows keep a view of the batch output
                s.kv = [p[b] for p in out[1:]]
            else:               # shorter rows: drop the padding between their past and the new entry
                s.kv = [np.concatenate((p[b, :, : s.length], p[b, :, P:]), axis=1) for p in out[1:]]
            s.length += 1
            s.tokens.append(tok)
        return out[0][:, 0]

    # -- KV transfer (edge/model/kv.py's blob format) -----------------------------------
    def export_kv(self, seq: int, dtype: str = "float16", meta: Optional[dict] = None) -> bytes:
        s = self._get(seq)
        c = self.cfg
        data = np.stack([np.stack((s.kv[2 * i][:, : s.length], s.kv[2 * i + 1][:, : s.length]))
                         for i in range(c.num_layers)])
        return self._blob(data, s.tokens[: s.length], dtype, meta)

    def import_kv(self, blob: bytes) -> int:
        c = self.cfg
        data, head = self._read_kv_array(blob)
        sid = next(self._ids)
        self._seqs[sid] = _Seq(kv=[np.ascontiguousarray(data[i, j]) for i in range(c.num_layers) for j in (0, 1)],
                               length=head["length"], tokens=list(head.get("tokens") or []))
        return sid
