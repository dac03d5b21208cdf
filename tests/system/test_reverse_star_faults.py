"""The reverse star's fault rows (#46), with real processes and real Mosquitto: kill -9 of the hub
process mid-generation (its Mosquitto dies with it) and its restart on the same port, and a flood of
forged and replayed messages on the verify service's topics. A drafting device cannot decode alone,
so the rows ask: no token lost or repeated, nothing but the target's own text (tiny float64 model,
greedy: compared exactly), and the device recovers by itself once the hub is back.
"""
from __future__ import annotations

import threading

import pytest
import torch

from edge.wire.link import MqttLink
from edge.wire.protocol import VerifyRequest, encode, up_topic
from server.broker import find_free_port

from harness.reverse_star import MAX_NEW, PROMPT, close, drafter, hub_cmd, reference
from harness.star_processes import Procs, hf_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("reverse-faults") / "tiny-hf")


@pytest.fixture
def procs(model):
    ps = Procs(model.parent)
    yield ps
    ps.close()


def test_hub_killed_mid_generation_and_restarted_loses_no_token(model, procs):
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    procs.start("hub", *hub_cmd(model, port))
    procs.wait_for("hub", "serving on", 300)
    dev = drafter(model, url, "pi-k")
    seen, restarted = [], threading.Event()

    def on_token(t):
        seen.append(t)
        if len(seen) == 10 and not restarted.is_set():     # mid-generation: kill -9, then start it again
            restarted.set()
            procs.kill9("hub")
            procs.start("hub", *hub_cmd(model, port))
    try:
        r = dev.generate(PROMPT, MAX_NEW, on_token=on_token)
        assert restarted.is_set()
        assert r.tokens == seen == reference(model)         # every token once, each the target's
        assert dev.counts["rejoined"] >= 1
        again = dev.generate(PROMPT, 12)                   # healed: the next generation drafts at once
        assert again.tokens == reference(model)[:12] and again.n_accepted > 0
    finally:
        close(dev)


def test_a_flood_on_the_verify_topics_changes_nothing(model, procs):
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    procs.start("hub", *hub_cmd(model, port))
    procs.wait_for("hub", "serving on", 300)
    dev = drafter(model, url, "pi-f")
    spy = MqttLink(url, client_id="flood").connect(30)
    stop, sent = threading.Event(), [0]

    def flood():
        s = next(iter(dev.hub.sessions.values()))
        forged = encode(VerifyRequest(s.sid, 10**9, 0, [1, 2, 3], [4, 5]), b"z" * 32)       # a wrong key
        n = 0
        while not stop.is_set() and n < 20000:
            spy.publish(up_topic("pi-f", s.sid, s.draft), forged, kind="draft")
            spy.publish(up_topic("pi-f", s.sid, s.draft), b"\x93not msgpack", kind="draft")
            n += 2
            sent[0] = n
    try:
        dev.check_join()                                   # a session to aim at
        t = threading.Thread(target=flood)
        t.start()
        r = dev.generate(PROMPT, MAX_NEW)
        stop.set()
        t.join(30)
        assert r.tokens == reference(model) and sent[0] > 0
    finally:
        stop.set()
        spy.close()
        close(dev)
