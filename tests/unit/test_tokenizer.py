"""edge.model.tokenizer against llama.cpp's own tokenizer on the real GGUF files.

Reference: llama-cpp-python (`vocab_only=True`, `special=True`, no BOS). Without it,
transformers' GGUF tokenizer is used instead, except on digit strings for SmolLM2:
transformers ignores `tokenizer.ggml.pre = "smollm"` (digits one by one), which
llama.cpp and SmolLM2's own tokenizer.json honour.
"""
from __future__ import annotations

import json

import pytest

from edge.model.fetch import model_path
from edge.model.tokenizer import Tokenizer, TokenizerError

FAMILIES = ("smollm2-135m", "qwen2.5-coder-0.5b")

STRINGS = [
    "Hello world",
    "Héllo, naïve café — déjà vu! Ærøskøbing, Straße, ÇA VA?",
    "日本語のテキストと中文混合 한국어 текст на русском",
    "emoji 😀👍🏽 🇮🇹 family 👨‍👩‍👧 ✨",
    "def f(x):\n\tif x:\n\t\treturn 1\n    else:\n        return   [i ** 2 for i in range(10)]\n\n\n",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\r\n}\n",
    "1234567 + 3.14159 = 42 000, 1,000,000 and 0x1F; 2024-05-01",
    "  leading and trailing spaces   ",
    "I'm sure you'LL say they'RE fine, it's 'quoted'",
    "\r\n\r\n x \u00a0y\u200bz",
    "a" * 60,
    "",
]

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write `print(1)` in Python 3."},
        {"role": "assistant", "content": "print(1)"},
        {"role": "user", "content": "Now in C, with a tab:\tok?"}]


def _path(name):
    p = model_path(name)
    if not p.exists():
        pytest.skip(f"{p} is missing: run `make models` to fetch {name}")
    return p


_CACHE: dict = {}


def _tok(name) -> Tokenizer:
    if name not in _CACHE:
        _CACHE[name] = Tokenizer.from_gguf(_path(name))
    return _CACHE[name]


class _LlamaRef:
    def __init__(self, path):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.lib = llama_cpp

    def encode(self, s):
        return self.llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)

    def eog(self, n):
        vocab = self.lib.llama_model_get_vocab(self.llm._model.model)
        return {i for i in range(n) if self.lib.llama_vocab_is_eog(vocab, i)}

    def bos(self):
        return self.lib.llama_vocab_bos(self.lib.llama_model_get_vocab(self.llm._model.model))


class _HFRef:
    def __init__(self, path):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def encode(self, s):
        return self.tok(s, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    name = request.param
    path = _path(name)
    try:
        ref = _LlamaRef(path)
    except ImportError:
        pytest.importorskip("transformers", reason="neither llama-cpp-python nor transformers")
        ref = _HFRef(path)
    return name, _tok(name), ref


def _strings(tok):
    return STRINGS + [tok.apply_chat_template(CHAT),
                      tok.apply_chat_template(CHAT[1:2], add_generation_prompt=False)]


def test_ids_equal_reference(family):
    name, tok, ref = family
    for s in _strings(tok):
        if isinstance(ref, _HFRef) and name.startswith("smollm") and any(c.isdigit() for c in s):
            continue  # transformers' GGUF reader does not split digits for pre=smollm
        assert tok.encode(s) == ref.encode(s), repr(s)


def test_decode_round_trip(family):
    _, tok, _ = family
    for s in _strings(tok):
        assert tok.decode(tok.encode(s)) == s


def test_decode_stream_holds_back_split_characters(family):
    _, tok, _ = family
    text = "naïve 😀👍🏽 日本語 👨‍👩‍👧 end"
    ids = tok.encode(text)
    # the check means something only if some token is not valid UTF-8 on its own
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    stream = tok.decode_stream()
    chunks = [stream.put(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text


def test_special_ids_match_llama_cpp(family):
    _, tok, ref = family
    if not isinstance(ref, _LlamaRef):
        pytest.skip("llama-cpp-python is not installed")
    assert tok.bos_id == ref.bos()
    eog = ref.eog(tok.vocab_size)
    # llama.cpp also flags some NORMAL tokens by their text (Qwen's "</s>", id 128247);
    # we stop only on control (special) tokens, which a model emits on purpose
    specials = {i for i, a in tok._tok.get_added_tokens_decoder().items() if a.special}
    assert tok.eos_id in tok.eos_ids
    assert tok.eos_ids == eog & specials


def test_chat_templates():
    smol = _tok("smollm2-135m")
    assert smol.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    qwen = _tok("qwen2.5-coder-0.5b")
    assert qwen.apply_chat_template(CHAT[:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWrite `print(1)` in Python 3.<|im_end|>\n")
    assert qwen.apply_chat_template([{"role": "user", "content": "Hi"}]).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert {"<|im_end|>", "<|endoftext|>"} <= {qwen.id_to_token(i) for i in qwen.eos_ids}


def test_fingerprints():
    small, big = _tok("qwen2.5-coder-0.5b"), Tokenizer.from_gguf(_path("qwen2.5-coder-1.5b"))
    smol = _tok("smollm2-135m")
    assert small.fingerprint() == big.fingerprint()
    assert smol.fingerprint() != small.fingerprint()
    assert len(smol.fingerprint()) == 64


@pytest.mark.parametrize("name", FAMILIES)
def test_save_and_reload_is_identical(name, tmp_path):
    tok = _tok(name)
    tok.save(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    assert back.fingerprint() == tok.fingerprint()
    assert (back.bos_id, back.eos_id, back.eos_ids, back.vocab_size, back.chat_template) == \
           (tok.bos_id, tok.eos_id, tok.eos_ids, tok.vocab_size, tok.chat_template)
    for s in _strings(tok):
        assert back.encode(s) == tok.encode(s)
    assert json.loads(tok.to_json())["model"]["type"] == "BPE"


# -- no model files needed ---------------------------------------------------------------------
def _byte_tokenizer() -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"Ġt": 256, "he": 257, "Ġthe": 258, "<|im_end|>": 259})
    hf = HF(models.BPE(vocab, [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    return Tokenizer(hf, eos_ids=[259], chat_template="{% for m in messages %}[{{ m.content }}]"
                     "{% endfor %}{% if add_generation_prompt %}>{% endif %}")


def test_synthetic_tokenizer(tmp_path):
    tok = _byte_tokenizer()
    ids = tok.encode("in the end<|im_end|>")
    assert 258 in ids and ids[-1] == 259 and tok.eos_ids == {259}
    assert tok.decode(ids) == "in the end<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "in the end"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]>"
    tok.save(tmp_path)
    assert Tokenizer.from_hf_dir(tmp_path).fingerprint() == tok.fingerprint()


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_hf_dir(tmp_path)
    tok = _byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
