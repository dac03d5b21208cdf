"""SUN helpers every role shares: decoder fingerprints, split generation, module directories.

A SUN deployment has one frozen *decoder* and many *prefill modules* (task
specialists), all of the same architecture. A KV blob names the decoder it is
meant for by the decoder's fingerprint: a hash of its config, its precision
tag ("fp32", "int4") and the exact float values of its weights, so an fp
decoder and its int4 counterpart never accept each other's blobs.

`split_generate` is the reference semantics of SUN inference (prefill module
over the prompt -> KV + first token; decoder continues from that KV), batched
on tensors; the roles in edge/sun/ implement the same thing over engines.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from edge.model.transformer import ModelConfig, Transformer
from edge.model.sun_error import SunError  # noqa: F401  (torch-free: the llama.cpp / onnx roles raise it too)

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
PRECISIONS = ("fp32", "int4")


def weights_fingerprint(model: Transformer, precision: str = "fp32") -> str:
    """sha256 over config + precision + every tensor's name, dtype, shape and bytes."""
    if precision not in PRECISIONS:
        raise SunError(f"unknown decoder precision {precision!r}; use one of {PRECISIONS}")
    h = hashlib.sha256()
    h.update(model.cfg.to_json().encode())
    h.update(precision.encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# -- module directories: config + safetensors + manifest ----------------------------------------

def save_module(directory, model: Transformer, manifest: dict) -> Path:
    """Write weights (safetensors, HF names), config.json (HF) and manifest.json."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(d / WEIGHTS))
    (d / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=1))
    man = dict(manifest)
    man["config"] = json.loads(model.cfg.to_json())
    (d / MANIFEST).write_text(json.dumps(man, indent=1, sort_keys=True))
    return d


def read_manifest(directory) -> dict:
    p = Path(directory) / MANIFEST
    if not p.is_file():
        raise SunError(f"{directory} has no {MANIFEST}: it is not a SUN module directory "
                       f"(make one with `edge-export tune` or export.tune.save_decoder)")
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise SunError(f"{p} is not valid JSON: {e}") from None


def load_module(directory, dtype=None, manifest: Optional[dict] = None) -> Tuple[Transformer, dict]:
    """A prefill module or decoder saved by `save_module` -> (model in eval mode, manifest).

    dtype None keeps the saved dtype (a decoder's fingerprint covers its dtype). manifest: the
    module's, when its caller read it already (a ResolvedModel's); else read here.
    """
    d = Path(directory)
    man = read_manifest(d) if manifest is None else manifest
    if not (d / WEIGHTS).is_file():
        raise SunError(f"{d} has a manifest but no {WEIGHTS}")
    cfg = ModelConfig(**man["config"])
    state = load_file(str(d / WEIGHTS))
    saved = next(iter(state.values())).dtype if state else torch.float32
    model = Transformer(cfg).to(saved)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SunError(f"{d / WEIGHTS} does not match its config: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    return model.to(dtype or saved).eval(), man


def check_fingerprint(model: Transformer, manifest: dict) -> str:
    """Recompute a decoder's fingerprint and insist it equals the manifest's."""
    fp = weights_fingerprint(model, manifest.get("precision", "fp32"))
    if manifest.get("fingerprint") and manifest["fingerprint"] != fp:
        raise SunError("decoder weights do not match the fingerprint in its manifest "
                       f"({manifest['fingerprint'][:12]} vs {fp[:12]}); the files were changed")
    return fp


# -- split generation on tensors ----------------------------------------------------------------

def pad_right(rows: Sequence[Sequence[int]], pad: int = 0, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> ([B, T] right-padded, lengths [B]) on `device`."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if (lengths == 0).any():
        raise SunError("empty prompt: a prefill needs at least one token")
    out = np.full((len(rows), int(lengths.max())), pad, dtype=np.int64)
    # one numpy copy, not a tensor per row: tuning pads every step's prompts and answers
    out[np.arange(out.shape[1]) < lengths[:, None]] = np.fromiter(
        (t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(out).to(device), torch.from_numpy(lengths).to(device)


def prefill_batch(prefill: Transformer, prompts: torch.Tensor, lengths: torch.Tensor):
    """Right-padded prompts -> (first-token logits [B, V], KV per layer, lengths).

    Causal attention means padding after a prompt never reaches its real tokens;
    the decoder later ignores KV entries at index >= lengths[b].
    """
    _, kv, h = prefill(prompts, return_hidden=True, logits_last_only=True)
    last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
    return torch.nn.functional.linear(last, prefill.output_weight()), kv, lengths


@torch.inference_mode()
def split_generate(prefill: Transformer, decoder: Transformer, prompts: Sequence[Sequence[int]],
                   max_new: int, stop_ids: Sequence[int] = (), batch_size: int = 64) -> List[List[int]]:
    """Greedy SUN inference: prefill module -> KV + first token; decoder continues.

    Returns the generated ids per prompt, the stop token included when hit.
    With prefill is decoder this is ordinary greedy decoding of that model.
    """
    out: List[List[int]] = []
    for i in range(0, len(prompts), batch_size):
        out.extend(_split_batch(prefill, decoder, prompts[i: i + batch_size], max_new, set(stop_ids)))
    return out


def _split_batch(prefill, decoder, prompts, max_new, stops) -> List[List[int]]:
    dev = next(prefill.parameters()).device
    toks, lengths = pad_right(prompts, device=dev)
    first_logits, kv, lengths = prefill_batch(prefill, toks, lengths)
    return greedy_from_prefill(decoder, first_logits, kv, lengths, max_new, stops)


def greedy_from_prefill(decoder, first_logits, kv, lengths, max_new, stops) -> List[List[int]]:
    """The greedy continuation of a prefilled batch (prefill_batch's output) on `decoder`."""
    dev = first_logits.device
    B, P = first_logits.shape[0], kv[0][0].shape[2]
    # preallocated KV laid out as the model's ragged convention wants: row b valid for lengths[b]
    bufs = []
    for k, v in kv:
        kb = k.new_zeros(B, k.shape[1], P + max_new, k.shape[3])
        vb = v.new_zeros(B, v.shape[1], P + max_new, v.shape[3])
        kb[:, :, :P], vb[:, :, :P] = k, v
        bufs.append((kb, vb))
    cur = first_logits.argmax(-1)
    gen = [[int(t)] for t in cur.tolist()]
    live = [b for b in range(B) if gen[b][0] not in stops]     # rows still generating, in batch order
    if len(live) < B:
        bufs, lengths, cur = _keep_rows(bufs, lengths, cur, list(range(B)), live, dev)
    for _ in range(max_new - 1):
        if not live:
            break
        L = int(lengths.max())
        past = [(kb[:, :, :L], vb[:, :, :L]) for kb, vb in bufs]
        logits, present = decoder(cur[:, None], past=past, past_lengths=lengths)
        rows = torch.arange(len(live), device=dev)
        for (kb, vb), (k, v) in zip(bufs, present):
            kb[rows, :, lengths] = k[:, :, L]
            vb[rows, :, lengths] = v[:, :, L]
        lengths = lengths + 1
        cur = logits[:, -1].argmax(-1)
        for b, t in zip(live, cur.tolist()):
            gen[b].append(t)
        still = [b for b in live if gen[b][-1] not in stops]
        if len(still) < len(live):   # finished rows leave the batch: they cost no more steps
            bufs, lengths, cur = _keep_rows(bufs, lengths, cur, live, still, dev)
            live = still
    return gen


def _keep_rows(bufs, lengths, cur, live, keep, dev):
    """The batch tensors restricted to the rows `keep` (a subsequence of `live`)."""
    pos = {b: i for i, b in enumerate(live)}
    idx = torch.tensor([pos[b] for b in keep], dtype=torch.long, device=dev)
    return [(kb[idx], vb[idx]) for kb, vb in bufs], lengths[idx], cur[idx]


def exact_match(preds: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
    """Fraction of predictions equal to the reference answer (stop token included)."""
    if not answers:
        return 0.0
    return sum(list(p) == list(a) for p, a in zip(preds, answers)) / len(answers)

