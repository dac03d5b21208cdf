"""`edge-hub serve` as a client of an external clustered broker over TLS (issue 38): a real hub
process on a real 3-node RabbitMQ cluster that logs clients in by their certificate (CN = user)
and holds each user to its topic permissions. The broker list and the TLS directory come from
the hub's TOML config (the spelling of `edge-agent run --broker A,B --tls-dir DIR`).

The hub must come up on the first node, announce itself (its status reaches a client on
another node: the broker let the hub's certificate in and let it publish as a hub), move to
the next node of its list when its node is killed (-9) and announce itself again from there,
then leave cleanly on SIGTERM (an offline status). Bad combinations are refused before
anything starts, each saying what to write instead.
"""
from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge.wire.envelope import decode
from edge.wire.link import MqttLink
from edge.wire.protocol import HubStatus
from edge.wire.topics import STATUS_TOPIC
from harness.console_scripts import BIN, Procs
from harness.rabbitmq import tls_cluster
from harness.waiting import wait_until
from server.hub_serve import serve


@pytest.fixture(scope="module")
def cluster():
    with tls_cluster({"hub": "hub", "watcher": "client"}) as c:
        yield c


def _refusal(*args: str) -> str:
    r = CliRunner().invoke(serve, list(args))
    assert r.exit_code == 2, r.output
    return r.output


def test_bad_combinations_are_refused_with_what_to_write(tmp_path):
    out = _refusal("--broker", "mqtts://localhost:8883,mqtts://localhost:8884")
    assert "--tls-dir DIR" in out and "hub.crt" in out
    out = _refusal("--broker", "mqtt://localhost:1883", "--tls-dir", str(tmp_path))
    assert "mqtts://" in out and "drop --tls-dir" in out
    out = _refusal("--broker", "mqtts://localhost:8883,mqtt://localhost:1883", "--tls-dir", str(tmp_path))
    assert "mixes mqtt:// and mqtts://" in out
    out = _refusal("--broker", "mqtts://localhost:8883", "--tls-dir", str(tmp_path), "--hub-id", "hubA")
    assert "hubA.crt" in out and "edge-hub certs" in out            # no such certificate in the directory
    out = _refusal("--broker", "mqtts://localhost:8883", "--tls-dir", str(tmp_path), "--listen", "0.0.0.0")
    assert "--listen" in out and "not with --broker" in out


def _statuses(link: MqttLink) -> list:
    seen: list = []
    link.subscribe(STATUS_TOPIC, lambda t, p: seen.append((decode(p), time.monotonic())))
    return seen


def test_edge_hub_serve_on_an_mqtts_broker_list_from_its_config(cluster):
    c = cluster
    root = Path(tempfile.mkdtemp(prefix="starsun-hubtls-"))
    urls = [c.nodes[0].url(True), c.nodes[1].url(True)]
    (root / "hub.toml").write_text(
        f'[broker]\nbroker = ["{urls[0]}", "{urls[1]}"]\ntls_dir = "{c.certs}"\n[hub]\nhub_id = "hub"\n'
        "stats_every = 0\n")
    watcher = MqttLink(c.urls(2), tls=c.tls_files("watcher")).connect(20)
    seen = _statuses(watcher)
    procs = Procs(root)
    try:
        procs.start("hub", BIN / "edge-hub", "-v", "serve", "--config", root / "hub.toml")
        procs.wait_for("hub", "serving on", 60)
        assert wait_until(lambda: any(isinstance(s, HubStatus) and s.online and s.hub == "hub" for s, _ in seen),
                          60), f"no online status of the hub reached node 3: {seen}\n{procs.err('hub')}"
        t_kill = time.monotonic()
        c.kill(0)                             # the hub's node
        # the hub's link says when it is on the next node (edge/wire/link.py); a status that reaches
        # node 3 after that was sent from there, not one of the first node's late
        procs.wait_for("hub", "moved to broker", 60)
        moved = len(seen)
        assert wait_until(lambda: any(s.online for s, _ in seen[moved:]), 60), \
            f"the hub never announced itself again after its node died:\n{procs.err('hub')}"
        back = next(t for s, t in seen[moved:] if s.online)
        print(f"\nhub's broker node kill -9: its status again on another node after {back - t_kill:.2f} s")
        procs.procs["hub"].send_signal(signal.SIGTERM)
        assert procs.procs["hub"].wait(30) == 0, procs.err("hub")
        assert wait_until(lambda: any(not s.online for s, _ in seen), 10), "the hub left without an offline status"
    finally:
        procs.close()
        watcher.close()
