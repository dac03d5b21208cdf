"""Constrained output and logprobs through the reverse star (#46; edge/star/verify_rules.py).

The hub's verify service masks every row of a drafting device's verify call with the request's
grammar, so the committed text is the TARGET's constrained text: greedy equals plain constrained
decoding by the target alone (float64 tiny transformers, a JSON schema), with the device drafting
under the same grammar (drafts accepted, forced tokens riding along) and with a device that drafts
freely (its illegal drafts simply rejected); sampled output passes chi-square against the enumerated
constrained distribution (a grammar that forces a token mid-text). Logprobs come from the hub's rows:
equal to the target alone's, grammar or not. A hub that cannot follow grammars refuses with
bad_grammar and the device raises GrammarRefused: never unconstrained text for a constrained request.
"""
import numpy as np
import pytest

llg = pytest.importorskip("llguidance")

from edge.speculative.drafter import Drafter  # noqa: E402
from edge.speculative.generate import ModelDrafter, generate_plain  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY, SamplingParams, top_logprobs  # noqa: E402
from edge.star.drafting_device import DraftingDevice, GrammarRefused  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.goodness_of_fit import TableEngine, chi_square, critical_value  # noqa: E402
from harness.grammars import (FORCED_LARK, SCHEMA, bpe_tokenizer, constrained_distribution, tiny_grammar,  # noqa: E402
                              tiny_pair)

TOK = "tok-reverse-constrained"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")


class FreeDrafter(Drafter):
    """The draft model proposing with no grammar (constrain is ignored): most drafts illegal."""

    def __init__(self, engine, params, k):
        self.inner = ModelDrafter(engine, params, k)

    def draft(self, context, gamma, rng):
        return self.inner.draft(context, gamma, rng)

    def close(self):
        self.inner.close()


def reverse_star(target, draft, grammars, **kw):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), verify_engine=target, tokenizer_fp=TOK, status_every=60.0,
              verify_grammars=grammars).start()
    dev = DraftingDevice(draft, HubClient(MemoryLink(bus, "pi"), "pi", TOK, target.vocab_size, role="drafter"), **kw)
    return hub, dev


def stop(hub, dev):
    dev.close()
    dev.hub.close()
    hub.stop()


@pytest.mark.parametrize("drafting", ["under-the-grammar", "free"])
def test_greedy_constrained_equals_the_target_alone(bpe, drafting):
    target, draft = tiny_pair(bpe.vocab_size)
    tok = grammar_tokenizer(bpe, target.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), tok)
    prompt = bpe.encode("give json: ")
    want = generate_plain(tiny_pair(bpe.vocab_size)[0], prompt, 80, GREEDY, grammar=grammar)
    hub, dev = reverse_star(target, draft, lambda: tok, gamma=3,
                            drafter_of=(lambda p, k: FreeDrafter(draft, p, k)) if drafting == "free" else None)
    try:
        for _ in range(2):                   # the session kept for a second generation: the grammar again
            got = dev.generate(prompt, 80, GREEDY, grammar=grammar)
            assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token)
        # unconstrained afterwards on the same device: the plain text
        assert dev.generate(prompt, 12).tokens == generate_plain(tiny_pair(bpe.vocab_size)[0], prompt, 12).tokens
        c = hub.verify.snapshot()["counters"]
        assert c.get("grammars_compiled") == 1, c
        if drafting == "under-the-grammar":  # its drafts follow the grammar: forced stretches accepted whole
            assert got.n_accepted > got.n_verify_calls and got.n_verify_calls < len(got.tokens) / 2, got
    finally:
        stop(hub, dev)


def test_sampled_constrained_reverse_star_is_lossless():
    target, draft = TableEngine(vocab=5, seed=1), TableEngine(vocab=5, seed=7)
    grammar = tiny_grammar(FORCED_LARK)              # a token forced mid-text: it rides along as a draft
    prompt, length, n = [1, 3, 0], 4, 3000
    hub, dev = reverse_star(target, draft, grammar.tokenizer, gamma=2, q_top_k=5)
    counts, drafted, accepted = {}, 0, 0
    try:
        for i in range(n):
            r = dev.generate(prompt, length, SamplingParams(temperature=1.0, seed=40_000 + i), grammar=grammar)
            key = (tuple(r.tokens), r.stop_token)
            counts[key] = counts.get(key, 0) + 1
            drafted, accepted = drafted + r.n_drafted, accepted + r.n_accepted
    finally:
        stop(hub, dev)
    want = constrained_distribution(target, prompt, length, SamplingParams(temperature=1.0), grammar)
    stat, df = chi_square(counts, want, n)
    assert drafted >= n and accepted > 0, (drafted, accepted)
    assert stat < critical_value(df), f"chi2={stat:.1f} (df={df}): constrained reverse-star sampling is not lossless"


def _reference_entries(target, prompt, max_new, grammar, top_n):
    seen = []
    res = generate_plain(target, prompt, max_new, GREEDY, on_logits=lambda t, row: seen.append(
        (t, *top_logprobs(row, t, top_n))), grammar=grammar)
    return res.tokens, seen


@pytest.mark.parametrize("constrained", [False, True], ids=["free-text", "json-schema"])
def test_logprobs_are_the_targets(bpe, constrained):
    target, draft = tiny_pair(bpe.vocab_size)
    tok = grammar_tokenizer(bpe, target.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), tok) if constrained else None
    prompt = bpe.encode("give json: ")
    want_tokens, want = _reference_entries(tiny_pair(bpe.vocab_size)[0], prompt, 40, grammar, 3)
    hub, dev = reverse_star(target, draft, tok, gamma=3)
    got = []
    try:
        r = dev.generate(prompt, 40, GREEDY, grammar=grammar, logprobs=3,
                         on_logprob=lambda t, lp, alts: got.append((t, lp, alts)))
    finally:
        stop(hub, dev)
    assert r.tokens == want_tokens and [g[0] for g in got] == r.tokens and r.n_accepted > 0
    for (t, lp, alts), (wt, wlp, walts) in zip(got, want):
        assert t == wt and abs(lp - wlp) < 1e-9
        assert [a for a, _ in alts] == [a for a, _ in walts]
        assert np.allclose([x for _, x in alts], [x for _, x in walts], atol=1e-9)


def test_a_hub_without_grammars_refuses_and_keeps_serving(bpe):
    target, draft = tiny_pair(bpe.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), grammar_tokenizer(bpe, target.vocab_size))
    prompt = bpe.encode("give json: ")
    hub, dev = reverse_star(target, draft, None, gamma=3)
    try:
        emitted = []
        with pytest.raises(GrammarRefused, match="follows no grammars"):
            dev.generate(prompt, 20, GREEDY, grammar=grammar, on_token=emitted.append)
        assert emitted == []                 # nothing served, not even unconstrained text
        assert dev.generate(prompt, 8).tokens == generate_plain(tiny_pair(bpe.vocab_size)[0], prompt, 8).tokens
    finally:
        stop(hub, dev)
