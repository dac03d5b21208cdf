"""A StarSD target with a prompt cache (edge/speculative/prefix_cache.py, edge/star/session_reuse.py):
a conversation's next turn reuses the target's KV and keeps its hub session, so the draft
service reuses its KV too (its first request names keep = what the draft holds); the text is the
target's exactly (float64 tiny llamas on the memory bus)."""
from __future__ import annotations

import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache
from edge.star.hub_client import HubClient, Session
from edge.star.target import StarTarget
from edge.wire.memory_link import MemoryBus, MemoryLink
from server.hub import Hub

from harness.tiny_models import tiny_model

torch.set_num_threads(1)
SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(60)]


class Feeds(TorchEngine):
    """The draft engine, recording how many tokens each prefill call feeds."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefills = []

    def forward_last(self, seq, tokens):
        self.prefills.append(len(tokens))
        return super().forward_last(seq, tokens)


class Recorded(Session):
    sent: list = []

    def request(self, seq, keep, append, gamma, sampling, background=False, p_min=None, grammar=("", "", 0)):
        self.sent.append((self.sid, seq, keep, len(append)))
        return super().request(seq, keep, append, gamma, sampling, background, p_min, grammar)


class RecordingHubClient(HubClient):
    session_type = Recorded


def star(cache: bool = True, **kw):
    target_model = tiny_model(0)
    bus = MemoryBus()
    draft = Feeds(tiny_model(1, noise=0.02, base=target_model), "draft")
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=draft, tokenizer_fp="tok").start()
    engine = TorchEngine(target_model, "target")
    Recorded.sent = []
    st = StarTarget(engine, RecordingHubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=3,
                    prefix_cache=PrefixCache(engine) if cache else None, **kw)
    return st, hub, draft, target_model


def cold(model, prompt, n):
    return generate_plain(TorchEngine(model, "cold"), prompt, n).tokens


def test_the_next_turn_reuses_the_targets_and_the_drafts_kv():
    st, hub, draft, model = star()
    try:
        turn1 = SYSTEM + [4, 5]
        r1 = st.generate(turn1, 16)
        assert r1.tokens == cold(model, turn1, 16) and r1.cached_tokens == 0 and r1.n_accepted > 0
        sid = Recorded.sent[0][0]
        assert Recorded.sent[0][2] == 0                         # the first request: the draft holds nothing
        first_turn = len(Recorded.sent)
        draft.prefills.clear()
        turn2 = turn1 + r1.tokens + [9, 10, 11]
        r2 = st.generate(turn2, 16)
        assert r2.tokens == cold(model, turn2, 16)
        assert r2.cached_tokens == len(turn1) + len(r1.tokens) - 1     # the target's own KV
        assert st.last_drafter.stats.joins == 0 and st.last_drafter.stats.answered > 0
        sids, _, keep, append = zip(*Recorded.sent[first_turn:])
        assert set(sids) == {sid}                               # the same hub session, kept open
        assert keep[0] >= len(turn1)                            # the draft holds the whole first turn ...
        assert keep[0] + append[0] == len(turn2)
        assert sum(draft.prefills) <= len(turn2) - len(turn1)   # ... and prefills only the rest
    finally:
        hub.stop()


def test_conversations_in_turn_each_find_their_own_session():
    """--parallel 2 keeps two sessions: two agents sharing a system prompt, taking turns, each resume
    the session whose draft holds their own conversation (not the other's, not a new join)."""
    st, hub, draft, model = star(keep_sessions=2)
    try:
        turns = {c: SYSTEM + [c, c + 1] for c in (4, 40)}
        sids = {}
        for c, t in turns.items():
            r = st.generate(t, 12)
            assert r.tokens == cold(model, t, 12)
            sids[c] = Recorded.sent[-1][0]
            turns[c] = t + r.tokens + [c + 2, c + 3]
        assert sids[4] != sids[40] and len(st._kept) == 2
        for c, t in turns.items():
            first = len(Recorded.sent)
            r = st.generate(t, 12)
            assert r.tokens == cold(model, t, 12) and st.last_drafter.stats.joins == 0
            sid, _, keep, append = Recorded.sent[first]
            # the draft holds this conversation's first turn (all but its last tokens), far past the
            # system prompt the two share
            assert sid == sids[c] and keep + append == len(t) and keep >= len(t) - 5 > len(SYSTEM) + 2
        assert len(st.hub.sessions) == 2                         # never more than --parallel held
    finally:
        hub.stop()


def test_a_stale_or_lost_session_is_joined_again():
    st, hub, _, model = star(keep_session_s=0.0)               # every kept session is stale at once
    try:
        st.generate(SYSTEM, 6)
        sid = Recorded.sent[0][0]
        r = st.generate(SYSTEM + [1], 6)
        assert r.tokens == cold(model, SYSTEM + [1], 6)
        assert st.last_drafter.stats.joins == 1 and Recorded.sent[-1][0] != sid
        assert sid not in st.hub.sessions                       # the stale one was closed (bye)
        st.keep_session_s = 60.0
        st.generate(SYSTEM + [2], 6)
        st._kept[0].session.mark_lost()                         # e.g. the hub restarted
        st.generate(SYSTEM + [3], 6)
        assert st.last_drafter.stats.joins == 1
    finally:
        hub.stop()


def test_without_a_prompt_cache_each_generation_has_its_own_session():
    st, hub, _, model = star(cache=False)
    try:
        r1 = st.generate(SYSTEM, 6)
        r2 = st.generate(SYSTEM, 6)
        assert r1.tokens == r2.tokens == cold(model, SYSTEM, 6) and r2.cached_tokens == 0
        assert len({s for s, *_ in Recorded.sent}) == 2 and not st.hub.sessions
        assert st.engine.active_sequences == 0
    finally:
        hub.stop()
