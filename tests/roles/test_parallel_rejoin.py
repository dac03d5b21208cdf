"""A target running --parallel N on a star whose client limit is N, back-to-back requests (#44): the
hub refused 2 of 4 joins of the second wave ("client 'dev0' already holds 4 sessions") because the
first wave's byes go to the draft service, whose loop tells the hub only after it handled them,
while the next joins go to the hub directly. harness/held_byes.py holds the byes at the service,
the order a busy service gives them; a join names the sessions its client ended (Join.ended), and
the hub releases them before it counts. A join refused for good still decodes, alone and lossless.
Tiny float64 models on the in-process bus; no sleeps, no timing asserts."""
from __future__ import annotations

import logging

import torch

from edge.engines.batched_calls import BatchedCalls
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache
from edge.star.draft_node import DraftNode
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import GREEDY_WIRE
from harness.at_once import all_at_once
from harness.draft_services import make_engine
from harness.held_byes import HeldByes
from harness.waiting import wait_until
from server.hub import Hub

torch.set_num_threads(1)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42, 7], [5, 5, 5, 17, 33, 2]]
LENGTHS = [20, 12, 16, 24]
SLOTS = 8                   # the draft service's sessions: a client may hold half, 4


def _hub(bus) -> Hub:
    return Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tiny-0",
               limits=DraftLimits(max_sessions=SLOTS, ahead=False)).start()


def test_back_to_back_waves_of_n_generations_keep_n_sessions():
    alone = [generate_plain(make_engine(0), p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    bus = MemoryBus()
    hub = _hub(bus)
    byes = HeldByes(hub.node)
    try:
        eng = BatchedCalls(make_engine(0))
        star = StarTarget(eng, HubClient(MemoryLink(bus, "dev0"), "dev0", "tiny-0", 256), gamma=3,
                          prefix_cache=PrefixCache(eng, 4))
        for wave in range(2):
            out = all_at_once([lambda i=i: star.generate(PROMPTS[i], LENGTHS[i]) for i in range(4)])
            assert [o.tokens for o in out] == alone
            assert hub.counters["refused"] == 0, f"wave {wave}: {hub.counters}"
        assert hub.registry.ended >= 3               # wave 1 ended 3 (one kept): released by wave 2's joins
        assert hub.counters["joins"] >= 4 + 3 and hub.registry.count() <= 4
    finally:
        byes.release()
        hub.stop()


def test_a_remote_service_frees_the_sessions_a_join_names():
    """A device's draft service (SessionAssign / SessionRelease over ctl): the hub releases what a join
    names at the service too, so a client cannot free its share at the hub and keep drafting."""
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), sun=False, status_every=3600.0).start()
    svc = DraftService(make_engine(), DraftLimits(max_sessions=SLOTS, ahead=False), name="d1")
    node = DraftNode(svc, MemoryLink(bus, "d1").connect(), "d1", "tiny-0", hello_every=3600.0).start()
    byes = HeldByes(node)
    try:
        assert wait_until(lambda: hub.registry.online_services() == ["d1"], 10)
        dev = HubClient(MemoryLink(bus, "dev0"), "dev0", "tiny-0", svc.vocab_size).start()
        first = [dev.join(3, GREEDY_WIRE) for _ in range(4)]
        # the service took them (their up topics): a bye sent before is lost unseen, as a bye to a session
        # not yet assigned would be (seen here under load: no bye held, none dropped)
        assert wait_until(lambda: len(svc.sessions()) == 4, 10)
        for s in first[:3]:
            s.close()
        second = [dev.join(3, GREEDY_WIRE) for _ in range(3)]     # refused before Join.ended
        assert hub.counters["refused"] == 0 and hub.registry.count() == 4
        live = {s.sid for s in first[3:] + second}
        assert wait_until(lambda: set(svc.sessions()) == live, 10)  # the ended three closed at the service
        # their byes: still held, or, where the hub's release overtook them (a loaded machine: seen
        # once in make test beside a benchmark), dropped as for sessions the service had closed
        assert wait_until(lambda: byes.count() + node.keys.dropped.get("unknown_session", 0) == 3, 10), \
            (byes.count(), dict(node.keys.dropped), node.dropped)
    finally:
        byes.release()
        node.stop()
        hub.stop()


def test_a_refused_generation_decodes_alone_and_says_so_once(caplog):
    bus = MemoryBus()
    hub = _hub(bus)
    try:
        eng = make_engine(0)
        dev = HubClient(MemoryLink(bus, "dev0"), "dev0", "tiny-0", 256)
        star = StarTarget(eng, dev, gamma=3)
        held = [dev.join(3, GREEDY_WIRE) for _ in range(SLOTS // 2)]    # the client's whole share
        with caplog.at_level(logging.INFO):
            r = star.generate(PROMPTS[1], 30)
        assert r.tokens == generate_plain(make_engine(0), PROMPTS[1], 30).tokens and r.n_drafted == 0
        said = [m for m in caplog.messages if "already holds" in m and "decoding without a draft" in m]
        assert len(said) == 1, caplog.messages
        assert star.last_drafter.refusal is not None and len(held) == hub.registry.count()
    finally:
        hub.stop()
