"""One tokenizer type for every model, built with the `tokenizers` library.

Sources: a GGUF file's metadata (byte-level BPE: tokens, merges, token types,
`tokenizer.ggml.pre`), or a Hugging Face `tokenizer.json` (+ tokenizer_config.json
for the chat template and special tokens). No hand-written BPE.

GGUF tokenizers follow llama.cpp, not transformers' GGUF reader: e.g. for
`pre = "smollm"` llama.cpp splits digits one by one (as SmolLM2's own
tokenizer.json does), which transformers' GGUF reader forgets.

`fingerprint()` identifies what a token id MEANS: draft and target (or a KV blob
and its decoder) must agree on it before they exchange ids.
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class TokenizerError(ValueError):
    """A tokenizer cannot be built or used; the message says what to do."""


# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_GPT2_PRE = "gpt2"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def _pre_tokenizer(name: str):
    """The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value."""
    if name in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"):
        # llama.cpp: "\p{N}" (each digit alone), then the GPT-2 regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if name in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT)
    if name in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if name in ("gpt2", "default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    raise TokenizerError(f"GGUF pre-tokenizer {name!r} is not supported "
                         "(supported: smollm/starcoder, qwen2, llama3, gpt2)")


_KNOWN_PRE = ("smollm", "qwen2", "llama3", _GPT2_PRE)
# llama.cpp ignores merges for these (whole-word vocabulary hits first)
_IGNORE_MERGES = ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3")

# Control tokens that end generation (llama.cpp's end-of-generation names,
# FIM pad / repo / file-separator tokens included, as llama.cpp does).
_EOG_NAMES = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<reponame>"})


def open_gguf(path):
    """gguf.GGUFReader, ~3.5x faster to open on large vocabularies.

    GGUFReader slices its np.memmap once per metadata string (450k times for a
    Qwen vocabulary) and memmap slicing is slow; the same slices of a plain
    ndarray view of that memmap are not. Falls back to the stock reader if the
    package's private `_get` ever changes shape.
    """
    import gguf
    import numpy as np

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            raw = self.__dict__.get("_raw")
            if raw is None:
                raw = self.__dict__["_raw"] = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = raw[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    try:
        return _Reader(str(path))
    except (TypeError, AttributeError):
        return gguf.GGUFReader(str(path))


def _strip_offsets(obj):
    """Canonical form of a normalizer/pre-tokenizer: drop fields that never change ids."""
    if isinstance(obj, dict):
        return {k: _strip_offsets(v) for k, v in obj.items() if k != "trim_offsets"}
    if isinstance(obj, list):
        return [_strip_offsets(v) for v in obj]
    return obj


def _canon(normalizer, pre) -> str:
    return json.dumps(_strip_offsets({"normalizer": normalizer, "pre_tokenizer": pre}),
                      sort_keys=True, separators=(",", ":"))


def _pre_id(tokenizer_json: dict) -> str:
    """Name of a known pre-tokenizer structure (the normalizer and pre_tokenizer of a serialized
    tokenizer, tokenizer.json's dict), else a hash of it (version-stable for knowns)."""
    have = _canon(tokenizer_json.get("normalizer"), tokenizer_json.get("pre_tokenizer"))
    for name in _KNOWN_PRE:
        probe = _HFTokenizer(models.BPE({}, []))
        probe.pre_tokenizer = _pre_tokenizer(name)
        if _canon(None, json.loads(probe.to_str())["pre_tokenizer"]) == have:
            return name
    return "sha256:" + hashlib.sha256(have.encode()).hexdigest()[:16]


class TextStream:
    """Incremental detokenizer: put(id) returns the text that is now complete.

    Bytes of a multi-byte UTF-8 character split across tokens are held back
    until the character is whole, so a streamed print never shows U+FFFD.
    """

    def __init__(self, tok: "Tokenizer", skip_special: bool = False):
        self._tok = tok._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special)

    def put(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""

    def put_many(self, ids: Iterable[int]) -> str:
        return "".join(self.put(i) for i in ids)


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, *, bos_id: Optional[int] = None,
                 eos_ids: Sequence[int] = (), eos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, add_bos: bool = False, add_eos: bool = False,
                 chat_template: Optional[str] = None, vocab_size: Optional[int] = None):
        self._tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id if eos_id is not None else (min(eos_ids) if eos_ids else None)
        self.eos_ids = frozenset(int(i) for i in eos_ids) | (
            {self.eos_id} if self.eos_id is not None else set())
        self.pad_id = pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        ids = tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = vocab_size or (max(ids) + 1 if ids else 0)
        self._fingerprint: Optional[str] = None

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        import gguf  # local: only GGUF sources need it
        reader = reader_or_path
        if not isinstance(reader, gguf.GGUFReader):
            reader = open_gguf(reader_or_path)
        f = reader.fields

        def get(key, default=None):
            return f[key].contents() if key in f else default

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level "
                                 "BPE ('gpt2': SmolLM, Qwen2, Llama 3 families)")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens/merges metadata")
        types = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        pre = get("tokenizer.ggml.pre", "default")
        bpe = models.BPE({t: i for i, t in enumerate(tokens)},
                         [tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
        tok = _HFTokenizer(bpe)
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        # llama.cpp matches control and user-defined tokens whole in the text
        added = [AddedToken(t, special=(ty == _CONTROL), normalized=False)
                 for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
        if added:
            tok.add_tokens(added)
        eos = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos = {i for i in eos if i is not None}
        eos |= {i for i, (t, ty) in enumerate(zip(tokens, types))
                if ty == _CONTROL and t in _EOG_NAMES}
        return cls(tok, bos_id=get("tokenizer.ggml.bos_token_id"),
                   eos_id=get("tokenizer.ggml.eos_token_id"), eos_ids=sorted(eos),
                   pad_id=get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=get("tokenizer.chat_template"), vocab_size=len(tokens))

    @classmethod
    def from_file(cls, path, config: Optional[dict] = None) -> "Tokenizer":
        """A tokenizer.json, with an optional tokenizer_config.json dict beside it."""
        path = Path(path)
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
        cfg = dict(config or {})

        def tid(key):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        eos_ids = set(cfg.get("starsun_eos_ids") or ())
        eos_id = tid("eos_token")
        if not eos_ids:  # foreign dir: eos token + the EOG-named special tokens
            specials = {a.content: i for i, a in tok.get_added_tokens_decoder().items() if a.special}
            eos_ids = {i for t, i in specials.items() if t in _EOG_NAMES}
        ct = cfg.get("chat_template")
        if isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
            ct = next((c["template"] for c in ct if c.get("name") == "default"), ct[0]["template"])
        return cls(tok, bos_id=tid("bos_token"), eos_id=eos_id, eos_ids=sorted(eos_ids),
                   pad_id=tid("pad_token"), add_bos=bool(cfg.get("add_bos_token", False)),
                   add_eos=bool(cfg.get("add_eos_token", False)), chat_template=ct,
                   vocab_size=cfg.get("starsun_vocab_size"))

    @classmethod
    def from_hf_dir(cls, directory) -> "Tokenizer":
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d} has no tokenizer.json (a Hugging Face 'fast' tokenizer "
                                 "is required; save one with tokenizer.save_pretrained)")
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        if (d / "chat_template.jinja").is_file():
            cfg["chat_template"] = (d / "chat_template.jinja").read_text()
        tok = cls.from_file(d / "tokenizer.json", cfg)
        # generation_config / config eos lists (e.g. Qwen: [151645, 151643])
        for name in ("generation_config.json", "config.json"):
            if (d / name).is_file() and "starsun_eos_ids" not in cfg:
                e = json.loads((d / name).read_text()).get("eos_token_id")
                if e is not None:
                    tok.eos_ids = tok.eos_ids | set(e if isinstance(e, list) else [e])
        return tok

    # -- saving --------------------------------------------------------------------
    def to_json(self) -> str:
        """The tokenizer.json text (the `tokenizers` serialisation)."""
        return self._tok.to_str()

    def save(self, directory) -> None:
        """Write tokenizer.json + tokenizer_config.json (HF layout; loads back exactly)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(self.to_json(), encoding="utf-8")
        name = self._tok.id_to_token
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
               "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
               "starsun_eos_ids": sorted(self.eos_ids), "starsun_vocab_size": self.vocab_size}
        for key, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                       ("pad_token", self.pad_id)):
            if i is not None:
                cfg[key] = name(i)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False),
                                                 encoding="utf-8")

    # -- use ---------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = False) -> List[int]:
        """Token ids; special tokens written in the text (e.g. <|im_start|>) are parsed.

        add_special adds BOS/EOS only where the model asks for them (add_bos_token),
        as llama.cpp does.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids = [self.bos_id] + ids
            if self.add_eos and self.eos_id is not None:
                ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def decode_stream(self, skip_special: bool = False) -> TextStream:
        return TextStream(self, skip_special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(int(i))

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render messages with the model's jinja2 chat template (as transformers does)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass the raw prompt instead")
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - jinja2 is a runtime dependency
            raise TokenizerError("chat templates need jinja2: pip install jinja2") from e

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        name = self._tok.id_to_token
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=name(self.bos_id) if self.bos_id is not None else "",
                eos_token=name(self.eos_id) if self.eos_id is not None else "", **kwargs)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e

    def fingerprint(self) -> str:
        """sha256 of the vocabulary (tokens in id order), the merges, the pre-tokenizer
        (by known name, else a hash of its structure) and the added tokens."""
        if self._fingerprint is None:
            tokenizer_json = json.loads(self._tok.to_str())     # tokenizer.json as a dict
            h = hashlib.sha256()
            inv = {i: t for t, i in self._tok.get_vocab(with_added_tokens=True).items()}
            for i in range(self.vocab_size):
                h.update(inv.get(i, "").encode("utf-8") + b"\0")
            h.update(b"\1merges\1")
            for m in tokenizer_json["model"].get("merges", []):
                h.update((" ".join(m) if isinstance(m, list) else m).encode("utf-8") + b"\0")
            h.update(b"\1pre\1" + _pre_id(tokenizer_json).encode())
            added = sorted((a["id"], a["content"], bool(a["special"])) for a in tokenizer_json["added_tokens"])
            h.update(b"\1added\1" + json.dumps(added, ensure_ascii=False).encode("utf-8"))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={sorted(self.eos_ids)}, fingerprint={self.fingerprint()[:12]})")
