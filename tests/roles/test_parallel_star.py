"""A StarSD target generating several requests at once (--parallel): each on its own hub session, their
verify calls batched on one engine (edge/engines/batched_calls.py); token for token the target's greedy
output alone (tiny float64 models on a memory bus); with a prompt cache one session is kept, and a
generation takes it only when free."""
from __future__ import annotations


import torch

from edge.engines.batched_calls import BatchedCalls
from edge.speculative.generate import generate_plain
from edge.speculative.prefix_cache import PrefixCache
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.memory_link import MemoryBus, MemoryLink
from harness.at_once import all_at_once
from harness.draft_services import make_engine
from server.hub import Hub

torch.set_num_threads(1)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42, 7], [5, 5, 5, 17, 33, 2]]
LENGTHS = [30, 12, 25, 40]


def test_four_generations_at_once_through_the_star_equal_the_target_alone():
    alone = [generate_plain(make_engine(0), p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok").start()
    try:
        eng = BatchedCalls(make_engine(0))
        star = StarTarget(eng, HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=3,
                          prefix_cache=PrefixCache(eng, 4))
        for _ in range(2):
            out = all_at_once([lambda i=i: star.generate(PROMPTS[i], LENGTHS[i]) for i in range(4)])
            assert [o.tokens for o in out] == alone
        assert sum(o.n_drafted for o in out) > 0 and star.active == 0              # the star drafted
        assert star.counts["generations"] == 8 and len(star._kept) == 1       # one session kept
        assert eng.stats["forwards"] > eng.stats["rounds"]                     # rounds served several
    finally:
        hub.stop()


def test_four_adaptive_generations_price_their_shared_rounds_and_equal_the_target_alone():
    """γ=auto on a shared engine: each policy reads how many generations share the rounds and is fed
    whole rounds' costs (edge/speculative/remote_gamma.py); the output is the target's alone."""
    alone = [generate_plain(make_engine(0), p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok").start()
    try:
        eng = BatchedCalls(make_engine(0))
        star = StarTarget(eng, HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256), gamma=4, adaptive=True)
        out = all_at_once([lambda i=i: star.generate(PROMPTS[i], LENGTHS[i]) for i in range(4)])
        assert [o.tokens for o in out] == alone
        assert star.last_drafter.policy.sharing is not None and eng.sharing() == 1     # all left
    finally:
        hub.stop()
