"""Tiny random llamas for the role and star tests (float64: greedy outputs compare exactly), and a
small BPE tokenizer trained here for the exporter tests."""
import copy

import torch

from edge.model.transformer import Transformer, tiny_config


def tiny_model(seed=0, noise=0.0, base=None):
    """A random tiny llama; with `base`, base + noise * random (a draft close to its target)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config("llama")).double()
    for i, p in enumerate(model.parameters()):
        p.data.normal_(0, 0.2)
        if base is not None:
            p.data = list(base.parameters())[i].data + noise * p.data
    return model.eval()


def target_and_draft(noise: float = 0.05) -> tuple:
    """A tiny target and a draft close to it (seed 1, `noise` away): the star tests' pair."""
    target = tiny_model(0)
    return target, tiny_model(1, noise=noise, base=target)


def random_model(seed=0, **kw):
    """A random tiny model of tiny_config(**kw) (a SUN base)."""
    torch.manual_seed(seed)
    m = Transformer(tiny_config(**kw)).double().eval()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


def specialist(base, seed):
    """A stand-in for a tuned prefill module: the base with perturbed weights."""
    m = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return m


def small_bpe(chat_template=None):
    """A small byte-level BPE (GPT-2 pre-tokeniser, 300 tokens, 3 specials) trained here."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    from edge.model.tokenizer import Tokenizer
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test 12345",
              "def f(x):\n    return x + 1\n"] * 30
    hf.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(hf, bos_id=0, eos_id=2, pad_id=0, chat_template=chat_template)
