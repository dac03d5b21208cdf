"""How much memory a role needs on a backend, whether it fits a budget, and the most that fits.

    peak = runtime + tokenizer + weights + KV + compute

runtime    the process before the model: Python, numpy, the backend's library (torch alone
           is ~0.2 GB of RSS, which is why llama.cpp and onnxruntime roles never import it)
tokenizer  the vocabulary the process keeps (grows with its size)
weights    as the backend holds them: the GGUF's quantised blocks (llama.cpp reads them;
           see LlamaCppEngine's `mmap`), the ONNX initialisers (int4 blocks + fp32
           embeddings), or parameters x the torch dtype; torch and onnxruntime peak above
           that while loading (a transient this model adds where it exceeds the run's peak)
KV         bytes per token (layers x 2 x kv_heads x head_dim x itemsize: llama.cpp f16,
           onnxruntime fp32, torch its dtype) x context x sequences. llama.cpp allocates
           n_ctx x n_seq_max up front (kv_unified off): modelled as it is, whatever is used.
           torch grows a sequence's cache by doubling up to the context; onnxruntime keeps
           exactly the tokens held, plus the call's inputs and outputs while it runs
compute    activations of the role's largest call and its logits rows (vocab x 4 bytes each)

A target's prompt cache (edge/speculative/prefix_cache.py: `cache_slots` conversations, at most
`cache_bytes` of KV) adds its sequences: on llama.cpp whole sequences of the context (n_seq_max
counts them, allocated up front), elsewhere what the held tokens allocate, up to cache_bytes; its
conversations saved to host memory (saved_prompts.py, `saved_bytes` at most: llama.cpp and torch
engines save) are a part of their own, counted at their bound.

The constants below "calibrated here" were fitted to peak RSS measured here (2-core x86,
no GPU) by benchmarks/device/memory_plan.py, whose cases and errors are kept in
benchmarks/results/memory_plan/default.md. A device profile (devices/profiles) says how much
memory there is, not how a backend uses it: on a GPU profile the same arithmetic is an
estimate of the role's host + device bytes with CPU-calibrated overheads, and the CUDA
context is assumed to be outside the profile's usable memory (not measured here).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Dict, Optional

from edge.memory.model_shape import ModelShape

MiB = 1 << 20
BACKENDS = ("torch", "onnx", "llamacpp")
SAVING_BACKENDS = ("torch", "llamacpp")   # engines with save_sequence (a prompt cache's host-memory tier)
ROLES = ("target", "draft", "prefill", "decoder")
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}

# -- calibrated here (benchmarks/results/memory_plan/default.md keeps the cases that justify each) ---------
# RSS after the imports each backend's role makes, measured in a bare process (the torch import
# alone is ~0.18 GB of it); every case of its backend rests on it.
RUNTIME_BYTES = {"llamacpp": 43 * MiB, "onnx": 53 * MiB, "torch": 228 * MiB}
# RSS a loaded tokenizer keeps: fixed + per vocabulary entry, fitted to Qwen2.5's 151,936 entries
# (104 MiB kept) and SmolLM2's 49,152 (48 MiB), measured after load_tokenizer in a bare process.
TOKENIZER_BYTES = (21 * MiB, 571)
LLAMACPP_CTX_PAD = 256                # llama.cpp rounds a context up to whole 256-cell blocks (ctx=1000 case)
LLAMACPP_N_BATCH = 512                # LlamaCppEngine's n_batch: the largest ubatch of a prefill
LLAMACPP_SEQUENCES = 8                # LlamaCppEngine's n_seq_max default (draft / prefill as the roles load it)
# activations of a call per token, in floats x hidden and x intermediate: llama.cpp's from its
# compute buffer less the logits, torch's and onnxruntime's fitted to the target cases at 1024-4096
ACT_FLOATS_PER_TOKEN = {"llamacpp": (2.0, 2.0), "onnx": (6.0, 3.0), "torch": (8.0, 3.5)}
ONNX_WEIGHTS = 1.25                   # resident initialisers / graph bytes after the session is built: measured
                                      # 1.03-1.3 (fp32) and 1.13-1.2 (int4); the upper end, as the peak varies run to run
ONNX_LOAD_PEAK = 1.35                 # ... while it is built (measured 1.2-1.5; a transient)
ONNX_ATTN_BUFFERS = 3                 # the exported graph holds ~3 heads x T x T fp32 score buffers at once
                                      # (fitted: onnx target cases at 1024 and 4096)


@dataclass(frozen=True)
class Workload:
    """What a role asks of its engine: the context per sequence and the sequences held at once."""
    role: str
    backend: str
    context: int
    sequences: int = 1
    dtype: str = "float32"            # torch only
    gamma: int = 4                    # target: a verify call is over gamma + 1 tokens
    max_kv_bytes: Optional[int] = None   # draft (torch / onnx): the service's --max-kv-mb cap
    adapters: int = 0                 # prefill: LoRA specialists it holds (edge/memory/adapters.py) ...
    adapter_bytes: int = 0            # ... and their tensor bytes, all of them
    cache_slots: int = 0              # target: conversations its prompt cache holds (prefix_cache.py)
    cache_bytes: Optional[int] = None   # ... and the most KV bytes they may hold (None: no bound but the slots)
    saved_bytes: int = 0              # target: the most KV its prompt cache saves to host memory (--prompt-cache-ram)
    twin: bool = False                # llamacpp --repack both: an unrepacked copy for long prefills (llamacpp_twin.py)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; use one of {', '.join(ROLES)}")
        if self.context < 1 or self.sequences < 1:
            raise ValueError("context and sequences must be at least 1")
        if self.adapter_bytes < 0 or (self.adapter_bytes and self.role != "prefill"):
            raise ValueError("adapters are held by a prefill worker only (and never fewer than none)")
        if self.cache_slots < 0 or (self.cache_slots and self.role != "target"):
            raise ValueError("a prompt cache is a target's only (and never fewer than no slots)")

    @property
    def engine_sequences(self) -> int:
        """Sequences the engine holds at once: the role's, its prompt cache's and a spare (gather_spare)."""
        return engine_sequences(self.backend, self.sequences, self.cache_slots)


@dataclass
class Estimate:
    shape: ModelShape
    workload: Workload
    parts: Dict[str, int] = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    kv_tokens: int = 0                # tokens of KV the estimate holds (all sequences)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def to_dict(self) -> dict:
        w = self.workload
        return {"model": self.shape.name, "quant": self.shape.quant, "role": w.role, "backend": w.backend,
                "context": w.context, "sequences": w.sequences, "prompt_cache": w.cache_slots,
                "prompt_cache_bytes": w.cache_bytes, "prompt_cache_saved_bytes": w.saved_bytes,
                "dtype": w.dtype if w.backend == "torch" else None,
                "parts_bytes": dict(self.parts), "total_bytes": self.total,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_tokens": self.kv_tokens}


def kv_itemsize(backend: str, dtype: str = "float32") -> int:
    return {"llamacpp": 2, "onnx": 4}.get(backend) or DTYPE_BYTES[dtype]


def kv_bytes_per_token(shape: ModelShape, backend: str, dtype: str = "float32") -> int:
    """KV bytes one token of one sequence costs on this backend (what Engine.kv_bytes_per_token says)."""
    return shape.kv_elements_per_token() * kv_itemsize(backend, dtype)


def _torch_source_itemsize(shape: ModelShape) -> int:
    """Bytes per parameter of the file torch reads: a GGUF's dequantised cache and SUN modules are fp32."""
    return 4 if shape.kind in ("gguf", "sun", "bundle") else DTYPE_BYTES.get(shape.quant, 4)


def weight_bytes(shape: ModelShape, backend: str, dtype: str = "float32", tokens: int = 0) -> int:
    """Resident weight bytes. torch in the dtype of its file maps it (safetensors): an untied
    embedding is read one row per distinct token, so only `tokens` rows of it become resident."""
    if backend == "llamacpp":
        # read, not mapped, when repacked (LlamaCppEngine.mmap): one copy either way, so --repack does not
        # change it (Qwen2.5-Coder 0.5B / 1.5B Q4_K_M target, ctx 4096: peak 700 / 1388 MiB on, 698 / 1386 off)
        return shape.stored_bytes
    if backend == "onnx":
        return int(shape.stored_bytes * ONNX_WEIGHTS)
    item = DTYPE_BYTES[dtype]
    full = shape.params * item
    if item == _torch_source_itemsize(shape) and not shape.tied:
        full -= (shape.vocab - min(shape.vocab, tokens)) * shape.hidden * item
    return full


def _loading_peak(shape: ModelShape, w: "Workload", weights: int) -> int:
    """Bytes held while the model loads (freed before the KV grows)."""
    if w.backend == "onnx":
        return int(shape.stored_bytes * ONNX_LOAD_PEAK)
    if w.backend == "torch" and DTYPE_BYTES[w.dtype] != _torch_source_itemsize(shape):
        return weights + shape.params * _torch_source_itemsize(shape)   # the mapped file while converting
    return weights


def _pow2_capacity(n: int, cap: int) -> int:
    """edge/model/kv.py's SequenceKV: 64 slots, doubled until n fit, never past the context."""
    c = 64
    while c < n:
        c *= 2
    return min(c, cap)


def _kv(shape: ModelShape, w: Workload) -> tuple:
    """(bytes, tokens) of KV the role holds at its peak."""
    per = kv_bytes_per_token(shape, w.backend, w.dtype)
    if w.backend == "llamacpp":           # n_ctx x n_seq_max, allocated and cleared up front
        cells = math.ceil(w.context / LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD * w.engine_sequences
        return cells * per, cells
    cap = _pow2_capacity(w.context, w.context) if w.backend == "torch" else w.context
    cached = w.cache_slots * cap          # the prompt cache: whole sequences at most, up to its bytes
    if w.cache_bytes is not None:
        cached = min(cached, w.cache_bytes // per)
    held = cap * w.sequences
    if w.max_kv_bytes is not None and w.role == "draft":
        held = min(held, max(cap, w.max_kv_bytes // per))   # the service refuses past --max-kv-mb
    if w.backend == "torch":              # the last growth holds a sequence's old and new buffer at once
        tokens = held + (_pow2_capacity((cap + 1) // 2, cap) if cap > 64 else 0)
    elif w.role in ("draft", "decoder") and w.sequences > 1:
        tokens = 3 * held                 # onnx batched step: held + padded inputs + outputs
    elif w.role == "prefill":
        tokens = held                     # onnx: one call's outputs, exported as they are
    else:
        tokens = 2 * held                 # onnx: held + the next call's outputs
    return (tokens + cached) * per, tokens + cached


def _compute(shape: ModelShape, w: Workload) -> int:
    """Activations of the role's largest call + the logits it returns."""
    a_h, a_f = ACT_FLOATS_PER_TOKEN[w.backend]
    per_token = (a_h * shape.hidden + a_f * shape.intermediate) * 4
    if w.backend == "llamacpp":
        prefill_rows = min(w.context, LLAMACPP_N_BATCH)
    else:
        prefill_rows = w.context          # torch / onnx prefill a prompt in one call
    step_rows = w.sequences if w.role in ("draft", "decoder") else w.gamma + 1
    rows = max(prefill_rows, step_rows)
    logits_rows = {"target": w.gamma + 1, "draft": w.sequences, "decoder": w.sequences, "prefill": 1}[w.role]
    out = rows * per_token
    if w.backend == "onnx":
        if shape.graph != "prefill":      # only a prefill graph skips the other positions' logits
            logits_rows = max(logits_rows, w.context)
        out += ONNX_ATTN_BUFFERS * shape.heads * w.context * w.context * 4
    # logits twice: the runtime's buffer and the copy handed back as numpy
    out += 2 * logits_rows * shape.vocab * 4
    if w.role == "prefill":               # export_kv after the call: the cache as float32, the fp16 blob, its frame
        out = max(out, w.context * shape.kv_elements_per_token() * (4 + 2 + 2))
    return int(out)


def estimate(shape: ModelShape, w: Workload) -> Estimate:
    """Peak bytes of one process serving workload w with the model of `shape` (module doc)."""
    kv, tokens = _kv(shape, w)
    weights = weight_bytes(shape, w.backend, w.dtype, tokens=w.context * w.sequences)
    compute = _compute(shape, w)
    parts = {"runtime": RUNTIME_BYTES[w.backend],
             "tokenizer": TOKENIZER_BYTES[0] + TOKENIZER_BYTES[1] * shape.vocab,
             "weights": weights, "kv": kv, "compute": compute}
    if w.adapter_bytes:
        parts["adapters"] = w.adapter_bytes
    if w.saved_bytes and w.cache_slots and w.backend in SAVING_BACKENDS:
        parts["saved prompts"] = w.saved_bytes
    if w.twin and w.backend == "llamacpp":   # the file's second layout, one sequence's KV and its way across
        parts["prefill twin"] = shape.stored_bytes + 2 * _kv(shape, replace(w, sequences=1, cache_slots=0))[0]
    loading = _loading_peak(shape, w, weights)
    if loading > weights + kv + compute:  # loading peaks above the run: count the difference
        parts["loading"] = loading - weights - kv - compute
    return Estimate(shape, w, parts, kv_bytes_per_token(shape, w.backend, w.dtype), tokens)


# -- budgets -----------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_bytes(text: str) -> int:
    """'5.5G' -> 5_500_000_000 (K/M/G are powers of 1000, KiB/MiB/GiB of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 5.5G, 800M or 6GiB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass
class Fit:
    """An estimate against a budget, and the most that fits it."""
    estimate: Estimate
    budget: int
    max_context: int                  # at the workload's sequences (0: not even one token)
    max_sequences: int                # at the workload's context (0: not even one)

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.budget

    @property
    def headroom(self) -> int:
        """Bytes left (negative: short by that much)."""
        return self.budget - self.estimate.total

    @property
    def kv_budget_bytes(self) -> int:
        """Bytes left for KV once everything else is held (what a running service may fill)."""
        e = self.estimate
        return self.budget - (e.total - e.parts["kv"])

    def to_dict(self) -> dict:
        return {**self.estimate.to_dict(), "budget_bytes": self.budget, "fits": self.fits,
                "headroom_bytes": self.headroom, "kv_budget_bytes": self.kv_budget_bytes,
                "max_context": self.max_context, "max_sequences": self.max_sequences}


def _largest(ok, hi: int) -> int:
    """The largest n in [1, hi] with ok(n) (ok is monotone: true then false), 0 if none."""
    if not ok(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def fit(shape: ModelShape, w: Workload, budget: int, context_limit: Optional[int] = None,
        sequences_limit: int = 4096) -> Fit:
    """w's estimate against `budget` bytes, with the largest context (up to the model's trained
    context, or context_limit) and the most sequences that fit."""
    ctx_hi = context_limit or max(shape.max_position, w.context)

    def ok_ctx(c):
        return estimate(shape, replace(w, context=c)).total <= budget

    def ok_seq(s):
        return estimate(shape, replace(w, sequences=s)).total <= budget
    return Fit(estimate(shape, w), budget, _largest(ok_ctx, ctx_hi), _largest(ok_seq, sequences_limit))


def cache_slots_that_fit(shape: ModelShape, w: Workload, budget: int) -> Optional[int]:
    """The most prompt-cache slots, up to w's, with which w fits `budget`; None when it does not fit
    even without a prompt cache."""
    def ok(n: int) -> bool:
        return estimate(shape, replace(w, cache_slots=n)).total <= budget
    return _largest(ok, w.cache_slots) if ok(0) else None


# -- what `edge-agent run` builds ----------------------------------------------------------------
def role_sequences(role: str, backend: str, max_sessions: int = 64, max_batch: int = 64, parallel: int = 1) -> int:
    """Sequences the role's engine holds at once, as `edge-agent run` loads it."""
    if role == "target":
        return max(1, int(parallel))      # --parallel: a sequence per generation running at once
    if role == "decoder":
        return max_batch                  # edge/sun/decoder.py: n_seq_max = max_batch on llama.cpp
    if backend == "llamacpp":             # the engine's n_seq_max (the roles load it so)
        return min(max_sessions, LLAMACPP_SEQUENCES) if role == "draft" else LLAMACPP_SEQUENCES
    return max_sessions if role == "draft" else 1


def engine_sequences(backend: str, sequences: int, cache_slots: int) -> int:
    """Sequences an engine holds for `sequences` generations at once beside `cache_slots` held ones;
    on llama.cpp with several generations and a prompt cache, one more: the free slot a gather moves
    through. A step's sequences cost one pass over the weights only on consecutive slots
    (edge/engines/stream_placement.py); with every slot taken, running sequences scattered among
    held ones cannot be moved together, and a 4-generation step took several passes."""
    spare = 1 if backend == "llamacpp" and sequences > 1 and cache_slots > 0 else 0
    return sequences + cache_slots + spare


def engine_kwargs(backend: str, role: str, sequences: int) -> dict:
    """What open_model needs so the engine holds what the plan counted (llama.cpp: n_seq_max)."""
    return {"n_seq_max": int(sequences)} if backend == "llamacpp" else {}
