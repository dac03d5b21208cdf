"""edge.model.checkpoint: GGUF and Hugging Face directories, the conversion cache, errors.

Tiny GGUF files are written here with the `gguf` package exactly as llama.cpp's
converter lays them out (q/k rows permuted for arch llama, Q8_0 blocks for some
tensors), so the loader is tested without the real models; the real SmolLM2 file
is checked for its config when present.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edge.model.checkpoint import CheckpointError, load_checkpoint, load_model, load_tokenizer
from edge.model.fetch import model_path
from edge.model.transformer import Transformer, tiny_config
from edge.model.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab():
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"] + SPECIALS
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, merges, types


def _tiny(arch: str, seed: int = 0) -> Transformer:
    tokens, _, _ = _vocab()
    torch.manual_seed(seed)
    model = Transformer(tiny_config(arch, vocab_size=len(tokens), num_heads=4, num_kv_heads=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)  # norms and biases away from 1 / 0
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, model: Transformer, arch: str = None) -> None:
    """Write `model` as llama.cpp would; Q8_0 for embeddings and MLP, F32 elsewhere.
    The model's weights are replaced by their Q8_0 round trip, so it stays the reference."""
    import gguf
    cfg = model.cfg
    arch = arch or cfg.arch
    tokens, merges, types = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if cfg.arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    sd = model.state_dict()
    for hf, t in sd.items():
        if hf in names:
            name = names[hf]
        else:
            _, _, i, *mid, kind = hf.split(".")
            name = f"blk.{i}.{block['.'.join(mid)]}.{kind}"
        a = t.detach().numpy().astype(np.float32)
        if ("token_embd" in name or "ffn_" in name) and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            t.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if cfg.arch == "llama" and ".attn_q." in name:
            a = _permute(a, cfg.num_heads)
        elif cfg.arch == "llama" and ".attn_k." in name:
            a = _permute(a, cfg.num_kv_heads)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("STARSUN_CACHE_DIR", str(d))
    return d


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_loads_exactly_and_caches(arch, tmp_path, cache_dir):
    ref = _tiny(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, ref)
    model, ckpt = load_model(path)
    assert not ckpt.from_cache and ckpt.kind == "gguf"
    c = ckpt.config
    assert (c.arch, c.num_heads, c.num_kv_heads, c.qkv_bias, c.tie_embeddings) == \
           (arch, 4, 2, arch == "qwen2", ref.cfg.tie_embeddings)
    tok = ckpt.tokenizer
    ids = tok.encode("<|im_start|>user\nthe theme<|im_end|>")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and 258 in ids  # "Ġthe"
    want = _logits(ref, ids)
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-5, rtol=0)
    # second load: from the safetensors cache, same weights, same fingerprints
    model2, again = load_model(path)
    assert again.from_cache and again.fingerprint == ckpt.fingerprint
    assert again.tokenizer.fingerprint() == tok.fingerprint()
    assert again.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    torch.testing.assert_close(_logits(model2, ids), want, atol=1e-5, rtol=0)
    assert load_tokenizer(path).fingerprint() == tok.fingerprint()
    # the cache is a plain HF directory: transformers reads it too
    transformers = pytest.importorskip("transformers")
    (cached,) = [d for d in cache_dir.iterdir() if d.is_dir()]
    hf = transformers.AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, want, atol=1e-4, rtol=0)
    # dtype is honoured
    half, _ = load_model(path, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16


def _save_hf_dir(d, model: Transformer, shards: int = 1):
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.cfg.to_hf()))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    if shards == 1:
        save_file(sd, str(d / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = keys[s::shards]
            save_file({k: sd[k] for k in part}, str(d / name))
            weight_map.update({k: name for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF
    tokens, merges, _ = _vocab()
    hf = HF(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    Tokenizer(hf, bos_id=tokens.index("<|im_start|>"), eos_id=tokens.index("<|im_end|>"),
              chat_template=TEMPLATE).save(d)
    # as transformers writes it: no starsun_* keys, eos ids found from the special tokens
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc = {k: v for k, v in tc.items() if not k.startswith("starsun_")}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))


@pytest.mark.parametrize("arch,shards", [("llama", 1), ("qwen2", 1), ("qwen2", 3)])
def test_hf_dir_round_trip(arch, shards, tmp_path):
    ref = _tiny(arch, seed=3)
    d = tmp_path / "hf"
    _save_hf_dir(d, ref, shards)
    model, ckpt = load_model(d)
    assert ckpt.kind == "hf" and ckpt.config.qkv_bias == (arch == "qwen2")
    ids = ckpt.tokenizer.encode("the end<|im_end|>")
    assert ids[-1] == ckpt.tokenizer.eos_id and ckpt.tokenizer.eos_ids == {ids[-1], 256 + 3}
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), atol=0, rtol=0)
    assert load_checkpoint(d / "config.json").fingerprint == ckpt.fingerprint
    _save_hf_dir(d, _tiny(arch, seed=4), shards)  # other weights: other fingerprint
    assert load_checkpoint(d).fingerprint != ckpt.fingerprint


def test_smollm2_gguf_config():
    path = model_path("smollm2-135m")
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make models` to fetch SmolLM2-135M")
    ckpt = load_checkpoint(path)
    c = ckpt.config
    assert (c.arch, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == \
           ("llama", 49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.tie_embeddings, c.qkv_bias, c.rope_scaling, c.max_position) == (True, False, None, 8192)
    assert c.rope_theta == 100000.0 and abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert "lm_head.weight" not in ckpt.state_dict
    assert ckpt.state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert ckpt.tokenizer.vocab_size == 49152 and ckpt.tokenizer.bos_id == 1
    assert c.extra["eos_token_ids"] == [0, 2, 4]
    assert len(ckpt.fingerprint) == 64


def test_qwen_gguf_config():
    path = model_path("qwen2.5-coder-0.5b")
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make models` to fetch Qwen2.5-Coder-0.5B")
    from edge.model.tokenizer import open_gguf
    from edge.model.checkpoint import _gguf_config
    c = _gguf_config(open_gguf(path))
    assert (c.arch, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == \
           ("qwen2", 151936, 896, 24, 14, 2)
    # this file ships output.weight (Q8_0) beside token_embd (Q5_0): untied as stored
    assert c.qkv_bias and not c.tie_embeddings and c.rope_theta == 1e6


# -- errors a user can hit ---------------------------------------------------------------------
def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match="make models"):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="make models"):
        load_checkpoint("no-such-model-name")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(CheckpointError, match="neither a GGUF"):
        load_checkpoint(junk)


def test_truncated_and_corrupt_gguf(tmp_path, cache_dir):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, _tiny("llama"))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(cut)
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(data[:300])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(header_cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:4] + b"\xff" * 60 + data[64:])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(bad)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, _tiny("llama"), arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(path, cache=False)


def test_bad_hf_dirs(tmp_path):
    d = tmp_path / "hf"
    _save_hf_dir(d, _tiny("llama"))
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_checkpoint(d)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickled"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(d)

    d2 = tmp_path / "hf2"
    _save_hf_dir(d2, _tiny("llama"))
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["intermediate_size"] *= 2  # weights no longer fit the config
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="wrong shape"):
        load_checkpoint(d2)
    cfg["model_type"] = "gpt2"
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported"):
        load_checkpoint(d2)
    (d2 / "model.safetensors").write_bytes(b"\x00" * 10)
    cfg["model_type"] = "llama"
    cfg["intermediate_size"] //= 2
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(d2)
