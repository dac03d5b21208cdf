"""Process faults (issue 12, part 3): kill -9 of the hub, a draft service, the broker, a SUN
decoder mid-stream, a SUN prefill worker and a target, with real processes and real Mosquitto
(the SUN faults: test_process_faults_sun.py).

Each fault must cost no client a token (greedy text equal to the no-fault text, every SUN
token handed out once), must never leave a client hanging (a SUN request on a dead worker is
sent again or fails with an error that says what is missing), must leak nothing (measured
after the fault: the registry's sessions, the draft service's sessions and KV, the router's
in-flight tables, the decoders' reservations) and must heal when the process comes back.
The killed processes are `edge-hub serve` / `edge-agent run` started here; what the test
measures inside (the hub of the draft-service fault, the targets that must survive a fault)
runs in this process. Tiny float64 models: greedy comparisons are exact.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from edge.engines.loader import open_model
from edge.speculative.generate import generate_plain
from edge.wire.link import MqttLink
from edge.wire.protocol import STATUS_TOPIC, HubStatus, decode, draft_hello_topic
from edge.star.draft_service import DraftLimits, DraftService
from edge.star.draft_node import DraftNode
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from server.broker import find_free_port
from server.hub import Hub
from server.mosquitto import MosquittoBroker

from harness.star_processes import BIN, Procs, hf_model, sun_dirs, wait_until

torch.set_num_threads(1)
PID = os.getpid()                       # ids of this run: a shared broker may hold older hellos
AGENT = [BIN / "edge-agent", "run", "--threads", "1", "--dtype", "float64"]
PROMPTS = [[3, 14, 15, 9], [26, 5, 35, 89, 7]]
MAX_NEW = 120
EVICT_S = 1.0          # a silent session is evicted this fast here (the default is 60 s)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = hf_model(root / "tiny-hf")
    dec_dir, maths_dir = sun_dirs(root)
    return root, model, dec_dir, maths_dir


@pytest.fixture
def procs(files, request):
    ps = Procs(files[0])
    ps.root = files[0] / request.node.name.replace("[", "_").replace("]", "")
    ps.root.mkdir()
    yield ps
    ps.close()


def engine_of(model):
    return open_model(str(model), dtype="float64", threads=1, max_len=4096)


def targets(url, model, n=2, prefix="t"):
    out = []
    for i in range(n):
        engine, tok = engine_of(model)
        link = MqttLink(url, reconnect_delay=(0.05, 0.2)).connect(60)   # a broker may still be starting
        out.append(StarTarget(engine, HubClient(link, f"{prefix}{i}-{PID}", tok.fingerprint(), engine.vocab_size),
                              gamma=3))
    return out


def generate_through(stars, fault, at=12):
    """Every target generates PROMPTS[i]; once it has `at` tokens and a draft answer it waits
    there until fault() has run, so the fault lands mid-generation; returns the results."""
    progress, got, errors = [0] * len(stars), [None] * len(stars), []
    faulted = threading.Event()

    def run(i):
        def tick(_):
            progress[i] += 1
            if progress[i] >= at and stars[i].last_drafter.stats.answered > 0:
                faulted.wait(60)
            time.sleep(0.003)
        try:
            got[i] = stars[i].generate(PROMPTS[i], MAX_NEW, on_token=tick)
        except Exception as e:            # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stars))]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: min(progress) >= at and all(
            s.last_drafter and s.last_drafter.stats.answered > 0 for s in stars), 30), progress
        assert max(progress) < MAX_NEW, "a target finished before the fault"
        fault()
        faulted.set()
    finally:
        for t in threads:
            t.join(60)
    assert not errors, errors
    return got


def assert_lossless(stars, got):
    for i, (s, g) in enumerate(zip(stars, got)):
        assert g.tokens == generate_plain(s.engine, PROMPTS[i], MAX_NEW).tokens, f"target {i} lost or changed tokens"


def speculates_again(star, i=0):
    out = star.generate(PROMPTS[i], 24)
    assert out.tokens == generate_plain(star.engine, PROMPTS[i], 24).tokens
    return star.last_drafter.stats.answered > 0


def close_all(stars):
    for s in stars:
        s.hub.close()
        s.hub.link.close()


# ---- the stale retained hello (the root of the bug a full run hit) -------------------------------

def test_a_dead_services_retained_hello_is_never_trusted(mosquitto, files):
    """A draft service that stops answering while its retained hello still says online (a hung
    process, or a test stopping a node without its goodbye) gets no session from a new hub; a
    killed hub's own draft service is marked offline by that service's last will."""
    _, model, _, _ = files
    ghost_id, live_id = f"ghost-{PID}", f"live-{PID}"
    links, nodes = [], {}
    for name in (ghost_id, live_id):
        engine, tok = engine_of(model)
        link = MqttLink(mosquitto.url)
        node = DraftNode(DraftService(engine, DraftLimits(ahead=False), name=name), link, name, tok.fingerprint())
        link.set_will(draft_hello_topic(name), node.will())
        link.connect(10)
        links.append(link)
        nodes[name] = node.start()
    nodes[ghost_id].stop(announce=False)          # dead inside, connected: no will, hello retained
    hub = Hub(broker_url=mosquitto.url, hub_id=f"h{PID}").start()
    (star,) = targets(mosquitto.url, model, 1, prefix="stale")
    killed = None
    try:
        assert wait_until(lambda: hub.registry.online_services() == [live_id])
        assert ghost_id in hub.registry.services
        assert not hub.registry.snapshot()["services"][ghost_id]["online"]
        for _ in range(3):
            assert speculates_again(star)
        assert nodes[ghost_id].service.stats.requests == 0 and hub.registry.services[ghost_id].recent == 0
        assert hub.counters["joins"] >= 3 and star.last_drafter.session is None
        # a hub killed with its own draft service: that service's will says it is gone
        engine, tok = engine_of(model)
        killed = Hub(broker_url=mosquitto.url, hub_id=f"k{PID}", draft_engine=engine,
                     tokenizer_fp=tok.fingerprint()).start()
        assert wait_until(lambda: f"k{PID}-draft" in hub.registry.online_services())
        killed.kill()
        assert wait_until(lambda: hub.registry.online_services() == [live_id])
        assert hub.registry.liveness.deaths["will"] == 1
        assert wait_until(lambda: hub.registry.count() == 0)
    finally:
        close_all([star])
        hub.stop()
        nodes[live_id].stop()
        for link in links:
            link.close()


# ---- StarSD processes ------------------------------------------------------------------------------

def test_draft_service_process_killed(mosquitto, files, procs):
    _, model, _, _ = files
    did = f"drafter-{PID}"
    cmd = [*AGENT, "--role", "draft", "--broker", mosquitto.url, "--model", model, "--client-id", did, "--no-ahead"]
    procs.start("draft", *cmd)
    hub = Hub(broker_url=mosquitto.url, hub_id=f"hd{PID}").start()          # drafts only on devices
    stars = targets(mosquitto.url, model, prefix="d")
    try:
        assert wait_until(lambda: hub.registry.online_services() == [did], 60), procs.err("draft")

        def fault():
            procs.kill9("draft")
            # its will: offline at once, its sessions released
            assert wait_until(lambda: hub.registry.online_services() == [] and hub.registry.count() == 0)
            procs.start("draft", *cmd)                                       # it comes back (loading)
        assert_lossless(stars, generate_through(stars, fault))
        assert hub.registry.liveness.deaths["will"] == 1
        assert wait_until(lambda: hub.registry.online_services() == [did], 60), procs.err("draft")
        assert speculates_again(stars[0]) and speculates_again(stars[1], 1)
        assert wait_until(lambda: hub.registry.count() == 0)                 # every bye arrived
    finally:
        close_all(stars)
        hub.stop()


def test_hub_process_killed_and_restarted_on_its_port(files, procs):
    """`edge-hub serve --mosquitto` killed: its Mosquitto child dies with it (the port is free),
    the restarted hub comes up on the same port without cleanup, the targets finish and rejoin."""
    _, model, _, _ = files
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    cmd = [BIN / "edge-hub", "serve", "--mosquitto", "--port", port, "--draft-model", model, "--hub-id", "hp",
           "--threads", "1", "--dtype", "float64", "--stats-every", "0"]
    procs.start("hub", *cmd)
    stars = targets(url, model, prefix="h")       # their links wait for the hub's broker
    procs.wait_for("hub", "serving on")
    spy = None
    try:
        def fault():
            procs.kill9("hub")
            assert wait_until(lambda: _port_free(port), 10), "the hub's Mosquitto outlived the hub"
            procs.start("hub", *cmd)
        assert_lossless(stars, generate_through(stars, fault))
        procs.wait_for("hub", "serving on")
        assert speculates_again(stars[0]) and speculates_again(stars[1], 1)
        # measured at the new hub: its retained status and its draft service's hello count no session
        status, hello = {}, {}
        spy = MqttLink(url).connect(10)
        spy.subscribe(STATUS_TOPIC, lambda t, p: p and status.__setitem__("s", decode(p)))
        spy.subscribe(draft_hello_topic("hp-draft"), lambda t, p: p and hello.__setitem__("h", decode(p)))
        assert wait_until(lambda: isinstance(status.get("s"), HubStatus) and status["s"].online
                          and status["s"].sessions == 0 and "h" in hello and hello["h"].sessions == 0, 10), \
            (status, hello)
    finally:
        if spy is not None:
            spy.close()
        close_all(stars)


def _port_free(port):
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_broker_killed_and_restarted(files):
    _, model, _, _ = files
    broker = MosquittoBroker().start()
    engine, tok = engine_of(model)
    hub = Hub(broker_url=broker.url, hub_id=f"hb{PID}", draft_engine=engine, tokenizer_fp=tok.fingerprint(),
              limits=DraftLimits(ahead=False, evict_after_s=EVICT_S)).start()
    stars = targets(broker.url, model, prefix="b")
    try:
        def fault():
            broker.proc.kill()                                           # kill -9 of Mosquitto
            broker.proc.wait(10)
            assert wait_until(lambda: not stars[0].hub.link.is_connected())
            broker.start()                                               # the same port again
        assert_lossless(stars, generate_through(stars, fault))
        assert wait_until(lambda: hub.link.is_connected() and hub.node.link.is_connected())
        assert speculates_again(stars[0]) and speculates_again(stars[1], 1)
        svc = hub.service                                # (a lost bye: reclaimed as silent)
        assert wait_until(lambda: hub.registry.count() == 0 and not svc.sessions(), 5 * EVICT_S)
        assert svc.kv_tokens() == 0 and wait_until(lambda: svc.engine.active_sequences == 0)
    finally:
        close_all(stars)
        hub.stop()
        broker.close()


def test_the_hubs_own_mosquitto_killed_is_started_again(files):
    """kill -9 of the Mosquitto a hub runs itself: the hub starts it again on its port (the same
    users), every link reconnects, the targets finish and speculate again."""
    _, model, _, _ = files
    engine, tok = engine_of(model)
    hub = Hub(broker="mosquitto", port=find_free_port(), hub_id=f"hm{PID}", draft_engine=engine,
              tokenizer_fp=tok.fingerprint(), limits=DraftLimits(ahead=False, evict_after_s=EVICT_S),
              status_every=0.5).start()
    stars = targets(hub.url, model, prefix="m")
    try:
        def fault():
            hub.broker.proc.kill()
            assert wait_until(lambda: not stars[0].hub.link.is_connected())
        assert_lossless(stars, generate_through(stars, fault))
        assert wait_until(lambda: hub.counters.get("broker_restarts") == 1 and hub.link.is_connected())
        assert speculates_again(stars[0]) and speculates_again(stars[1], 1)
        # a bye sent before the draft service had resubscribed is lost with the broker's
        # state: that session is reclaimed as silent (evict_after_s), not kept
        svc = hub.service
        assert wait_until(lambda: hub.registry.count() == 0 and not svc.sessions(), 5 * EVICT_S)
        assert svc.kv_tokens() == 0 and wait_until(lambda: svc.engine.active_sequences == 0)
    finally:
        close_all(stars)
        hub.stop()


def test_target_process_killed_its_session_and_kv_are_freed(mosquitto, files, procs):
    _, model, _, _ = files
    engine, tok = engine_of(model)
    hub = Hub(broker_url=mosquitto.url, hub_id=f"ht{PID}", draft_engine=engine, tokenizer_fp=tok.fingerprint(),
              limits=DraftLimits(ahead=False, evict_after_s=1.0)).start()
    svc = hub.service
    procs.start("target", *AGENT, "--role", "target", "--broker", mosquitto.url, "--model", model,
                "--client-id", f"tgt-{PID}", "--prompt", "the the he", "-g", "3", "-n", "3000")
    star = None
    try:
        # KV fed, not only a sequence opened: the engine opens it before the batch feeds it
        assert wait_until(lambda: svc.sessions() and svc.kv_tokens() > 0, 60), procs.err("target")
        procs.pause("target")                     # mid-generation: its session holds KV
        (victim,) = svc.sessions()
        assert wait_until(lambda: svc.kv_tokens() > 0) and list(hub.registry.sessions) == [victim]
        procs.kill9("target")
        # silent: evicted after evict_after_s, its KV freed, the hub's registry told
        assert wait_until(lambda: not svc.sessions() and svc.engine.active_sequences == 0, 10)
        assert svc.kv_tokens() == 0 and svc.stats.counters.get("closed_timeout") == 1
        assert wait_until(lambda: hub.registry.count() == 0)
        # the device comes back (here, under its id): it joins and speculates
        engine2, _ = engine_of(model)
        star = StarTarget(engine2, HubClient(MqttLink(mosquitto.url).connect(10), f"tgt-{PID}",
                                             tok.fingerprint(), engine2.vocab_size), gamma=3)
        assert speculates_again(star)
        assert wait_until(lambda: not svc.sessions() and hub.registry.count() == 0)
        assert svc.kv_tokens() == 0 and wait_until(lambda: svc.engine.active_sequences == 0)
    finally:
        if star is not None:
            close_all([star])
        hub.stop()


# ---- SUN processes ----------------------------------------------------------------------------------
