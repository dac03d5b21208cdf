"""A RabbitMQ node whose port was taken between being picked and being listened on (other tests
open ports beside the `networks` ones) boots again on new ports instead of failing the cluster
(harness/rabbitmq.py: RabbitCluster._await_booted)."""
from __future__ import annotations

import socket

from harness.rabbitmq import RabbitCluster


def test_a_node_whose_mqtt_port_was_taken_boots_on_another(monkeypatch):
    held = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)     # on every address, as the node listens
    held.bind(("::", 0))
    held.listen(1)
    taken = held.getsockname()[1]
    cluster = RabbitCluster(size=1, tls=False)
    real, calls = cluster._ports, []

    def first_gets_the_taken_port(n):
        calls.append(n)
        out = real(n)
        return out[:2] + [taken] if len(calls) == 1 else out
    monkeypatch.setattr(cluster, "_ports", first_gets_the_taken_port)
    try:
        cluster.start()
        node = cluster.nodes[0]
        assert len(calls) == 2 and node.mqtt_port != taken and node.alive
        socket.create_connection((node.address, node.mqtt_port), 5).close()    # it listens
    finally:
        cluster.close()
        held.close()
