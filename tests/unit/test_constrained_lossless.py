"""Constrained speculation stays lossless (edge/speculative/constrained.py, edge/speculative/grammar.py).

Under a grammar the target's distribution is the constrained one (forbidden tokens masked,
then renormalised). Greedy: speculative output equals plain constrained decoding exactly
(float64 tiny transformers, a JSON schema over a real byte-level BPE). Sampling: a 5-token table
model under a small Lark grammar; its exact constrained distribution over whole outputs (stop
included) is enumerated and compared with a chi-square test at alpha = 1e-4, with a draft that
proposes under the grammar and with one that ignores it (the loop verifies its legal prefix and
the first refused token, rejected for sure). A negative control drops that refused token instead
(a choice made on the drawn token) and must fail the very same test.
"""
import json

import pytest

llg = pytest.importorskip("llguidance")

import edge.speculative.generate as gen  # noqa: E402
from edge.speculative.constrained import legal_drafts  # noqa: E402
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative  # noqa: E402
from edge.speculative.grammar import Grammar, GrammarError, grammar_from_json_schema, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY, SamplingParams  # noqa: E402

from harness.goodness_of_fit import TableEngine, bad_draft_of, chi_square, critical_value  # noqa: E402
from harness.grammars import EOS, SCHEMA, bpe_tokenizer, constrained_distribution, tiny_grammar, tiny_pair  # noqa: E402

HOT = SamplingParams(temperature=1.0)


class FreeDrafter(ModelDrafter):
    """A draft that ignores the grammar: its proposals are often illegal."""

    def constrain(self, grammar, start):
        pass


PROMPT = [1, 3, 0]
N = 12_000


def fit(drafter, n=N, length=4, gamma=3):
    target = TableEngine(vocab=5, seed=1)
    grammar = tiny_grammar()
    want = constrained_distribution(target, PROMPT, length, HOT, grammar)
    counts = {}
    for i in range(n):
        p = SamplingParams(temperature=1.0, seed=20_000 + i)
        r = generate_speculative(target, drafter(target), PROMPT, length, gamma, p, grammar=grammar)
        key = (tuple(r.tokens), r.stop_token)
        counts[key] = counts.get(key, 0) + 1
    stat, df = chi_square(counts, want, n)
    return stat, df, critical_value(df)


def test_sampled_constrained_speculation_is_lossless():
    stat, df, crit = fit(lambda t: ModelDrafter(bad_draft_of(t), HOT))
    assert df >= 20, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): constrained speculation is not lossless"


def test_a_draft_ignoring_the_grammar_is_still_lossless():
    stat, df, crit = fit(lambda t: FreeDrafter(bad_draft_of(t), HOT))
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df})"


def test_negative_control_dropping_the_refused_draft_fails(monkeypatch):
    # the bug: the first refused draft is dropped (a choice made on the drawn token itself)
    def drop_refused(matcher, drafts, qs):
        kept, kept_q, masks = legal_drafts(matcher, drafts, qs)
        if kept and masks[-1] is masks[-2] and len(masks) >= 2:
            return kept[:-1], kept_q[:-1], masks[:-1]
        return kept, kept_q, masks
    monkeypatch.setattr(gen, "legal_drafts", drop_refused)
    stat, df, crit = fit(lambda t: FreeDrafter(bad_draft_of(t), HOT), n=6000)
    assert stat > crit, f"chi2={stat:.1f} < {crit:.1f}: the test cannot tell an unmasked verifier"


def test_plain_sampling_follows_the_grammar():
    target, grammar = TableEngine(vocab=5, seed=1), tiny_grammar()
    for i in range(50):
        r = generate_plain(target, PROMPT, 12, SamplingParams(temperature=1.0, seed=i), grammar=grammar)
        text = "".join("abc"[t] if t < 3 else "ab" for t in r.tokens)
        if r.stop_token is not None:
            assert r.stop_token == EOS and text[-1] == "c" and set(text[:-1]) <= {"a", "b"}
        else:                                      # max_new came first: "c" can only end it
            assert r.n_generated == 12 and "c" not in text[:-1]


# ------------------------------------------------ greedy: float64 transformers, a JSON schema

@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")


def test_greedy_constrained_speculation_equals_plain(bpe):
    target, draft = tiny_pair(bpe.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), grammar_tokenizer(bpe, target.vocab_size))
    prompt = bpe.encode("give json: ")
    want = generate_plain(target, prompt, 80, GREEDY, grammar=grammar)
    assert want.stop_token in grammar.stop_ids, "the schema is bounded: greedy must finish it"
    json.loads(bpe.decode(want.tokens))            # it is JSON (the schema check is test_structured's)
    drafter = ModelDrafter(draft)
    for gamma in (1, 3, 5):
        got = generate_speculative(target, drafter, prompt, 80, gamma, GREEDY, grammar=grammar)
        assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token), gamma
        assert got.n_accepted > 0                  # the draft proposed under the grammar and was heard
    free = generate_speculative(target, FreeDrafter(draft), prompt, 80, 3, GREEDY, grammar=grammar)
    assert (free.tokens, free.stop_token) == (want.tokens, want.stop_token)
    # the drafter is reusable unconstrained: the next call without a grammar is the plain text
    assert generate_speculative(target, drafter, prompt, 20, 3).tokens == generate_plain(target, prompt, 20).tokens


def test_legal_drafts_keeps_the_first_refused_token_and_leaves_the_matcher():
    grammar = tiny_grammar()
    m = grammar.matcher()
    assert m.consume(0)
    # "c" ends the text: the "a" after it is refused (kept: rejected for sure), the "b" dropped
    drafts, qs, masks = legal_drafts(m, [1, 2, 0, 1], ["q1", "q2", "q3", "q4"])
    assert drafts == [1, 2, 0] and qs == ["q1", "q2", "q3"] and len(masks) == 4
    assert masks[2].tolist() == [False, False, False, False, True]     # after "c": only the end
    assert legal_drafts(m, [1, 0], ["q1", "q2"])[0] == [1, 0]
    assert m.tokens == [0]
    assert m.allowed().tolist() == [True, True, True, True, False]


def test_grammar_refusals_are_clear(bpe):
    tok = grammar_tokenizer(bpe)
    with pytest.raises(GrammarError, match="refused"):
        Grammar(grammar_from_json_schema({"type": "no-such-type"}), tok)
    with pytest.raises(GrammarError, match="over the limit"):
        grammar_from_json_schema({"enum": ["x" * 1000 + str(i) for i in range(100)]})
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammar_from_json_schema("{not json")
