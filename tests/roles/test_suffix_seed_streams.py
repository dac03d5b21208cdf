"""Sampling through the star with the suffix draft is exactly the target's distribution.

A tiny table target (its distribution over 4-token continuations is enumerable) samples
THROUGH THE STAR -- a hub whose draft service is the model-free SuffixDraftService (and the
hybrid with a table draft model), on the in-memory bus and once over a real Mosquitto --
and a chi-square test at alpha=1e-4 compares the counts with the exact distribution (4 tokens: the
first is the target's own, from its prefill, so a shorter one never sends the service its output). The
fleet tree learns from every generation, so its proposals are accepted often. A negative
control makes the service lie about q (uniform instead of the point mass it drew from)
and must fail the same test.
"""
import numpy as np
import pytest

import edge.star.suffix_service as suffix_mod
from edge.wire.link import MqttLink
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hybrid_service import HybridDraftService
from edge.star.hub_client import HubClient
from edge.star.suffix_service import SuffixDraftService
from edge.star.target import StarTarget
from edge.speculative.sampling import SamplingParams
from server.hub import Hub

from harness.goodness_of_fit import TableEngine
from harness.star_sampling import memory_links, seeded_fit

PROMPT = [1, 3, 0]
TOK = "tok-table"
HOT = SamplingParams(temperature=1.0)
VOCAB = 4


def core_of(kind):
    if kind == "suffix":
        return SuffixDraftService(VOCAB, DraftLimits(ahead=False), name="hub-draft")
    return HybridDraftService(DraftService(TableEngine(vocab=VOCAB, seed=7), DraftLimits(q_top_k=4, ahead=False)),
                              min_score=1.0, name="hub-draft")


def star_fit(net, n, kind="suffix", length=4, gamma=2):
    """n seeded generations through a hub with a suffix / hybrid draft -> (chi2, df, critical, stats)."""
    where, link_of = net
    target = TableEngine(vocab=VOCAB, seed=1)
    core = core_of(kind)
    hub = Hub(**where, draft_core=core, tokenizer_fp=TOK, status_every=60.0).start()
    try:
        star = StarTarget(target, HubClient(link_of("t1"), "t1", TOK, VOCAB), gamma=gamma)
        stat, df, crit, stats = seeded_fit(star, target, PROMPT, length, n, 20_000, HOT)
        stats["counters"] = core.stats.snapshot()["counters"]
        star.hub.link.close()
    finally:
        hub.stop()
    return stat, df, crit, stats


N = 4000


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_sampling_through_the_star_with_the_suffix_draft_is_lossless(kind):
    stat, df, crit, st = star_fit(memory_links(), N, kind)
    print(f"{kind}: chi2={stat:.1f} df={df} crit={crit:.1f} accepted {st['accepted']}/{st['drafted']} "
          f"{st['counters']}")
    assert st["drafted"] >= N // 2 and st["accepted"] > 0.1 * st["drafted"], st
    if kind == "hybrid":
        c = st["counters"]
        assert c.get("hybrid_suffix", 0) > 0 and c.get("hybrid_model", 0) > 0, c
    assert df >= 30, df
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): suffix drafting through the star is not lossless"


def test_negative_control_a_q_that_lies_fails(monkeypatch):
    # the service claims q is uniform, but it proposed deterministically: acceptance
    # min(1, p/q) is then wrong and the output distribution is not the target's
    monkeypatch.setattr(suffix_mod, "point_mass_q", lambda toks: [
        (np.arange(VOCAB, dtype=np.int64), np.full(VOCAB, 1.0 / VOCAB)) for _ in toks])
    stat, df, crit, _ = star_fit(memory_links(), N // 2)
    print(f"lying q: chi2={stat:.1f} df={df} crit={crit:.1f}")
    assert stat > crit, f"a wrong q passed (chi2={stat:.1f} < {crit:.1f}): the test has no power"


@pytest.fixture
def own_mosquitto():
    """A broker of this test's own: the shared one carries other tests' retained hellos and sessions."""
    from server.broker import MosquittoBroker
    broker = MosquittoBroker().start()
    yield broker
    broker.close()


def test_sampling_over_mosquitto_with_the_suffix_draft_is_lossless(own_mosquitto):
    mosquitto = own_mosquitto

    def link_of(name):
        return MqttLink(mosquitto.url, client_id=f"suffix-seeds-{name}").connect(5)
    stat, df, crit, st = star_fit(({"broker_url": mosquitto.url}, link_of), 1500)
    print(f"mosquitto: chi2={stat:.1f} df={df} crit={crit:.1f} {st['accepted']}/{st['drafted']}")
    assert st["drafted"] >= 700, st
    assert stat < crit, f"chi2={stat:.1f} >= {crit:.1f} (df={df}): suffix drafting over Mosquitto is not lossless"
