"""The torch side of AdapterPrefillWorker: one base Transformer, its adapters, rows of any tasks in one call.

`prefill_rows` pads the step's prompts into one [B, T] batch and runs `lora_prefill` once: every
targeted linear computes W x for the whole batch (the base's weights read once) plus, per task
present, B_t (A_t x) over that task's rows (index_select / index_add, as Punica / S-LoRA gather
many LoRAs into one batch). Cost over a single-task batch: two thin matmuls of rank r per
distinct task per linear, and the padding of the shorter prompts to the longest. Each row's KV is
then cut to its own length and written as the same blob a TorchEngine exports, made for the
shared decoder's fingerprint. With an fp decoder the base IS that decoder (adapters never touch its
weights); with an int4 one (QSUN-LoRA: adapters tuned over the fp base against the int4 decoder) the
base is the fp model the decoder was quantised from (`over_base`), held once for every adapter.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from edge.model.kv import SequenceKV
from edge.model.lora.adapter import base_fingerprint
from edge.model.lora.apply import LoraTransformer, lora_prefill
from edge.model.lora.error import AdapterError
from edge.model.lora.files import WEIGHTS_FILE, load_adapter
from edge.model.sun_error import SunError
from edge.model.sun_modules import pad_right
from edge.model.transformer import Transformer


class _BaseInfo:
    """What the worker and the agent's start line read of an engine: vocabulary size, where it runs."""
    name = "torch"

    def __init__(self, base: Transformer):
        self.vocab_size = base.cfg.vocab_size
        self._weight = base.model.embed_tokens.weight

    def where(self) -> str:
        return f"torch device {self._weight.device}, {str(self._weight.dtype).replace('torch.', '')}, base + adapters"


class TorchAdapterBackend:
    """base: the model the adapters were tuned over (frozen, never written); fingerprint: the shared
    decoder's. base_is_decoder: False when the decoder is another model (an int4 one): then no
    decode context can share the base (`decode_engine` refuses)."""

    def __init__(self, base: Transformer, fingerprint: str, threads: Optional[int] = None,
                 base_is_decoder: bool = True):
        self.base, self.fingerprint, self.threads = base.eval(), fingerprint, threads
        self.base_is_decoder = base_is_decoder
        self.view = LoraTransformer.over(self.base)
        self.engine = _BaseInfo(base)
        self.max_len = int(base.cfg.max_position)
        self._base_fp: Optional[str] = None

    @classmethod
    def from_dir(cls, directory, threads: Optional[int] = None, device=None) -> "TorchAdapterBackend":
        """The base from a shared decoder's directory (export.tune.save_decoder), its weights
        checked against its fingerprint, then moved to `device` (None: the CPU)."""
        from edge.model.sun_modules import check_fingerprint, load_module
        model, man = load_module(directory)
        fp = check_fingerprint(model, man)
        return cls(model.to(device) if device else model, fp, threads)

    @classmethod
    def over_base(cls, base_dir, decoder_dir, threads: Optional[int] = None, device=None) -> "TorchAdapterBackend":
        """The fp base in `base_dir` (a saved module) as the prefill base, KV made for the decoder in
        `decoder_dir` (its weights checked against its fingerprint; where its manifest records the
        base it was made from, that must be this base): QSUN-LoRA's pairing, an int4 decoder whose
        adapters were tuned over the fp base."""
        from edge.model.sun_modules import check_fingerprint, load_module
        dec, man = load_module(decoder_dir)
        fp = check_fingerprint(dec, man)
        del dec                                     # only its fingerprint is needed here
        base = load_module(base_dir, dtype=torch.float32)[0]
        be = cls(base.to(device) if device else base, fp, threads, base_is_decoder=False)
        made_from = man.get("base_fingerprint")
        if made_from and made_from != be.base_fp():
            raise SunError(f"{decoder_dir} was made from another base ({made_from[:12]}, {base_dir} is "
                           f"{be.base_fp()[:12]}); give the base it was quantised from")
        return be

    @property
    def tasks(self) -> List[str]:
        return self.view.adapter_names

    def decode_engine(self, max_batch: int = 64):
        """The decode context on the SAME base (edge/sun/colocated.py): a TorchEngine over the base
        object itself (no dtype / device change, so no copy); no adapter reaches it."""
        from edge.engines.torch_engine import TorchEngine
        if not self.base_is_decoder:
                raise SunError("this prefill base is not the shared decoder's weights (an int4 decoder is another "
                           "model): run the decoder as its own worker")
        return TorchEngine(self.base, fingerprint=self.fingerprint, threads=self.threads)

    def base_fp(self) -> str:
        """base_fingerprint() of the base (what an adapter records), computed once."""
        if self._base_fp is None:
            self._base_fp = base_fingerprint(self.base)
        return self._base_fp

    def add(self, task: str, path, sha256: Optional[str] = None, bundle: bool = False) -> None:
        """Load a PEFT adapter directory (sha256: of its adapter_model.safetensors), or the PEFT
        files of a bundle's entry for `task` (sha256: the entry's GGUF, as its manifest records;
        every file of the entry is checked against the manifest)."""
        if task in self.tasks:
            raise AdapterError(f"task {task!r} is served here already; a new version needs a new task name")
        if bundle:
            path, sha256 = _bundle_peft_dir(path, task, sha256)
        w = self.view.model.embed_tokens.weight
        adapter = load_adapter(path, self.base.cfg, sha256=sha256, base_fingerprint=self.base_fp(),
                               dtype=w.dtype, device=w.device)
        self.view.add_adapter(task, adapter)

    @torch.inference_mode()
    def prefill_rows(self, prompts: Sequence[Sequence[int]], tasks: Sequence[str]
                     ) -> List[Tuple[np.ndarray, Callable[[str, dict], bytes]]]:
        """One lora_prefill over every row: per row (first-token logits, export(dtype, meta) -> KV blob)."""
        threads = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            dev = self.view.model.embed_tokens.weight.device
            toks, lengths = pad_right(prompts, device=dev)
            logits, kv, lengths = lora_prefill(self.view, toks, lengths, list(tasks))
        finally:
            torch.set_num_threads(threads)
        rows = logits.cpu().numpy()
        return [(rows[b], self._exporter(kv, b, int(lengths[b]), prompts[b])) for b in range(len(prompts))]

    def _exporter(self, kv, b: int, n: int, prompt) -> Callable[[str, dict], bytes]:
        cfg = self.base.cfg

        def export(dtype: str, meta: dict) -> bytes:
            seq = SequenceKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv[0][0].dtype, self.max_len,
                             capacity=n, device=kv[0][0].device)
            seq.append(torch.stack([torch.stack((k[b, :, :n], v[b, :, :n])) for k, v in kv]))
            return seq.to_bytes(self.fingerprint, dtype=dtype, tokens=list(prompt), meta=meta)
        return export


def _bundle_peft_dir(bundle, task: str, sha256: Optional[str]) -> Tuple[Path, str]:
    """(PEFT directory, sha256 of its weights) of a bundle's adapter `task`, every file checked."""
    from edge.engines.lora_bundle import check_adapters
    entry = check_adapters(bundle, deep=True, tasks=[task])[0]
    if sha256 is not None and sha256 != entry["files"][0]["sha256"]:
        raise AdapterError(f"sha256 mismatch: the bundle's adapter {task!r} is {entry['files'][0]['sha256'][:12]}…, "
                           f"the request names {sha256[:12]}…; send the digest its manifest lists")
    weights = next((f for f in entry["files"] if Path(f["path"]).name == WEIGHTS_FILE), None)
    if weights is None:
        raise AdapterError(f"the bundle's adapter {task!r} has no PEFT weights ({WEIGHTS_FILE}) for torch; "
                           "re-add it with `edge-export adapter DIR BUNDLE --bundle --task T`")
    return Path(bundle) / Path(weights["path"]).parent, weights["sha256"]

