"""RemoteDrafter.observe: greedy probes in the background, scored against the target's own
tokens, never waited for (edge/star/remote_drafter.py); a real hub on the memory bus."""
from __future__ import annotations

import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.star.remote_drafter import RemoteDrafter
from edge.star.hub_client import HubClient
from edge.speculative.sampling import GREEDY
from server.hub import Hub

from harness.tiny_models import tiny_model
from harness.waiting import wait_until

torch.set_num_threads(1)
PROMPT = [1, 2, 3, 4]


def probed(continuations):
    """Send one 4-draft probe after PROMPT; then, for each context in `continuations` (tokens the
    target decoded after PROMPT), poll until the answer is in; what observe() returned for each."""
    model = tiny_model(0)
    want = generate_plain(TorchEngine(model, "ref"), PROMPT, 6).tokens    # the draft's greedy text
    bus = MemoryBus()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=TorchEngine(model, "draft"), tokenizer_fp="tok").start()
    try:
        hc = HubClient(MemoryLink(bus, "t1"), "t1", "tok", 256).start()
        assert wait_until(lambda: hc.hub_online, 10)
        d = RemoteDrafter(hc, GREEDY.to_wire(), 4)
        d.connect()
        sent = []
        send = d.session.send
        d.session.send = lambda m: sent.append(m) or send(m)
        assert d.observe(PROMPT, 0) is None and d.stats.probes == 0     # nothing asked: nothing sent
        assert d.observe(PROMPT, 4) is None and d.stats.probes == 1
        assert [m.background for m in sent] == [True]                     # the service knows it is a probe
        assert wait_until(lambda: d.observe(PROMPT, 4) is not None or d.stats.answered == 1)
        assert d.stats.probes == 1                                      # one out at a time
        out = [d.observe(PROMPT + c(want), 4) for c in continuations]
        assert d.stats.probe_answers == d.stats.answered == 1 and d.stats.rounds == 0  # no round
        d.close()
        return out, want
    finally:
        hub.stop()


def test_a_probe_that_agrees_scores_all_its_drafts_once_the_target_decoded_them():
    out, _ = probed([lambda w: w[:2], lambda w: w[:3], lambda w: w[:4]])
    assert out == [None, None, (4, 4)]            # not scored before the target decoded all 4


def test_a_probe_is_scored_at_the_first_token_the_target_decoded_otherwise():
    out, want = probed([lambda w: [w[0], (w[1] + 1) % 256]])
    assert out == [(4, 1)]                        # what a greedy verify would have accepted
