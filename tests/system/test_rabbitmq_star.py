"""The StarSD star on a real 3-node RabbitMQ 3.10 cluster (issue 38): MQTT 3.1.1, TLS with
certificate login, per-user topic permissions, no cluster-wide retained messages and none
through wildcards -- the hub finds its draft service by discovery (request and answer).

The hub, the draft service and the target sit on three different broker nodes (SmolLM2-135M
on llama.cpp for both: greedy speculation is lossless, so the star's text must be the plain
greedy text, and the same as the star's on Mosquitto). Then kill -9 of the broker node the
target is attached to, mid-generation: the target moves to the next node of its list, goes on
speculating, and its text still equals the no-fault text (0 tokens lost). The recovery time
(kill -> link back, kill -> first draft answered again) is printed, not asserted.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from edge.engines.loader import load_engine
from edge.spec.generate import generate_plain
from edge.star.draft_node import DraftNode
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.session import HubClient
from edge.star.target import StarTarget
from edge.wire.link import MqttLink
from edge.wire.protocol import draft_hello_topic
from harness.rabbitmq import RabbitCluster
from harness.waiting import wait_until
from server.hub import Hub

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make install)")
GGUF = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FP = "smollm2-135m-gguf"          # one tokenizer: draft and target load the same file
PROMPT = [1, 504, 3458, 282, 4649, 314, 216]
MAX_NEW = 96


def _engine():
    return load_engine(GGUF, backend="llamacpp", threads=1, max_len=512)


@pytest.fixture(scope="module")
def want():
    return generate_plain(_engine(), PROMPT, MAX_NEW).tokens


@pytest.fixture(scope="module")
def cluster():
    c = RabbitCluster(size=3, tls=True)
    try:
        c.start(clients=["hub", "draft1", "t1", "t2"])
        c.add_user("hub", "hub")
        c.add_user("draft1", "draft")
        for t in ("t1", "t2"):
            c.add_user(t, "client")
        yield c
    finally:
        c.close()


class Star:
    """A hub, a remote draft service and one target, each on its own link (maybe its own node)."""

    def __init__(self, hub_link, draft_link, target_link, client: str):
        self.links = [hub_link, draft_link, target_link]
        self.node = DraftNode(DraftService(_engine(), DraftLimits(ahead=False), name="draft1"), draft_link,
                              "draft1", FP, hello_every=3600.0)     # no periodic hello: discovery must find it
        draft_link.set_will(draft_hello_topic("draft1"), self.node.will())
        draft_link.connect(20)
        self.node.start()                                           # announced before the hub exists
        self.hub = Hub(link=hub_link, sun=False, status_every=1.0).start()
        self.target = StarTarget(_engine(), HubClient(target_link.connect(20), client, FP, 49152), gamma=4)

    def close(self) -> None:
        self.node.stop(announce=False)
        self.hub.stop()
        for link in self.links:
            link.close()


def _run(star: Star, on_token=None) -> list:
    assert wait_until(lambda: "draft1" in star.hub.registry.online_services(), 20), \
        f"the hub never found the draft service: {star.hub.registry.snapshot()}"
    return star.target.generate(PROMPT, MAX_NEW, on_token=on_token).tokens


def test_star_on_mosquitto_gives_the_greedy_text(mosquitto, want, request):
    star = Star(MqttLink(mosquitto.url), MqttLink(mosquitto.url), MqttLink(mosquitto.url), "m1")
    try:
        assert _run(star) == want
        assert star.target.last_drafter.stats.answered > 0          # it did speculate through the star
    finally:
        star.close()


def test_star_across_three_rabbitmq_nodes_gives_the_same_text(cluster, want):
    c = cluster
    star = Star(MqttLink(c.urls(0, 1, 2), tls=c.tls_files("hub")),
                MqttLink(c.urls(2, 0, 1), tls=c.tls_files("draft1")),
                MqttLink(c.urls(1, 2, 0), tls=c.tls_files("t1")), "t1")
    try:
        assert _run(star) == want
        assert star.target.last_drafter.stats.answered > 0
        assert star.hub.discovery.sent >= 1
        assert [ln.port for ln in star.links] == [c.nodes[i].mqtt_port for i in (0, 2, 1)]
    finally:
        star.close()


def test_kill_9_of_the_targets_broker_node_loses_no_token(cluster, want):
    c = cluster
    target_link = MqttLink(c.urls(1, 2, 0), tls=c.tls_files("t2"), reconnect_delay=(0.05, 0.5))
    star = Star(MqttLink(c.urls(0, 2), tls=c.tls_files("hub")), MqttLink(c.urls(2, 0), tls=c.tls_files("draft1")),
                target_link, "t2")
    states, killed, seen = [], threading.Event(), {}
    target_link.on_connection(lambda up: states.append((up, time.monotonic())))
    progress = [0]

    def tick(_):
        progress[0] += 1
        time.sleep(0.03)                      # a slow device: the fault lands mid-generation
        st = star.target.last_drafter.stats
        if killed.is_set() and "drafting" not in seen and st.answered > seen["answered"]:
            seen["drafting"] = time.monotonic()

    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("tokens", _run(star, tick)))
    try:
        worker.start()
        assert wait_until(lambda: progress[0] >= 15, 60)
        seen["answered"] = star.target.last_drafter.stats.answered
        t_kill = time.monotonic()
        c.kill(1)                             # the node the target is attached to
        killed.set()
        worker.join(120)
        assert not worker.is_alive()
        assert out["tokens"] == want          # 0 tokens lost, the same greedy text
        assert target_link.brokers.failovers >= 1 and target_link.port == c.nodes[2].mqtt_port
        back = [t for up, t in states if up and t > t_kill]
        assert back, f"the target's link never came back: {states}"
        assert "drafting" in seen, "the target never speculated again after the failover"
        print(f"\nbroker node kill -9: target link back after {back[0] - t_kill:.2f} s, "
              f"drafting again after {seen['drafting'] - t_kill:.2f} s "
              f"(rejoins {star.target.last_drafter.stats.rejoins}, timeouts {star.target.last_drafter.stats.timeouts})")
    finally:
        star.close()
