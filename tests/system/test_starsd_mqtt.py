"""StarSD over real brokers (Mosquitto and the embedded amqtt): many targets, one draft."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.speculative.generate import generate_plain
from edge.wire.link import MqttLink
from edge.wire.protocol import DraftRequest, DraftResponse, encode, up_topic
from edge.star.draft_service import DraftLimits
from edge.star.hub_client import HubClient, JoinRefused
from edge.star.target import StarTarget
from server.hub import Hub

from harness.at_once import all_at_once
from harness.tiny_models import target_and_draft
from harness.waiting import wait_until

torch.set_num_threads(1)
TOK = "tok-tiny"


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


@pytest.fixture(params=["mosquitto", "embedded"])
def broker(request):
    """A Mosquitto of this test's own (the session's shared one may hold retained hellos of
    draft services earlier tests left online, which the hub would assign sessions to), or the
    embedded broker."""
    if request.param == "embedded":
        yield request.getfixturevalue("embedded_broker")
        return
    from server.mosquitto import MosquittoBroker
    b = MosquittoBroker().start()
    yield b
    b.close()


def star_target(url, client, model, gamma=3, fp=TOK, adaptive=False, **link_kw):
    # connect and subscribe one client at a time: amqtt 0.12.1 can drop a client whose
    # connect overlaps another client's SUBSCRIBE ("dictionary changed size during iteration")
    link = MqttLink(url, **link_kw).connect(5)
    return StarTarget(TorchEngine(model, fingerprint="target"), HubClient(link, client, fp, 256), gamma=gamma,
                      adaptive=adaptive)


def prompt(i):
    return [(7 * i + j * 13) % 256 for j in range(3 + i % 5)]


def test_eight_targets_share_one_draft_and_stay_lossless(broker, models):
    target_model, draft_model = models
    hub = Hub(broker_url=broker.url, draft_engine=TorchEngine(draft_model, "draft"), tokenizer_fp=TOK,
              limits=DraftLimits(ahead=True)).start()
    stars = [star_target(broker.url, f"t{i}", target_model) for i in range(8)]
    want = [generate_plain(s.engine, prompt(i), 24).tokens for i, s in enumerate(stars)]
    try:
        got = all_at_once([lambda i=i: stars[i].generate(prompt(i), 24) for i in range(8)])
        for i in range(8):
            assert got[i].tokens == want[i], f"target {i} differs from its own plain greedy output"
        answered = sum(s.last_drafter.stats.answered for s in stars)
        accepted = sum(g.n_accepted for g in got)
        snap = hub.snapshot()["draft"]
        assert answered > 8 and accepted > 0
        assert snap["batch_size_max"] > 1, snap["s_of_d"]
    finally:
        for s in stars:
            s.hub.link.close()
        hub.stop()


def test_auto_gamma_targets_stay_lossless_over_the_broker(broker, models):
    """γ auto (edge/speculative/remote_gamma.py): each round picks 0..8 from the waits this target sees;
    three targets at once, every text its own plain greedy output."""
    target_model, draft_model = models
    hub = Hub(broker_url=broker.url, draft_engine=TorchEngine(draft_model, "draft"), tokenizer_fp=TOK).start()
    stars = [star_target(broker.url, f"a{i}", target_model, gamma=8, adaptive=True) for i in range(3)]
    got = [None] * 3
    try:
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, stars[i].generate(prompt(i), 40)))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, s in enumerate(stars):
            assert got[i].tokens == generate_plain(s.engine, prompt(i), 40).tokens, f"target {i}"
            assert got[i].gammas[0] >= 1 and max(got[i].gammas) <= 8     # it explored, within bounds
            assert s.last_drafter.waits.samples > 0 and s.last_drafter.stats.answered > 0
    finally:
        for s in stars:
            s.hub.link.close()
        hub.stop()


def test_foreign_tokenizer_is_refused_with_a_reason(broker, models):
    hub = Hub(broker_url=broker.url, draft_engine=TorchEngine(models[1], "draft"), tokenizer_fp=TOK).start()
    star = star_target(broker.url, "stranger", models[0], fp="some-other-tokenizer")
    try:
        with pytest.raises(JoinRefused, match="tokenizer fingerprint mismatch.*share one tokenizer"):
            star.check_join()
        out = star.generate([1, 2, 3], 8)                    # still decodes, alone
        assert out.tokens == generate_plain(star.engine, [1, 2, 3], 8).tokens
        assert "fingerprint" in star.last_drafter.refusal
    finally:
        star.hub.link.close()
        hub.stop()


def test_forged_and_replayed_messages_are_dropped_and_counted(broker, models, inbox):
    hub = Hub(broker_url=broker.url, draft_engine=TorchEngine(models[1], "draft"), tokenizer_fp=TOK,
              limits=DraftLimits(ahead=False)).start()
    spy = MqttLink(broker.url).connect(5)                    # no ACL here: anyone can listen
    ups, downs = inbox(), inbox()
    spy.subscribe("ss/s/victim/+/+/up", ups)
    spy.subscribe("ss/s/victim/+/+/down", downs)
    star = star_target(broker.url, "victim", models[0])
    try:
        out = star.generate([4, 5, 6], 12)
        assert out.tokens == generate_plain(star.engine, [4, 5, 6], 12).tokens
        assert ups.wait_for(2) and downs.wait_for(1)
        node = hub.node
        # the session ended with bye: open a fresh one to attack
        session = star.hub.join(3, star.last_drafter.sampling, 5)
        up = up_topic("victim", session.sid, session.draft)
        assert session.up == up
        forged = encode(DraftRequest(session.sid, 1, 0, [1, 2], 2), b"x" * 32)    # wrong key
        spy.publish(up, forged, "draft")
        assert session.request(1, 0, [1, 2, 3], 2, star.last_drafter.sampling)
        assert wait_until(lambda: session.wait(1, 0.0) is not None, 5)
        # the spy's copy of the genuine request may arrive after the hub's reply: wait for it
        genuine = lambda: [p for t, p in list(ups.items) if t == up and p != forged]  # noqa: E731
        assert wait_until(genuine, 5), "the spy never saw the genuine request"
        spy.publish(up, genuine()[-1], "draft")               # a genuine request, sent again
        wait_until(lambda: {"auth", "replay"} <= set(node.dropped), 5)
        assert node.dropped.get("auth") == 1 and node.dropped.get("replay") == 1, node.dropped
        # ... and on the target's side: a stale answer replayed to its down topic
        answer = lambda: [p for t, p in list(downs.items) if t.split("/")[3] == session.sid]  # noqa: E731
        assert wait_until(answer, 5)
        spy.publish(session.down, answer()[-1], "draft")
        spy.publish(session.down, encode(DraftResponse(session.sid, 99, [1]), b"y" * 32), "draft")
        wait_until(lambda: {"auth", "replay"} <= set(star.hub.keys.dropped), 5)
        assert star.hub.keys.dropped.get("replay") == 1 and star.hub.keys.dropped.get("auth") == 1
        session.close()
    finally:
        spy.close()
        star.hub.link.close()
        hub.stop()


def test_star_through_the_mosquitto_acl(mosquitto_acl, models):
    """Hub and targets with their own credentials: the ACL'd broker lets the star work."""
    b = mosquitto_acl
    hub = Hub(broker_url=b.url, username=b.hub_user, password=b.hub_password,
              draft_engine=TorchEngine(models[1], "draft"), tokenizer_fp=TOK).start()
    stars = []
    try:
        for name in ("alice", "bob"):
            b.add_user(name)
            stars.append(star_target(b.url, name, models[0], username=name, password=b.password(name)))
        for i, s in enumerate(stars):
            out = s.generate(prompt(i), 16)
            assert out.tokens == generate_plain(s.engine, prompt(i), 16).tokens
            assert s.last_drafter.stats.answered > 0
    finally:
        for s in stars:
            s.hub.link.close()
        hub.stop()


def test_a_draft_service_on_a_device_takes_the_hubs_sessions(mosquitto, models):
    """`edge-agent run --role draft`: the hub has no draft model and assigns to the device."""
    from edge.wire.protocol import draft_hello_topic
    from edge.star.draft_service import DraftService
    from edge.star.draft_node import DraftNode

    hub = Hub(broker_url=mosquitto.url).start()
    link = MqttLink(mosquitto.url)
    svc = DraftService(TorchEngine(models[1], "draft"), DraftLimits(ahead=False))
    node = DraftNode(svc, link, "jetson-1", TOK)
    link.set_will(draft_hello_topic("jetson-1"), node.will())
    link.connect(5)
    node.start()
    star = star_target(mosquitto.url, "dev", models[0])
    try:
        assert wait_until(lambda: hub.registry.online_services() == ["jetson-1"])
        out = star.generate(prompt(2), 20)
        assert out.tokens == generate_plain(star.engine, prompt(2), 20).tokens
        assert star.last_drafter.session is None and star.last_drafter.stats.answered > 0
        assert node.service.stats.requests > 0 and hub.counters["joins"] == 1
        assert wait_until(lambda: hub.registry.count() == 0)     # the device reported the bye
        link.crash()                                       # the device dies: its will says so
        assert wait_until(lambda: hub.registry.online_services() == [])
        with pytest.raises(JoinRefused, match="no draft service is online"):
            star.check_join()
    finally:
        node.stop(announce=False)
        link.close()
        star.hub.link.close()
        hub.stop()


def test_a_target_decodes_alone_without_a_draft_and_joins_when_one_comes(mosquitto, models):
    """No draft service online: the target never refuses to generate; it decodes alone and
    joins the star as soon as a draft service registers (mid-generation)."""
    from edge.wire.protocol import draft_hello_topic
    from edge.star.draft_service import DraftService
    from edge.star.draft_node import DraftNode

    hub = Hub(broker_url=mosquitto.url).start()
    star = star_target(mosquitto.url, "lonely", models[0])
    link = MqttLink(mosquitto.url)
    node = None
    try:
        out = star.generate(prompt(1), 12)                    # nobody drafts: plain decoding
        assert out.tokens == generate_plain(star.engine, prompt(1), 12).tokens
        st = star.last_drafter.stats
        assert st.answered == 0 and "no draft service" in (star.last_drafter.refusal or ""), st
        started = threading.Event()

        def on_token(_t, n=[0]):                              # a draft service arrives mid-generation
            n[0] += 1
            if n[0] == 5:
                nonlocal node
                svc = DraftService(TorchEngine(models[1], "draft"), DraftLimits(ahead=False))
                node = DraftNode(svc, link, "late-draft", TOK)
                link.set_will(draft_hello_topic("late-draft"), node.will())
                link.connect(5)
                node.start()
                started.set()
            if started.is_set():
                time.sleep(0.02)                              # leave the join time to land
        out = star.generate(prompt(3), 120, on_token=on_token)
        assert out.tokens == generate_plain(star.engine, prompt(3), 120).tokens
        st = star.last_drafter.stats
        assert started.is_set() and st.rejoins >= 1 and st.answered > 0, st
    finally:
        if node is not None:
            node.stop()                  # announce it: no retained online hello for later tests
        link.close()
        star.hub.link.close()
        hub.stop()
