"""Constrained output through the star (edge/star/draft_grammar.py, the wire's grammar fields).

The target sends its grammar with its draft requests; the hub's draft service proposes under it.
Greedy: the text through the star equals plain constrained decoding (float64 tiny transformers,
a JSON schema, the in-memory bus), with the draft proposing under the grammar (accepted drafts)
and with a service that cannot apply grammars (it drafts unconstrained, still the same text).
Sampling: chi-square of seeded outputs through the star against the enumerated constrained
distribution. Both with tokens the grammar forces taken without a target call (jump-forward,
edge/speculative/jump_forward.py): the draft service learns them from the next request's context
and drafts after them. The service refuses grammars it cannot use with a clear bad_grammar error.
"""
import pytest

llg = pytest.importorskip("llguidance")

from edge.speculative.generate import generate_plain  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_id, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY, SamplingParams  # noqa: E402
from edge.star.draft_service import DraftLimits, DraftService  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.star.target import Deadline, StarTarget  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from edge.wire.protocol import E_BAD_GRAMMAR, DraftRequest, DraftResponse, Error, sampling  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.goodness_of_fit import TableEngine, chi_square, critical_value  # noqa: E402
from harness.grammars import (FORCED_LARK, SCHEMA, bpe_tokenizer, constrained_distribution, tiny_grammar,  # noqa: E402
                              tiny_pair)

TOK = "tok-constrained"
PATIENT = Deadline(5.0, 5.0, 5.0)     # every round gets its drafts, however loaded the machine


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")


def star(target, draft_core):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=draft_core, tokenizer_fp=TOK, status_every=60.0).start()
    return hub, StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", TOK, target.vocab_size), gamma=3)


@pytest.mark.parametrize("applied", ["now", "lazy", None],
                         ids=["service-applies-grammar", "tokenizer-made-at-first-grammar", "service-without-tokenizer"])
def test_greedy_constrained_through_the_star_equals_plain(bpe, applied):
    target, draft = tiny_pair(bpe.vocab_size)
    tok = grammar_tokenizer(bpe, target.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), tok)
    prompt = bpe.encode("give json: ")
    want = generate_plain(target, prompt, 80, GREEDY, grammar=grammar)
    made = {"now": tok, "lazy": lambda: grammar_tokenizer(bpe, target.vocab_size), None: None}[applied]
    svc = DraftService(draft, DraftLimits(), name="hub-draft", grammar_tokenizer=made)
    hub, st = star(target, svc)
    try:
        for _ in range(2):                     # a second generation: a new session, the grammar kept compiled
            got = st.generate(prompt, 80, GREEDY, deadline=PATIENT, grammar=grammar)
            assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token)
            assert got.n_drafted > 0
            # forced tokens (keys, punctuation) taken without a call: fewer calls than tokens not forced
            assert got.n_forced > 0 and got.n_verify_calls <= got.n_generated - got.n_forced
        counters = svc.stats.snapshot()["counters"]
        if applied:
            assert counters.get("grammars_compiled") == 1, counters
            assert got.n_accepted > 0
        else:
            assert counters.get("grammar_unapplied", 0) > 0, counters
        # the same star unconstrained afterwards: the plain text again
        assert st.generate(prompt, 12, GREEDY, deadline=PATIENT).tokens == generate_plain(target, prompt, 12).tokens
    finally:
        st.hub.link.close()
        hub.stop()


@pytest.mark.parametrize("ahead", [False, True], ids=["on-request", "with-draft-ahead"])
def test_sampled_constrained_through_the_star_is_lossless(ahead):
    target, draft = TableEngine(vocab=5, seed=1), TableEngine(vocab=5, seed=7)
    grammar = tiny_grammar(FORCED_LARK)              # a token forced mid-text: jump-forward
    prompt, length, n = [1, 3, 0], 4, 3000
    hub, st = star(target, DraftService(draft, DraftLimits(q_top_k=5, ahead=ahead), name="hub-draft",
                                        grammar_tokenizer=grammar.tokenizer))
    counts, drafted, accepted, forced = {}, 0, 0, 0
    try:
        for i in range(n):
            r = st.generate(prompt, length, SamplingParams(temperature=1.0, seed=30_000 + i),
                            deadline=PATIENT, grammar=grammar)
            key = (tuple(r.tokens), r.stop_token)
            counts[key] = counts.get(key, 0) + 1
            drafted, accepted, forced = drafted + r.n_drafted, accepted + r.n_accepted, forced + r.n_forced
    finally:
        st.hub.link.close()
        hub.stop()
    want = constrained_distribution(target, prompt, length, SamplingParams(temperature=1.0), grammar)
    stat, df = chi_square(counts, want, n)
    assert drafted >= n and accepted > 0 and forced > 100, (drafted, accepted, forced)
    assert stat < critical_value(df), f"chi2={stat:.1f} (df={df}): constrained star sampling is not lossless"


def _answer(svc, req):
    svc.submit(req)
    return [m for _, m in svc.step()]


def test_the_service_refuses_a_grammar_it_cannot_use(bpe):
    target, draft = tiny_pair(bpe.vocab_size)
    svc = DraftService(draft, DraftLimits(ahead=False), grammar_tokenizer=grammar_tokenizer(bpe))
    svc.open("s")
    prompt = bpe.encode("json: ")
    good = grammar_from_json_schema(SCHEMA)
    cases = [("0123456789abcdef", "", "not known here"),                       # an id alone, never sent
             (grammar_id(good), good + " ", "does not hash"),                   # text and id disagree
             (grammar_id('{"grammars": 1}'), '{"grammars": 1}', "refused")]      # not a grammar
    for seq, (gid, text, why) in enumerate(cases, 1):
        (msg,) = _answer(svc, DraftRequest("s", seq, 0, prompt, 2, sampling(), False, None, gid, text, len(prompt)))
        assert isinstance(msg, Error) and msg.code == E_BAD_GRAMMAR and why in msg.message, msg
    (msg,) = _answer(svc, DraftRequest("s", 9, 0, prompt, 3, sampling(), False, None, grammar_id(good), good,
                                       len(prompt)))
    assert isinstance(msg, DraftResponse) and bpe.decode(msg.tokens).startswith("{")   # it keeps serving


def test_a_grammar_the_service_refuses_means_decoding_alone(bpe, monkeypatch):
    from edge.star.draft_grammar import DraftGrammars
    from edge.star.draft_limits import DraftRefused

    def refuse(self, s, req, stats):
        if req.grammar_id:
            raise DraftRefused("this service cannot compile it", E_BAD_GRAMMAR)
        s.grammar = None
    monkeypatch.setattr(DraftGrammars, "apply", refuse)
    target, draft = tiny_pair(bpe.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), grammar_tokenizer(bpe, target.vocab_size))
    prompt = bpe.encode("give json: ")
    want = generate_plain(target, prompt, 80, GREEDY, grammar=grammar)
    hub, st = star(target, DraftService(draft, DraftLimits(), name="hub-draft"))
    try:
        got = st.generate(prompt, 80, GREEDY, deadline=PATIENT, grammar=grammar)
        assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token)
        stats = st.last_drafter.stats
        assert stats.errors == 1 and got.n_drafted == 0, stats      # asked once, then decoded alone
        # the next generation without a grammar drafts again
        assert st.generate(prompt, 12, GREEDY, deadline=PATIENT).n_drafted > 0
    finally:
        st.hub.link.close()
        hub.stop()
