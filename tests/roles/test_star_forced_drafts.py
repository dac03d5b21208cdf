"""Grammar-forced tokens among a star's drafts ride along γ uncounted (edge/star/draft_chain.py,
edge/speculative/jump_forward.py with_forced).

The draft service answers a request for γ drafts with γ drafts the grammar left a choice at and
the forced ones between them (a JSON key's quotes and colon); draft-ahead goes as far past them;
the target appends the stretch forced after the last draft itself and verifies it all in one
call. Greedy through the star (float64 tiny transformers, a JSON schema, the in-memory bus) the
text equals plain constrained decoding, in fewer target calls than with forced drafts counted
against γ. The sampled chi-square through the star with forced tokens mid-text is
tests/roles/test_constrained_star.py's.
"""
import pytest

pytest.importorskip("llguidance")

import edge.speculative.generate as gen  # noqa: E402
from edge.speculative.generate import generate_plain  # noqa: E402
from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_id, grammar_tokenizer  # noqa: E402
from edge.speculative.sampling import GREEDY  # noqa: E402
from edge.star.draft_chain import BatchItem  # noqa: E402
from edge.star.draft_service import DraftLimits, DraftService  # noqa: E402
from edge.star.hub_client import HubClient  # noqa: E402
from edge.star.target import Deadline, StarTarget  # noqa: E402
from edge.wire.memory_link import MemoryBus, MemoryLink  # noqa: E402
from edge.wire.protocol import DraftRequest, DraftResponse, sampling  # noqa: E402
from server.hub import Hub  # noqa: E402

from harness.grammars import SCHEMA, bpe_tokenizer, tiny_pair  # noqa: E402

TOK = "tok-forced"
PATIENT = Deadline(5.0, 5.0, 5.0)     # every round gets its drafts, however loaded the machine


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    bpe = bpe_tokenizer(tmp_path_factory.mktemp("tok") / "t")
    target, draft = tiny_pair(bpe.vocab_size)
    grammar = Grammar(grammar_from_json_schema(SCHEMA), grammar_tokenizer(bpe, target.vocab_size))
    return bpe, target, draft, grammar, bpe.encode("give json: ")


def choices(grammar, tokens):
    """Which of `tokens` (from the grammar's start) had a choice: the grammar allowed others too."""
    m, out = grammar.matcher(), []
    for t in tokens:
        out.append(m.only_token() is None)
        assert m.consume(t)
    return out


def test_an_answer_holds_gamma_choices_and_the_forced_tokens_between(case):
    bpe, _, draft, grammar, prompt = case
    svc = DraftService(draft, DraftLimits(ahead=True), grammar_tokenizer=grammar.tokenizer)
    svc.open("s")
    for gamma in (1, 2, 3):
        svc.submit(DraftRequest("s", gamma, 0, prompt, gamma, sampling(), False, None, grammar.id,
                                grammar.text, len(prompt)))
        (_, msg), = svc.step()
        assert isinstance(msg, DraftResponse)
        had = choices(grammar, msg.tokens)
        assert sum(had) == gamma and had[-1] and len(msg.tokens) > gamma, (gamma, had)
    # draft-ahead then runs past the answer by 2γ+1 choices, forced tokens on top
    steps = 0
    while svc.has_work() and steps < 60:
        svc.step()
        steps += 1
    s = svc._sessions["s"]
    chain = [c[0] for c in s.chain]
    assert sum(choices(grammar, chain)) == 2 * 3 + 1 and any(c[3] for c in s.chain), chain
    # the next request, along the chain past forced tokens, is answered from it without a step
    ctx = prompt + chain[:4]
    svc.submit(DraftRequest("s", 9, len(prompt), chain[:4], 3, sampling(), False, None, grammar.id, "",
                            len(prompt)))
    (_, msg), = svc.step()
    assert msg.tokens == chain[4:4 + len(msg.tokens)] and sum(choices(grammar, ctx[len(prompt):] + msg.tokens)) \
        == sum(choices(grammar, ctx[len(prompt):])) + 3
    assert svc.stats.snapshot()["counters"].get("ahead_hit", 0) >= 1


def test_forced_entries_extend_a_request_up_to_the_wire_cap():
    from edge.star.draft_chain import DraftSession
    from edge.wire.protocol import MAX_GAMMA
    s = DraftSession("s", 0.0)
    s.anchor, s.chain = 10, [(1, None, 1.0, i % 2 == 0) for i in range(6)]   # forced, free, forced, ...
    assert s.end_after(10, 2) == (14, 10 + MAX_GAMMA)                # two free ones: positions 11 and 13
    assert s.end_after(12, 5) == (19, 12 + MAX_GAMMA)                # 13, 15 free in the chain, then 16..18
    w = BatchItem(s, object(), [], s.plan(10, 1, background=False), None, 0)
    s.chain = []
    for _ in range(3 * MAX_GAMMA):
        w.forced_taken()
    assert w.want == 10 + MAX_GAMMA and s.ahead_cap == 10 + MAX_GAMMA


def _star(target, svc):
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_core=svc, tokenizer_fp=TOK, status_every=60.0).start()
    return hub, StarTarget(target, HubClient(MemoryLink(bus, "t1"), "t1", TOK, target.vocab_size), gamma=2)


def test_greedy_through_the_star_equals_plain_in_fewer_calls(case, monkeypatch):
    _, target, draft, grammar, prompt = case
    want = generate_plain(target, prompt, 80, GREEDY, grammar=grammar)
    hub, st = _star(target, DraftService(draft, DraftLimits(), grammar_tokenizer=grammar.tokenizer))
    try:
        got = st.generate(prompt, 80, GREEDY, deadline=PATIENT, grammar=grammar)
        with monkeypatch.context() as m:     # forced drafts counted against γ on both sides
            m.setattr(gen, "with_forced", lambda matcher, drafts, qs, masks, g, cap: (
                drafts[:g], qs[:g], masks[:min(len(drafts), g) + 1], [False] * min(len(drafts), g)))
            m.setattr(BatchItem, "forced_taken", lambda self: None)
            counted = st.generate(prompt, 80, GREEDY, deadline=PATIENT, grammar=grammar)
    finally:
        st.hub.link.close()
        hub.stop()
    assert (got.tokens, got.stop_token) == (want.tokens, want.stop_token) == (counted.tokens, counted.stop_token)
    assert got.n_accepted > 0
    assert got.n_verify_calls < counted.n_verify_calls, (got.n_verify_calls, counted.n_verify_calls)
