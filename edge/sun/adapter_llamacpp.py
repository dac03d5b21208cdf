"""The llama.cpp side of AdapterPrefillWorker: one GGUF base, many GGUF LoRA adapters (no torch).

llama.cpp applies one adapter set to a whole `llama_decode` call, so the rows of one step cannot
share a call across tasks: `prefill_rows` groups them by task, switches the context's adapter
once per group (edge/engines/llamacpp_lora.py: a switch rebuilds the compute graph at the next
decode) and prefills each row of the group into its own sequence. Cost over full-copy workers:
no extra weights beyond the adapters, one switch per distinct task in a step; rows do not share a
decode call, so a step costs what those prefills cost one after the other. The KV is exported
from the sequence as the engine always does, for the shared decoder's fingerprint (the base is
the bundle's decoder artifact itself), and the sequence freed.

Memory (colocated, `decode_batch`): llama.cpp sizes a context's graph scheduler by every adapter
loaded on the model, whichever it applies; the decode context, which applies none, is made before
the adapters load, so it does not carry ~0.5 MiB per adapter, and with a batch of `decode_batch`
rows (it only ever steps one token a row) its compute buffer holds decode_batch rows of logits, not
512. A step that switched adapters gives the scheduler arrays the switch freed back to the OS.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge.engines.free_heap import give_back_free_heap
from edge.engines.llamacpp_lora import AdapterError, LlamaCppAdapters
from edge.engines.lora_bundle import adapter_file, check_adapters


class LlamaCppAdapterBackend:
    """engine: a LlamaCppEngine of the base (the shared decoder's artifact, its fingerprint set)."""

    def __init__(self, engine, decode_batch: Optional[int] = None):
        self.engine = engine
        self.fingerprint = engine.fingerprint
        self.max_len = int(engine.max_len)
        self._decoder = self._decode_context(decode_batch) if decode_batch else None   # before any adapter
        self.adapters = LlamaCppAdapters(engine)

    @classmethod
    def from_bundle(cls, bundle, threads: Optional[int] = None, decode_batch: Optional[int] = None,
                    **engine_kw) -> "LlamaCppAdapterBackend":
        """The bundle's decoder artifact as the base (the adapters name it as theirs); decode_batch:
        make the decode context of that many rows now (colocated: before the adapters load)."""
        from edge.engines.loader import load_engine
        from edge.model.sun_error import SunError
        if not (Path(bundle) / "manifest.json").is_file():
            raise SunError(f"{bundle}: llama.cpp serves adapters from a bundle: `edge-export bundle DECODER_DIR OUT "
                           "--gguf F32`, then `edge-export adapter DIR OUT --bundle --task T` per task")
        return cls(load_engine(bundle, backend="llamacpp", role="decoder", threads=threads, **engine_kw), decode_batch)

    @property
    def tasks(self) -> List[str]:
        return self.adapters.names

    def decode_engine(self, max_batch: int = 64):
        """The decode context on the SAME model (edge/sun/colocated.py): a second llama.cpp context,
        its own KV, no adapter ever set on it; the weights stay in memory once. The one made at
        construction (decode_batch) when it has max_batch rows."""
        if self._decoder is not None and self._decoder.n_seq_max == max_batch:
            engine, self._decoder = self._decoder, None
            return engine
        return self._decode_context(max_batch)

    def _decode_context(self, max_batch: int):
        from edge.sun.llamacpp_sibling import SiblingContext
        # n_batch = max_batch rows: a step is one token a row; llama.cpp reserves logits for n_batch rows
        return SiblingContext(self.engine, n_seq_max=max_batch, n_batch=max_batch)

    def add(self, task: str, path, sha256: Optional[str] = None, bundle: bool = False) -> None:
        """Load a GGUF LoRA file (sha256: of that file), or a bundle's entry for `task` (sha256: the
        entry's GGUF as its manifest lists it; every file of the entry checked against the manifest)."""
        if task in self.tasks:
            raise AdapterError(f"task {task!r} is served here already; a new version needs a new task name")
        if bundle:
            entry = check_adapters(path, deep=True, tasks=[task])[0]
            listed = entry["files"][0]["sha256"]
            if sha256 is not None and sha256 != listed:
                raise AdapterError(f"sha256 mismatch: the bundle's adapter {task!r} is {listed[:12]}…, the "
                                   f"request names {sha256[:12]}…; send the digest its manifest lists")
            base_fp = getattr(self.engine, "model_fingerprint", None)
            if base_fp and entry.get("base_fingerprint") and entry["base_fingerprint"] != base_fp:
                raise AdapterError(f"adapter {task!r} was made for base {entry['base_fingerprint'][:12]}, "
                                   f"this worker runs {base_fp[:12]}")
            path = adapter_file(path, entry)
        elif sha256 is not None:
            have = file_sha256(path)
            if have != sha256:
                raise AdapterError(f"sha256 mismatch: {path} is {have[:12]}…, the request names {sha256[:12]}…; "
                                   "the file was changed or is not the one meant")
        self.adapters.load(task, path)

    def prefill_rows(self, prompts: Sequence[Sequence[int]], tasks: Sequence[str]
                     ) -> List[Tuple[np.ndarray, Callable[[str, dict], bytes]]]:
        """Per row (first-token logits, export(dtype, meta) -> KV blob); rows grouped by task, the
        adapter active first going first (one switch fewer)."""
        order: Dict[str, List[int]] = {}
        for i, t in enumerate(tasks):
            order.setdefault(t, []).append(i)
        out: List[Optional[tuple]] = [None] * len(prompts)
        switches = self.adapters.switches
        try:
            for task in sorted(order, key=lambda t: t != self.adapters.active):
                for i in order[task]:
                    seq = self.engine.new_sequence()
                    try:
                        logits = self.adapters.prefill(seq, prompts[i], task)[-1]
                    except Exception:
                        self.engine.free(seq)
                        raise
                    out[i] = (np.asarray(logits), self._exporter(seq))
        except Exception:
            for row in out:                               # free what was prefilled before the fault
                if row is not None:
                    row[1].free()
            raise
        finally:
            if self.adapters.switches != switches:
                give_back_free_heap()       # the scheduler arrays the switch freed (module docstring)
        return out

    def _exporter(self, seq: int):
        engine = self.engine

        class Export:
            def __call__(self, dtype: str, meta: dict) -> bytes:
                try:
                    return engine.export_kv(seq, dtype=dtype, meta=meta)
                finally:
                    engine.free(seq)

            def free(self) -> None:
                engine.free(seq)
        return Export()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(Path(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

