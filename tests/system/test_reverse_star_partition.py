"""The reverse star's partition rows (#46): a drafting device reaches the hub's Mosquitto through a
TCP proxy (harness/delay_proxy.py) that holds every byte both ways while the cable is "out".

* A cut shorter than the keepalive (TCP keeps the connection; the device resends its round every
  resend_after s, and those copies reach the hub together after the heal): every token once, each
  the target's (tiny float64 model, greedy: exact), and the next generation drafts at once.
* A cut longer than the device's answer_timeout: the generation stops with HubUnavailable, having
  printed only a prefix of the target's text (never a draft token of its own), and once the cable
  is back the same device serves the whole text again.
"""
from __future__ import annotations

import threading

import pytest
import torch

from edge.star.drafting_device import HubUnavailable
from harness.delay_proxy import ProxyThread
from harness.reverse_star import MAX_NEW, PROMPT, close, drafter, hub_cmd, reference
from harness.star_processes import Procs, hf_model
from server.broker import find_free_port

torch.set_num_threads(1)
CUT_S = 3.0           # how long the cable is out: shorter than the MQTT keepalive, longer than a round


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("reverse-partition") / "tiny-hf")


@pytest.fixture(scope="module")
def star(model):
    """A hub with a verify service on its own Mosquitto, a proxy in front of that broker, and the
    target's own text."""
    ps = Procs(model.parent)
    port = find_free_port()
    ps.start("hub", *hub_cmd(model, port))
    ps.wait_for("hub", "serving on", 300)
    try:
        with ProxyThread(("127.0.0.1", port)) as proxy:
            yield proxy, reference(model)
    finally:
        ps.close()


def _cut(proxy, out_s: float):
    """The cable goes out now: every byte read from here on is held until out_s after the cut (and
    delivered then, in order, as TCP delivers what it retransmits after a partition heals)."""
    proxy.set(f"{out_s * 1000:g} 0")
    heal = threading.Timer(out_s, proxy.set, ("none",))
    heal.start()
    return heal


def test_a_short_cut_mid_generation_loses_no_token(model, star):
    proxy, ref = star
    dev = drafter(model, f"mqtt://127.0.0.1:{proxy.port}", "pi-cut")
    seen, heal = [], []

    def on_token(t):
        seen.append(t)
        if len(seen) == 10:                     # mid-generation
            heal.append(_cut(proxy, CUT_S))
    try:
        r = dev.generate(PROMPT, MAX_NEW, on_token=on_token)
        assert r.tokens == seen == ref          # every token once, each the target's
        assert dev.counts["resent"] >= 1        # the cut was felt: a round went unanswered and was resent
        again = dev.generate(PROMPT, 12)        # healed: the next generation drafts at once
        assert again.tokens == ref[:12] and again.n_accepted > 0
    finally:
        for h in heal:
            h.cancel()
        proxy.set("none")
        close(dev)


def test_a_cut_past_the_answer_timeout_is_hub_unavailable_with_only_target_text(model, star):
    proxy, ref = star
    dev = drafter(model, f"mqtt://127.0.0.1:{proxy.port}", "pi-long", answer_timeout=2.0)
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 10:
            proxy.set("60000 0")                # out for longer than this generation may wait
    try:
        with pytest.raises(HubUnavailable, match="did not verify within"):
            dev.generate(PROMPT, MAX_NEW, on_token=on_token)
        assert 10 <= len(seen) < MAX_NEW and seen == ref[:len(seen)]     # a prefix of the target's text
    finally:
        proxy.set("none")
        close(dev)
    dev = drafter(model, f"mqtt://127.0.0.1:{proxy.port}", "pi-long2")   # the cable is back: a new device
    try:                                                                 # connection serves it all
        r = dev.generate(PROMPT, MAX_NEW)
        assert r.tokens == ref and r.n_accepted > 0
    finally:
        close(dev)
