"""Write our llama / qwen2 checkpoints as GGUF files that llama.cpp runs.

Tensor names and metadata follow llama.cpp's converter (convert_hf_to_gguf.py):
HF names map to gguf's MODEL_TENSOR table; for arch "llama" the q/k rows are
permuted from HF's rotate-half RoPE layout to llama.cpp's interleaved one
(qwen2 uses NEOX RoPE in llama.cpp and needs no permutation). Q4_0 is written
with export/quant.py's grid, so a QSUN decoder runs on exactly the int4
weights it was tuned against (a row permutation does not change Q4_0 blocks,
which run along the input dimension).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType, MODEL_TENSOR, TENSOR_NAMES, TokenType

from edge.model.transformer import ModelConfig, rope_inv_freq
from export.quant import is_quantised_linear, quantize_q4, to_gguf_q4_0_bytes

FTYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
}
# K-quants come from llama.cpp's own quantiser (its mixes, its fallbacks for
# rows not divisible by 256), run on an F16 file we write first
KQUANTS = ("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")

# HF parameter name (after "model.layers.{i}.") -> llama.cpp tensor kind
_BLOCK = {
    "input_layernorm": MODEL_TENSOR.ATTN_NORM,
    "post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}
_TOP = {
    "model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD,
    "model.norm": MODEL_TENSOR.OUTPUT_NORM,
    "lm_head": MODEL_TENSOR.OUTPUT,
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class GGUFExportError(ValueError):
    """The checkpoint or tokenizer cannot be written as the requested GGUF."""


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter name, e.g. blk.3.attn_q.weight."""
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _BLOCK:
        return TENSOR_NAMES[_BLOCK[m.group(2)]].format(bid=int(m.group(1))) + "." + m.group(3)
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP:
        return TENSOR_NAMES[_TOP[stem]] + "." + suffix
    raise GGUFExportError(f"no GGUF name for parameter {hf_name!r} (llama/qwen2 parameters only)")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp interleaved rows (the converter's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --- tokenizer metadata ------------------------------------------------------------------------


@dataclass
class GGUFVocab:
    """What llama.cpp needs to tokenise exactly as we do (a byte-level BPE, "gpt2" model)."""

    tokens: list
    token_types: list
    merges: list
    pre: str  # llama.cpp pre-tokeniser name: "smollm", "qwen2", "gpt-2", "llama-bpe", ...
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    pad_id: Optional[int] = None
    unk_id: Optional[int] = None
    add_bos: bool = False
    chat_template: Optional[str] = None

    def padded(self, vocab_size: int) -> "GGUFVocab":
        """llama.cpp wants one token per embedding row: fill the gap as the converter does."""
        n = len(self.tokens)
        if n > vocab_size:
            raise GGUFExportError(f"tokenizer has {n} tokens but the model only {vocab_size} embedding rows")
        extra = range(n, vocab_size)
        return GGUFVocab(
            tokens=list(self.tokens) + [f"[PAD{i}]" for i in extra],
            token_types=list(self.token_types) + [int(TokenType.UNUSED)] * len(extra),
            merges=self.merges, pre=self.pre, bos_id=self.bos_id, eos_id=self.eos_id,
            pad_id=self.pad_id, unk_id=self.unk_id, add_bos=self.add_bos, chat_template=self.chat_template,
        )


def vocab_from_hf_json(tokenizer_json: str | Mapping, pre: Optional[str] = None, **special: Any) -> GGUFVocab:
    """Vocabulary of a Hugging Face tokenizer.json (text, dict, or a `tokenizers.Tokenizer`).

    Added special tokens become CONTROL, other added tokens USER_DEFINED, as in
    llama.cpp's converter. `special` may set bos_id/eos_id/pad_id/add_bos/chat_template.
    """
    if hasattr(tokenizer_json, "to_str"):
        tokenizer_json = tokenizer_json.to_str()
    tj = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else dict(tokenizer_json)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"only byte-level BPE tokenizers are supported, got {model.get('type')!r}")
    id_to = {int(i): (t, int(TokenType.NORMAL)) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens") or []:
        id_to[int(a["id"])] = (a["content"], int(TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED))
    n = max(id_to) + 1
    tokens = [id_to.get(i, (f"[PAD{i}]", int(TokenType.UNUSED)))[0] for i in range(n)]
    types = [id_to.get(i, (None, int(TokenType.UNUSED)))[1] for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return GGUFVocab(tokens=tokens, token_types=types, merges=merges, pre=pre or _guess_pre(tj), **special)


def _guess_pre(tj: Mapping) -> str:
    pt = tj.get("pre_tokenizer") or {}
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
        return "gpt-2"  # GPT-2's own split regex
    raise GGUFExportError(
        "cannot tell llama.cpp's pre-tokeniser for this tokenizer; pass pre= "
        "(e.g. 'smollm', 'qwen2', 'llama-bpe') so llama.cpp splits text as it does"
    )


def vocab_from_gguf(path: str | Path) -> GGUFVocab:
    """The tokenizer metadata of an existing GGUF file (to re-export a model we loaded from it)."""
    from edge.model.tokenizer import open_gguf      # the stock reader slices the vocabulary's memmap slowly
    r = open_gguf(path)

    def get(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    if get("tokenizer.ggml.model") != "gpt2":
        raise GGUFExportError(f"{path}: only 'gpt2' (byte-level BPE) vocabularies are supported")
    return GGUFVocab(
        tokens=get("tokenizer.ggml.tokens"), token_types=get("tokenizer.ggml.token_type"),
        merges=get("tokenizer.ggml.merges", []), pre=get("tokenizer.ggml.pre", "default"),
        bos_id=get("tokenizer.ggml.bos_token_id"), eos_id=get("tokenizer.ggml.eos_token_id"),
        pad_id=get("tokenizer.ggml.padding_token_id"), unk_id=get("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)), chat_template=get("tokenizer.chat_template"),
    )


# edge.model.tokenizer's pre-tokenizer names -> llama.cpp's `tokenizer.ggml.pre` values
_LLAMACPP_PRE = {"smollm": "smollm", "qwen2": "qwen2", "llama3": "llama-bpe", "gpt2": "gpt-2"}


def vocab_from_tokenizer(tok: Any) -> GGUFVocab:
    """The vocabulary of an edge.model.tokenizer.Tokenizer, with llama.cpp's name for its pre-tokenizer."""
    from edge.model.tokenizer import _pre_id  # the structure -> name match the fingerprint uses

    spec = json.loads(tok.to_json())
    known = _pre_id(spec)
    if known not in _LLAMACPP_PRE:
        raise GGUFExportError(
            "this tokenizer's pre-tokenizer is not one llama.cpp knows by name (smollm, qwen2, llama3, "
            "gpt2); llama.cpp would split text differently, so the GGUF is not written"
        )
    return vocab_from_hf_json(
        spec, pre=_LLAMACPP_PRE[known], bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
        add_bos=bool(tok.add_bos), chat_template=tok.chat_template,
    )


def as_vocab(tokenizer: Any) -> GGUFVocab:
    """Accept a GGUFVocab, an edge Tokenizer, a `tokenizers.Tokenizer`, or a GGUF path."""
    if isinstance(tokenizer, GGUFVocab):
        return tokenizer
    if hasattr(tokenizer, "to_json") and hasattr(tokenizer, "fingerprint"):
        return vocab_from_tokenizer(tokenizer)
    if hasattr(tokenizer, "to_str"):
        return vocab_from_hf_json(tokenizer)
    if isinstance(tokenizer, (str, Path)) and str(tokenizer).endswith(".gguf"):
        return vocab_from_gguf(tokenizer)
    raise GGUFExportError(f"don't know how to read a vocabulary from {type(tokenizer).__name__}")


# --- writing -----------------------------------------------------------------------------------


def _tensor_data(name: str, t: torch.Tensor, ftype: str, float_type: str):
    """(array, raw_dtype) for one tensor under the file type; 1-D tensors stay F32."""
    w = t.detach().to(torch.float32).cpu()
    if w.dim() == 1 or ftype == "F32":
        return w.numpy(), None
    kind = ftype
    if ftype == "Q4_0" and not is_quantised_linear(name):
        kind = float_type  # embeddings / lm_head stay float, as in QSUN training
    if kind == "Q8_0" and w.shape[-1] % 32:
        kind = "F16"  # Q8_0 blocks need 32 | in (Q4_0 raises instead: it must match QSUN's grid)
    if kind == "F32":
        return w.numpy(), None
    if kind == "F16":
        return w.numpy().astype(np.float16), None
    if kind == "Q8_0":
        return gguf.quants.quantize(w.numpy(), QT.Q8_0), QT.Q8_0
    return to_gguf_q4_0_bytes(quantize_q4(w)), QT.Q4_0


def _rope_metadata(writer: gguf.GGUFWriter, cfg: ModelConfig):
    """Rope scaling the way llama.cpp reads it; returns an extra tensor for llama3 scaling."""
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(sc["factor"]))
        return None
    if kind == "freq_factors":          # read from a GGUF (edge/model/checkpoint.py): write it back as it was
        return np.array(sc["factors"], dtype=np.float32)
    if kind == "llama3":
        # llama.cpp divides each frequency by rope_freqs[i]: the default / scaled ratio
        plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
        return (rope_inv_freq(plain) / rope_inv_freq(cfg)).float().numpy()
    raise GGUFExportError(f"rope scaling {kind!r} is not supported by the GGUF exporter "
                          "(linear, llama3, freq_factors only)")


def write_gguf(
    path: str | Path,
    cfg: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    tokenizer: Any,
    ftype: str = "F32",
    float_type: str = "F16",
    name: Optional[str] = None,
) -> Path:
    """Write `state_dict` (HF names, our ModelConfig) as a GGUF llama.cpp loads.

    ftype: F32 | F16 | Q8_0 (all 2-D weights) | Q4_0 (the decoder projections on
    export/quant.py's grid; embeddings and lm_head as `float_type`). Norms,
    biases and other 1-D tensors are always F32.
    """
    if ftype not in FTYPES:
        raise GGUFExportError(f"unknown GGUF file type {ftype!r}; choose one of {', '.join(FTYPES)}")
    if float_type not in ("F32", "F16", "Q8_0"):
        raise GGUFExportError("float_type (embeddings / lm_head in Q4_0 files) must be F32, F16 or Q8_0")
    if cfg.arch == "qwen2" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise GGUFExportError(
            "llama.cpp's qwen2 loader needs head_dim * num_heads == hidden_size "
            f"({cfg.head_dim} * {cfg.num_heads} != {cfg.hidden_size}); export this model as arch 'llama' instead"
        )
    vocab = as_vocab(tokenizer).padded(cfg.vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = cfg.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or cfg.extra.get("name", f"starsun-{arch}"))
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(FTYPES[ftype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rope_freqs = _rope_metadata(w, cfg)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    for setter, value in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                          (w.add_pad_token_id, vocab.pad_id), (w.add_unk_token_id, vocab.unk_id)):
        if value is not None:
            setter(int(value))
    w.add_add_bos_token(bool(vocab.add_bos))
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)

    names = [n for n in state_dict if not (cfg.tie_embeddings and n == "lm_head.weight")]
    for hf_name in names:
        t = state_dict[hf_name]
        if arch == "llama" and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
            t = permute_qk(t, heads)
        data, raw = _tensor_data(hf_name, t, ftype, float_type)
        w.add_tensor(gguf_name(hf_name), data, raw_dtype=raw)
    if rope_freqs is not None:
        w.add_tensor(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def export_gguf(src: str | Path, out: str | Path, ftype: str = "Q4_0", float_type: str = "F16") -> Path:
    """Load a checkpoint (GGUF file, HF directory or model name) and write it as `ftype` GGUF.

    The tokenizer metadata of a GGUF source is copied as is (llama.cpp's own
    vocabulary, pre-tokeniser name and token types); other sources go through
    edge.model.tokenizer.
    """
    from edge.model.checkpoint import load_checkpoint

    if ftype not in FTYPES and ftype not in KQUANTS:
        raise GGUFExportError(f"unknown GGUF file type {ftype!r}; choose one of {', '.join((*FTYPES, *KQUANTS))}")
    ckpt = load_checkpoint(src)
    tokenizer: Any = ckpt.tokenizer
    if ckpt.kind == "gguf":
        tokenizer = vocab_from_gguf(ckpt.source)
    name = f"{Path(ckpt.source).stem}-{ftype}"
    if ftype in KQUANTS:
        out = Path(out)
        f16 = out.with_name(out.name + ".f16.tmp")
        try:
            write_gguf(f16, ckpt.config, ckpt.state_dict, tokenizer, ftype="F16", name=name)
            return quantize_with_llamacpp(f16, out, ftype)
        finally:
            f16.unlink(missing_ok=True)
    return write_gguf(out, ckpt.config, ckpt.state_dict, tokenizer, ftype=ftype, float_type=float_type, name=name)


def quantize_with_llamacpp(src: str | Path, out: str | Path, ftype: str, threads: int = 0,
                           requantize: bool = False) -> Path:
    """Quantise a F16/F32 GGUF to a K-quant with llama.cpp's `llama_model_quantize`.

    requantize: also accept an already-quantised `src` and the plain types (F16, BF16, Q8_0, Q4_0);
    llama.cpp dequantises each tensor first, so a Q4_K_M model stored as F16 has the same weights
    up to F16 rounding (the benchmarks use that for a memory-bound target)."""
    import ctypes
    allowed = KQUANTS + (("F16", "BF16", "Q8_0", "Q4_0") if requantize else ())
    if ftype not in allowed:
        raise GGUFExportError(f"{ftype!r} is not a K-quant; choose one of {', '.join(allowed)}")
    try:
        import llama_cpp
    except ImportError:
        raise GGUFExportError("K-quants use llama.cpp's own quantiser: install llama-cpp-python "
                              "(pip install '.[llama]') or pick F32/F16/Q8_0/Q4_0") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.allow_requantize = bool(requantize)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        raise GGUFExportError(f"llama.cpp's quantiser failed on {src} -> {ftype} (return code {rc})")
    return out
