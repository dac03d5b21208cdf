"""The star across a Mosquitto bridge (issue 38): the hub and the draft service on the hub's
broker, the target on a site broker bridged to it (`ss/#` both ways): its joins, draft requests
and answers and the hub's status all cross the bridge, and its greedy text must be the plain
greedy text. Then kill -9 of the site broker mid-generation:
the target moves to the hub's broker (its list: site, hub) and loses no token."""
from __future__ import annotations

import threading
import time

import pytest

from edge.speculative.generate import generate_plain
from edge.wire.link import MqttLink
from harness.gguf_star import MAX_NEW, PROMPT, Star, engine
from harness.mosquitto_bridge import SiteBroker
from harness.waiting import wait_until
from server.mosquitto import MosquittoBroker

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make install)")


@pytest.fixture(scope="module")
def want():
    return generate_plain(engine(), PROMPT, MAX_NEW).tokens


@pytest.fixture
def brokers():
    hub = MosquittoBroker().start()
    site = SiteBroker(hub).start()
    try:
        assert site.bridged(), f"the site's bridge never came up: {site.log_tail()}"
        yield hub, site
    finally:
        site.close()
        hub.close()


def test_star_through_a_bridge_gives_the_greedy_text(brokers, want):
    hub, site = brokers
    star = Star(MqttLink(hub.url), MqttLink(hub.url), MqttLink(site.url), "site-t1")
    try:
        assert star.run() == want
        assert star.target.last_drafter.stats.answered > 0         # it speculated through the bridge
    finally:
        star.close()


def test_kill_9_of_the_site_broker_loses_no_token(brokers, want):
    hub, site = brokers
    target_link = MqttLink(f"{site.url},{hub.url}", reconnect_delay=(0.05, 0.5))
    star = Star(MqttLink(hub.url), MqttLink(hub.url), target_link, "site-t2")
    states, progress, seen = [], [0], {}
    target_link.on_connection(lambda up: states.append((up, time.monotonic())))

    def tick(_):
        progress[0] += 1
        time.sleep(0.03)
        if "t_kill" in seen and "drafting" not in seen and star.target.last_drafter.stats.answered > seen["answered"]:
            seen["drafting"] = time.monotonic()

    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("tokens", star.run(tick)))
    try:
        worker.start()
        assert wait_until(lambda: progress[0] >= 15, 60)
        seen["answered"] = star.target.last_drafter.stats.answered
        seen["t_kill"] = t_kill = time.monotonic()
        site.proc.kill()
        worker.join(120)
        assert not worker.is_alive()
        assert out["tokens"] == want
        assert target_link.port == hub.port and target_link.brokers.failovers >= 1
        back = [t for up, t in states if up and t > t_kill]
        assert back and "drafting" in seen, f"no recovery: {states} {seen}"
        print(f"\nsite broker kill -9: target on the hub's broker after {back[0] - t_kill:.2f} s, "
              f"drafting again after {seen['drafting'] - t_kill:.2f} s")
    finally:
        star.close()
