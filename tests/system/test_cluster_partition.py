"""A node of the 3-node RabbitMQ cluster hung (SIGSTOP) while a StarSD target sits on it (issue 38).

A hung node -- its VM stopped, every TCP connection to it open and silent, no reset to tell
anyone -- on loopback ports, with the real SmolLM2 GGUF target: the fault a stuck or swapped-out
broker host gives, and one that needs no root. The real partition (the node's packets vanish,
its app paused by pause_minority, two hubs, leak checks) is tests/system/test_cluster_netns_partition.py,
in network namespaces.

The target (real SmolLM2-135M GGUF on llama.cpp, greedy: speculation is lossless) is attached to
that node first; the hub and the draft service to the others. Mid-generation the node goes
silent: the target decodes alone, then its link's keepalive gives up and it fails over; its text
equals the no-fault greedy text. Healed (SIGCONT), the cluster lists its three nodes running and
a target attached to the healed node first speculates through the star again.
"""
from __future__ import annotations

import threading
import time

import pytest

from edge.wire.link import MqttLink
from harness.gguf_star import Star, greedy_tokens
from harness.rabbitmq import tls_cluster
from harness.waiting import wait_until

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make install)")


@pytest.fixture(scope="module")
def want():
    return greedy_tokens()


@pytest.fixture(scope="module")
def cluster():
    with tls_cluster({"hub": "hub", "draft1": "draft", "t1": "client", "t2": "client"}) as c:
        yield c


def _star(c, target: str) -> tuple[Star, MqttLink]:
    link = MqttLink(c.urls(2, 0, 1), tls=c.tls_files(target), keepalive=5, reconnect_delay=(0.05, 0.5))
    return Star(MqttLink(c.urls(0, 1), tls=c.tls_files("hub")), MqttLink(c.urls(1, 0), tls=c.tls_files("draft1")),
                link, target), link


def test_target_on_a_silenced_node_keeps_the_greedy_text_and_the_star_heals(cluster, want):
    c = cluster
    star, link = _star(c, "t1")
    states, progress, out = [], [0], {}
    link.on_connection(lambda up: states.append((up, time.monotonic())))

    def tick(_):
        progress[0] += 1
        time.sleep(0.15)                      # a slow device: the silence lands mid-generation
    worker = threading.Thread(target=lambda: out.setdefault("tokens", star.run(tick)))
    try:
        worker.start()
        assert wait_until(lambda: progress[0] >= 10, 60)
        t_cut = time.monotonic()
        c.suspend(2)                          # the target's node: silent, its sockets open
        worker.join(180)
        assert not worker.is_alive()
        assert out["tokens"] == want          # 0 tokens lost, the same greedy text
        back = [t for up, t in states if up and t > t_cut]
        print(f"\nnode silenced: target done {time.monotonic() - t_cut:.2f} s after the cut; link on another "
              f"node after {back[0] - t_cut:.2f} s" if back else "\nnode silenced: the target finished alone "
              "before its link gave up on the node")
    finally:
        c.resume(2)
        star.close()
    names = sorted(n.node for n in c.nodes)
    assert wait_until(lambda: c.running_nodes(0) == names and c.running_nodes(2) == names, 180), \
        (c.running_nodes(0), c.running_nodes(2))
    healed, _ = _star(c, "t2")                # attached to the healed node first
    try:
        assert healed.run() == want
        assert healed.target.last_drafter.stats.answered > 0, "no speculation through the healed node"
    finally:
        healed.close()
