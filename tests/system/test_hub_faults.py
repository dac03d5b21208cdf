"""Faults: the hub dies mid-generation and comes back; a target vanishes."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.wire.link import MqttLink
from edge.star.draft_service import DraftLimits
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from server.broker import find_free_port
from server.hub import Hub

from harness.tiny_models import target_and_draft
from harness.waiting import wait_until

torch.set_num_threads(1)
TOK = "tok-tiny"


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


@pytest.mark.parametrize("kind", ["mosquitto", "embedded"])
def test_hub_killed_mid_generation_targets_finish_and_rejoin(kind, models, request):
    target_model, draft_model = models
    if kind == "mosquitto":      # an external broker: the hub's last will says it is gone
        url = request.getfixturevalue("mosquitto").url
        where = {"broker_url": url}
    else:                        # the hub's own embedded broker dies with it
        port = find_free_port()
        url, where = f"mqtt://127.0.0.1:{port}", {"broker": "embedded", "port": port}

    def new_hub():
        return Hub(**where, draft_engine=TorchEngine(draft_model, "draft"), tokenizer_fp=TOK).start()

    hub = new_hub()
    n, max_new = 3, 150
    stars = [StarTarget(TorchEngine(target_model, "target"),
                        HubClient(MqttLink(url, reconnect_delay=(0.05, 0.2)).connect(5), f"f{i}", TOK, 256),
                        gamma=3)
             for i in range(n)]
    prompts = [[3 + i, 14, 15, 9] for i in range(n)]
    want = [generate_plain(s.engine, p, max_new).tokens for s, p in zip(stars, prompts)]
    progress, got, errors = [0] * n, [None] * n, []
    killed = threading.Event()

    def run(i):
        def tick(_):
            # a slow device, so the outage lands mid-generation and the hub is back
            # before the end; once it speculates again it may run at full speed
            progress[i] += 1
            st = stars[i].last_drafter.stats
            if not killed.is_set():
                time.sleep(0.004)
            elif st.rejoins == 0 or st.answered_since_join == 0:
                time.sleep(0.02)
        try:
            got[i] = stars[i].generate(prompts[i], max_new, on_token=tick)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    hub2 = None
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: min(progress) >= 15, 20)
        killed.set()
        hub.kill()
        time.sleep(0.3)
        hub2 = new_hub()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i in range(n):
            assert got[i].tokens == want[i], f"target {i}: the outage changed the output"
            st = stars[i].last_drafter.stats
            assert st.rejoins >= 1, st
            assert st.answered_since_join > 0, "no speculation after the hub came back"
        assert hub2.snapshot()["draft"]["requests"] > 0
    finally:
        for s in stars:
            s.hub.link.close()
        (hub2 or hub).stop()


def test_vanished_target_is_evicted_and_its_kv_freed(mosquitto, models):
    target_model, draft_model = models
    hub = Hub(broker_url=mosquitto.url, draft_engine=TorchEngine(draft_model, "draft"), tokenizer_fp=TOK,
              limits=DraftLimits(evict_after_s=0.5)).start()
    link = MqttLink(mosquitto.url).connect(5)
    star = StarTarget(TorchEngine(target_model, "target"), HubClient(link, "ghost", TOK, 256), gamma=3)
    svc = hub.service
    try:
        def tick(_):
            if svc.sessions() and svc.engine.active_sequences and link.is_connected():
                link.crash()                       # the device drops off the network mid-generation
        out = star.generate([1, 2, 3], 40, on_token=tick)
        assert out.tokens == generate_plain(star.engine, [1, 2, 3], 40).tokens
        assert not link.is_connected()
        # evicted within the timeout (0.5 s) plus the loop's check period, with slack for CI
        assert wait_until(lambda: not svc.sessions() and svc.engine.active_sequences == 0, 3)
        assert hub.registry.count() == 0
        assert svc.stats.counters.get("closed_timeout") == 1
    finally:
        link.close()
        hub.stop()


def test_overloaded_draft_service_is_left_alone_with_a_backoff(memory_bus, models):
    """A draft service at its KV limit answers 'overloaded': the target decodes alone (same output)
    and backs off instead of asking again every round."""
    from edge.wire.memory_link import MemoryLink
    target_model, draft_model = models
    hub = Hub(link=MemoryLink(memory_bus), draft_engine=TorchEngine(draft_model, "draft"), tokenizer_fp=TOK,
              limits=DraftLimits(ahead=False, max_kv_mb=0.01)).start()     # ~40 tokens of tiny KV
    star = StarTarget(TorchEngine(target_model, fingerprint="target"),
                      HubClient(MemoryLink(memory_bus).connect(), "busy", TOK, 256), gamma=3)
    try:
        prompt = [(5 * j) % 256 for j in range(60)]                       # over the limit at once
        out = star.generate(prompt, 40)
        assert out.tokens == generate_plain(star.engine, prompt, 40).tokens
        st = star.last_drafter.stats
        assert st.overloaded >= 1 and st.answered == 0, st
        assert st.overloaded <= 8 < st.rounds, st                    # not one request per round
    finally:
        star.hub.close()
        hub.stop()
