"""Jump-forward (edge/speculative/jump_forward.py): tokens the grammar forces are committed
without a target call of their own, and the output does not change.

Greedy (float64 tiny transformers, a JSON schema over a byte-level BPE): plain and speculative
decoding with jump-forward equal plain decoding without it (every token from the target's own
row), token for token, stop token and logprobs included (a forced token's is 0.0, no
alternative); the forced tokens are counted and the target calls drop by exactly as many in
plain decoding. Sampling: a 5-token table model under a grammar that forces a token mid-text;
the outputs of plain and speculative decoding pass the chi-square test against the enumerated
constrained distribution, forced tokens taken. A negative control verifies a round's drafts
against the rows of the forced tokens' positions instead (the off-by-pending bug) and must fail it.
"""
import pytest

pytest.importorskip("llguidance")

import edge.speculative.generate as gen  # noqa: E402
from edge.api.logprobs import LogprobRecorder  # noqa: E402
from edge.speculative.constrained import ConstrainedProposer, legal_drafts  # noqa: E402
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative  # noqa: E402
from edge.speculative.jump_forward import with_forced  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY, SamplingParams  # noqa: E402

from harness.goodness_of_fit import TableEngine, bad_draft_of, chi_square, critical_value  # noqa: E402
from harness.grammars import (FORCED_LARK, SCHEMA, bpe_tokenizer, constrained_distribution, tiny_grammar,  # noqa: E402
                              tiny_pair)

HOT = SamplingParams(temperature=1.0)
PROMPT = [1, 3, 0]


@pytest.fixture
def no_jump(monkeypatch):
    """Run a callable with jump-forward off: every token from a target call of its own."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(gen, "jump_forward", lambda run, matcher: 0)
            return fn()
    return run


def counted_forced(m):
    """Forced tokens among the drafts count against γ (the draft proposes them one by one, the
    target appends none): jump-forward as it first landed."""
    m.setattr(gen, "with_forced", lambda matcher, drafts, qs, masks, g, cap: (
        drafts[:g], qs[:g], masks[:min(len(drafts), g) + 1], [False] * min(len(drafts), g)))
    m.setattr(ConstrainedProposer, "forced", lambda self, limit: [])


@pytest.fixture
def forced_off(monkeypatch):
    """Run a callable with nothing forced: no jump-forward, forced drafts counted against γ."""
    def run(fn, jump=False):
        with monkeypatch.context() as m:
            counted_forced(m)
            if not jump:
                m.setattr(gen, "jump_forward", lambda run, matcher: 0)
            return fn()
    return run


@pytest.fixture(scope="module")
def json_case(tmp_path_factory):
    bpe = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    target, draft = tiny_pair(bpe.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), grammar_tokenizer(bpe, target.vocab_size))
    return bpe, target, draft, grammar, bpe.encode("give json: ")


def _with_logprobs(bpe, fn):
    rec = LogprobRecorder(bpe, 3)
    return fn(rec.on_logits), rec.entries


def same_logprobs(got, want) -> bool:
    """The same tokens and alternatives, logprobs to float64's last bits (a call over several
    tokens sums in another order than one over one)."""
    def flat(entries, close):
        return [[t, close(lp), *(close(x) for a in alts for x in a)] for t, lp, alts in entries]
    return flat(want, lambda x: pytest.approx(x, rel=1e-12, abs=1e-12)) == flat(got, lambda x: x)


def test_plain_decoding_takes_forced_tokens_without_a_call(json_case, no_jump):
    bpe, target, _, grammar, prompt = json_case
    want, want_lp = no_jump(lambda: _with_logprobs(bpe, lambda lp: generate_plain(
        target, prompt, 80, GREEDY, grammar=grammar, on_logits=lp)))
    got, got_lp = _with_logprobs(bpe, lambda lp: generate_plain(target, prompt, 80, GREEDY, grammar=grammar,
                                                                on_logits=lp))
    assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token)
    assert want.n_forced == 0 and want.n_verify_calls == want.n_generated
    assert got.n_forced >= 10, got.n_forced                  # keys, quotes, colons, the end
    assert got.n_verify_calls == got.n_generated - got.n_forced
    assert same_logprobs(got_lp, want_lp)                     # the same rows, the same logprobs
    forced = [e for e in got_lp if e[1] == 0.0]
    assert len(forced) >= 9 and all(alts == [(t, 0.0)] for t, _, alts in forced)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_decoding_jumps_forward_and_equals_plain(json_case, no_jump, forced_off, gamma):
    bpe, target, draft, grammar, prompt = json_case
    want, want_lp = no_jump(lambda: _with_logprobs(bpe, lambda lp: generate_plain(
        target, prompt, 80, GREEDY, grammar=grammar, on_logits=lp)))
    def spec():
        return generate_speculative(target, ModelDrafter(draft), prompt, 80, gamma, GREEDY, grammar=grammar)
    before, counted, unjumped = forced_off(spec), forced_off(spec, jump=True), no_jump(spec)
    got, got_lp = _with_logprobs(bpe, lambda lp: generate_speculative(
        target, ModelDrafter(draft), prompt, 80, gamma, GREEDY, grammar=grammar, on_logits=lp))
    for other in (before, counted, unjumped):
        assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token) == (other.tokens, other.stop_token)
    assert same_logprobs(got_lp, want_lp)
    assert got.n_forced > 0 and got.n_accepted > 0 and unjumped.n_forced > 0    # drafts' forced ones count
    calls = [r.n_verify_calls for r in (got, counted, before)]
    assert calls[0] < calls[1] < calls[2], calls      # forced drafts on top of γ pay, and jump-forward
    assert got.n_verify_calls <= unjumped.n_verify_calls


def test_forced_drafts_are_appended_after_the_last_choice_and_not_counted():
    grammar = tiny_grammar(FORCED_LARK)                # after "c" the grammar forces "b"
    m = grammar.matcher()
    drafts, qs, masks = legal_drafts(m, [0, 2], ["qa", "qc"])
    got, got_q, got_masks, forced = with_forced(m, drafts, qs, masks, unforced=2, limit=8)
    assert got == [0, 2, 1] and forced == [False, False, True] and len(got_masks) == 4
    assert got_q[:2] == ["qa", "qc"] and got_q[2].indices.tolist() == [1]
    assert m.tokens == [] and m.allowed().tolist() == [True, True, False, True, False]
    # "c" first is refused: kept (rejected for sure), nothing appended after it
    d, q, k = legal_drafts(m, [2, 1, 0], ["q"] * 3)
    assert with_forced(m, d, q, k, 1, 8)[0] == [2]
    # one choice only: the forced "b" after "c" comes on top of it; the limit cuts it
    m.consume(0)
    d, q, k = legal_drafts(m, [2, 1, 0], ["q"] * 3)
    assert with_forced(m, d, q, k, 1, 8)[0] == [2, 1] and with_forced(m, d, q, k, 1, 1)[0] == [2]
    assert with_forced(m, d, q, k, 2, 8)[3] == [False, True, False]


def test_forced_tokens_stop_at_max_new(json_case):
    _, target, draft, grammar, prompt = json_case
    for n in (1, 2, 3):           # the schema's text starts with forced tokens: max_new cuts them
        r = generate_plain(target, prompt, n, GREEDY, grammar=grammar)
        assert r.n_generated == n and r.finish_reason == "length" and r.n_verify_calls == 0
        s = generate_speculative(target, ModelDrafter(draft), prompt, n, 3, GREEDY, grammar=grammar)
        assert s.tokens == r.tokens and s.n_verify_calls == 0


# ------------------------------------------------ sampled: chi-square with forced tokens mid-text

def fit(run, n, length=4):
    target, grammar = TableEngine(vocab=5, seed=1), tiny_grammar(FORCED_LARK)
    want = constrained_distribution(target, PROMPT, length, HOT, grammar)
    counts, forced = {}, 0
    for i in range(n):
        r = run(target, grammar, length, SamplingParams(temperature=1.0, seed=40_000 + i))
        key = (tuple(r.tokens), r.stop_token)
        counts[key] = counts.get(key, 0) + 1
        forced += r.n_forced
    stat, df = chi_square(counts, want, n)
    return stat, df, critical_value(df), forced


def speculative(target, grammar, length, params):
    return generate_speculative(target, ModelDrafter(bad_draft_of(target), HOT), PROMPT, length, 3, params,
                                grammar=grammar)


def test_sampled_plain_decoding_with_forced_tokens_is_lossless():
    stat, df, crit, forced = fit(lambda t, g, n, p: generate_plain(t, PROMPT, n, p, grammar=g), 6000)
    assert forced > 300 and df >= 20, (forced, df)
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df})"


def test_sampled_speculation_with_forced_tokens_is_lossless():
    stat, df, crit, forced = fit(speculative, 8000)
    assert forced > 300 and df >= 20, (forced, df)
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): jump-forward under speculation is not lossless"


def test_sampled_speculation_with_forced_drafts_only_is_lossless(monkeypatch):
    # jump-forward off: every forced token comes as a draft (proposed through, or appended by the target)
    monkeypatch.setattr(gen, "jump_forward", lambda run, matcher: 0)
    stat, df, crit, forced = fit(speculative, 6000)
    assert forced > 300 and df >= 20, (forced, df)
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): forced drafts on top of γ are not lossless"


def test_negative_control_verifying_against_the_forced_tokens_rows_fails(monkeypatch):
    # the bug: the round's first rows (those of the forced tokens' positions) verify the drafts
    monkeypatch.setattr(gen, "verified_rows", lambda run, pending, drafts: run.forward(pending + drafts)[
        :len(drafts) + 1])
    stat, df, crit, _ = fit(speculative, 3000)
    assert stat > crit, f"chi2={stat:.1f} < {crit:.1f}: the test cannot tell rows of the wrong positions"
