"""What the constrained-output tests share: a five-token vocabulary llguidance can match (a, b,
c, ab and an end token), small Lark grammars over it (one forces a token mid-text), the exact
constrained distribution of a table model's outputs by enumeration, a pair of float64 tiny
transformers and a JSON schema."""
import numpy as np

from edge.speculative.constrained import mask_logits
from edge.speculative.grammar import Grammar, grammar_from_lark
from edge.speculative.sampling import to_probs

EOS = 4
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"enum": [1, 22, 333]}}}


class _TinyVocab:
    """Five tokens as llguidance's TokenizerWrapper wants them."""
    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"ab", b"\xff<eos>"]
    special_token_ids = [EOS]

    def __call__(self, s):
        s = s.decode() if isinstance(s, bytes) else s
        return ["abc".index(ch) for ch in s]


# forced tokens mid-text: after the first "c" only "b" may come (one token, probability 1: jump-forward)
FORCED_LARK = r'start: /(a|b)+/ "cb" /(a|b)*/ "c"'


def tiny_grammar(lark=r"start: /(a|b)+c/"):
    """A grammar over the five-token vocabulary: a's and b's, then one c, then the end."""
    import llguidance as llg
    tok = llg.LLTokenizer(llg.TokenizerWrapper(_TinyVocab()), slices=[])
    return Grammar(grammar_from_lark(lark), tok)


def constrained_distribution(target, prompt, length, params, grammar):
    """P(output) for every output of at most `length` tokens under the grammar, by enumeration:
    an output is (tokens, stop token or None)."""
    out = {}

    def walk(ctx, toks, prob, matcher):
        if len(toks) == length:
            out[(tuple(toks), None)] = out.get((tuple(toks), None), 0.0) + prob
            return
        p = to_probs(mask_logits(target.row(ctx), matcher.allowed()), params)
        for t in np.flatnonzero(p > 0):
            t = int(t)
            if t in grammar.stop_ids:
                out[(tuple(toks), t)] = prob * p[t]
                continue
            assert matcher.consume(t)
            walk(ctx + [t], toks + [t], prob * p[t], matcher)
            matcher.rollback(1)

    walk(list(prompt), [], 1.0, grammar.matcher())
    assert abs(sum(out.values()) - 1.0) < 1e-9
    return out


def tiny_pair(vocab, max_len=256):
    """(target, draft): float64 tiny llamas, the draft the target plus a little noise."""
    import torch

    from edge.engines.torch_engine import TorchEngine
    from edge.model.transformer import Transformer, tiny_config
    engines = []
    for noise in (0.0, 0.03):
        torch.manual_seed(3)
        model = Transformer(tiny_config("llama", vocab_size=vocab)).double()
        for p in model.parameters():
            p.data.normal_(0, 0.2)
        if noise:
            g = torch.Generator().manual_seed(99)
            for p in model.parameters():
                p.data.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise)
        engines.append(TorchEngine(model, fingerprint=f"tiny-json-{noise}", max_len=max_len))
    return engines


def bpe_tokenizer(directory):
    """harness/tiny_hf.py's byte-level BPE (262 tokens), saved in `directory` and loaded back."""
    from edge.model.tokenizer import Tokenizer
    from harness.tiny_hf import tokenizer_dir
    tokenizer_dir(directory)
    return Tokenizer.from_hf_dir(directory)
