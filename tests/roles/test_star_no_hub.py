"""A target whose broker has no hub: one join waits its join_timeout, the requests after it decode
alone at once (their drafters join in the background), and once a hub speaks the next request joins
and drafts (edge/star/target.py StarTarget._connect). Greedy output is the target's alone throughout."""
import threading

import torch

from edge.speculative.generate import generate_plain
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.memory_link import MemoryBus, MemoryLink
from harness.draft_services import make_engine
from server.hub import Hub

torch.set_num_threads(1)
PROMPT = [1, 2, 3, 4]


class _CountingHubClient(HubClient):
    """Counts the joins a caller waits for (HubClient.join), not the background ones (join_async)."""
    waited = 0

    def join(self, *a, **kw):
        self.waited += 1
        return super().join(*a, **kw)


def _no_hub_then_a_hub(client, hub_came, make_hub):
    """One waited join with no hub, none for three more requests, a waited join once a hub spoke."""
    want = generate_plain(make_engine(seed=0), PROMPT, 12).tokens
    star = StarTarget(make_engine(seed=0), client, gamma=3, join_timeout=0.2)
    try:
        assert star.generate(PROMPT, 12).tokens == want          # the one join that waited: unanswered
        assert client.waited == 1
        for _ in range(3):                                        # then no request waits for it
            assert star.generate(PROMPT, 12).tokens == want
        assert client.waited == 1
        spoke = threading.Event()
        client.on_hub_change(lambda: hub_came() and spoke.set())
        hub = make_hub().start()
        try:
            assert spoke.wait(60)                                 # the hub spoke
            got = star.generate(PROMPT, 12)
            assert got.tokens == want and client.waited == 2      # joined, waiting for the answer
            assert star.last_drafter.stats.answered > 0 and got.n_drafted > 0
        finally:
            hub.stop()
    finally:
        star.hub.close()


def test_no_hub_costs_one_join_wait_and_a_hub_that_comes_is_joined():
    bus = MemoryBus()
    client = _CountingHubClient(MemoryLink(bus, "t1"), "t1", "tok", 256)
    _no_hub_then_a_hub(client, lambda: client.status is not None and client.status.online,
                       lambda: Hub(link=MemoryLink(bus, "hub"), draft_engine=make_engine(seed=1), tokenizer_fp="tok"))


def test_with_several_hubs_a_hub_that_comes_is_joined_too():
    """The same with the star's hubs named (HubWatch): there is no one hub status to compare, so a hub's
    announcement must count as its speaking. Before, a target cut off from every hub (a partitioned
    broker node) joined again only if a background join beat its generation's end: under load, never."""
    bus = MemoryBus()
    client = _CountingHubClient(MemoryLink(bus, "t1"), "t1", "tok", 256, hubs=("ha",))
    _no_hub_then_a_hub(client, lambda: client.hub_online,
                       lambda: Hub(link=MemoryLink(bus, "ha"), draft_engine=make_engine(seed=1), tokenizer_fp="tok",
                                   hub_id="ha", hubs=("ha",)))
