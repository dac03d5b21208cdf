"""The star across hosts: hub + Mosquitto, a remote draft service, two targets and the SUN
workers (a prefill worker and a shared decoder), each in its own network namespace on one switch (harness/netns.py), as real processes over TLS with
the hub's ACL (harness/netns_star.py) -- then the network breaks under them.

* greedy outputs equal the one-process run (float64 tiny llama: exact), StarSD and SUN;
* a client without a certificate, with one of another CA, speaking plain MQTT, or holding
  another device's certificate gets nothing of dev1's session;
* latency and jitter (a delaying TCP proxy between dev1 and the broker: this kernel has no
  netem), a byte flipped by that proxy (TLS must refuse it), a pulled cable of one target, of the draft service, and of the hub: every greedy
  output equals its no-fault output, no request outlives its timeout, and drafting resumes
  once the cable is back (the monitor sees the device's session answered again); a SUN
  request sent while the decoder's or the hub's cable is out is served once it is back.

Root only (namespaces need CAP_NET_ADMIN); `make test` runs as root.
"""
from __future__ import annotations

import os
import socket
import ssl
import time

import pytest

from edge.wire.link import MqttLink
from harness.canary import canary_after
from harness.namespace_runs import complete_at_once, plain_texts, rounds_until
from harness.netns import available
from harness.netns_star import NamespaceStar

PROMPTS = {"t1": "the the he", "t2": "he the t"}
MAX_NEW = 40
PARTITION_S = 2.0              # shorter than the keepalive: the TCP connections survive the cut
REQUEST_TIMEOUT = 30.0         # no request may take longer, fault or not
MQTT_CONNECT = bytes([0x10, 12, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 0])   # 3.1.1, clean, no client id

if os.geteuid() != 0:
    pytest.skip("network namespaces need root (CAP_NET_ADMIN)", allow_module_level=True)


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    why = available()
    assert not why, why                            # iproute2 missing: an install to fix, not a skip
    with NamespaceStar(tmp_path_factory.mktemp("nsstar"), sun=True) as s:
        yield s


@pytest.fixture(scope="module")
def refs(star):
    """The one-process run: each prompt's plain greedy text (what every target must print)."""
    return plain_texts(star.model, PROMPTS, MAX_NEW)


def _both(star, hosts=("t1", "t2")) -> dict:
    """Generate on several targets at once (each an HTTP request with REQUEST_TIMEOUT)."""
    return complete_at_once(star, PROMPTS, MAX_NEW, REQUEST_TIMEOUT, hosts)


def _drafted(star, refs, devs, hosts=("t1", "t2")) -> float:
    """Greedy rounds on `hosts` (each text the one-process text) until the monitor saw each of
    `devs` drafted for since this call (harness/namespace_runs.py: drafting is an event); -> that time."""
    t0 = time.monotonic()
    n = rounds_until(star, PROMPTS, refs, MAX_NEW, lambda: all(star.monitor.answers(d, t0) for d in devs), 90,
                     REQUEST_TIMEOUT, hosts)
    assert n is not None, f"{devs} were never drafted for:\n{star.ps.err(hosts[0])[-2000:]}"
    return t0


def _recovers(star, host, since):
    took = star.recovery(host, PROMPTS[host], 8, since, timeout=60)
    assert took is not None, f"{host}'s session was never drafted for again:\n{star.ps.err(host)[-2000:]}"
    return took


def test_targets_in_namespaces_equal_the_one_process_run(star, refs):
    t0 = _drafted(star, refs, ("dev1", "dev2"))     # every round's texts equal the one-process run's
    for dev in ("dev1", "dev2"):                   # drafted by the remote service, over the network
        answers = star.monitor.answers(dev, t0)
        assert answers and {a[2] for a in answers} == {"draft1"}, (dev, answers)


def _handshake(star, cert=None, key=None) -> str:
    """'' when a TLS handshake with the broker succeeds with this client certificate, else the
    broker's refusal (TLS 1.2: a missing or foreign certificate fails the handshake itself)."""
    ctx = ssl.create_default_context(cafile=str(star.certs / "ca.crt"))
    if cert:
        ctx.load_cert_chain(cert, key)
    try:
        with socket.create_connection((star.hosts["hub"].ip, star.tls_port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=star.hosts["hub"].ip) as tls:
            tls.sendall(MQTT_CONNECT)
            return "" if tls.recv(4)[:1] == b"\x20" else "no CONNACK"
    except (ssl.SSLError, ConnectionError) as e:
        return str(e) or type(e).__name__


def test_without_the_right_certificate_a_client_gets_nothing(star, refs, tmp_path, inbox):
    from server.certs import make_certs
    assert _handshake(star, *star.tls("dev2")[1:]) == ""                # the right one is admitted
    assert _handshake(star)                                          # no client certificate
    other = tmp_path / "other-ca"
    make_certs(other, [star.hosts["hub"].ip], ["dev1"])             # dev1's name, another CA
    assert _handshake(star, str(other / "clients" / "dev1.crt"), str(other / "clients" / "dev1.key"))
    with socket.create_connection((star.hosts["hub"].ip, star.tls_port), timeout=10) as plain:
        plain.sendall(MQTT_CONNECT)                                  # plain MQTT on the TLS port
        try:
            answer = plain.recv(4)
        except ConnectionError:
            answer = b""
        assert answer[:1] != b"\x20", answer                        # no CONNACK
    spy = inbox()                                                     # dev2's own certificate
    link = MqttLink(star.url, tls=star.tls("dev2")).connect(10)
    try:
        for pattern in ("ss/s/dev1/#", "ss/c/dev1/joined", "ss/s/+/+/+/up", "ss/d/#"):
            link.subscribe(pattern, spy)
        t0 = _drafted(star, refs, ("dev1",), ("t1",))
        # a canary the spy may read, routed by the one broker after every message of dev1's
        # session: anything of dev1's the broker let through would have reached the spy first
        canary_after(star.monitor.link, [], [link], inbox)
    finally:
        link.close()
    assert star.monitor.answers("dev1", t0), "dev1 was not drafted for: the spy proves nothing"
    assert spy.items == []


@pytest.mark.parametrize("profile", ["lan", "wifi", "cellular"])
def test_latency_and_jitter_leave_the_text_alone(star, refs, profile):
    star.set_delay(profile)
    try:                                           # each round's text equal, until one was drafted for
        _drafted(star, refs, ("dev1",), ("t1",))
    finally:
        star.set_delay("none")


def test_a_tampering_middlebox_is_refused_by_tls(star, refs):
    """One byte of dev1's stream to the broker flipped on the way: the broker refuses the TLS
    record and drops that connection, dev1 reconnects; its text stays the same."""
    before = star.proxy_stats(corrupt=True)
    t0 = time.monotonic()
    assert star.complete("t1", PROMPTS["t1"], MAX_NEW, timeout=REQUEST_TIMEOUT)["text"] == refs["t1"]
    _recovers(star, "t1", t0)
    after = star.proxy_stats()
    assert after["corrupted"] == before["corrupted"] + 1, (before, after)
    assert after["connections"] > before["connections"], (before, after)   # a new connection, not the tampered one


@pytest.mark.parametrize("host", ["t1", "draft"])
def test_a_pulled_cable_of_one_agent(star, refs, host):
    """dev1's cable, or the draft service's: the targets decode alone meanwhile (same text),
    the rest of the star keeps drafting, and drafting resumes when the cable is back."""
    lab = star.lab
    t_cut = time.monotonic()
    with lab.partitioned(star.hosts[host]):
        got = _both(star)
        if host == "t1":                           # dev2 is not behind the cut: still drafted for
            assert rounds_until(star, PROMPTS, refs, MAX_NEW, lambda: bool(star.monitor.answers("dev2", t_cut)), 30,
                                REQUEST_TIMEOUT, ["t2"]) is not None, "dev2 lost its drafts to dev1's partition"
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t_cut)))
    healed = time.monotonic()
    for h in PROMPTS:
        assert got[h]["text"] == refs[h], h
    for h in (["t1"] if host == "t1" else ["t1", "t2"]):
        _recovers(star, h, healed)
    assert star.complete("t1", PROMPTS["t1"], MAX_NEW)["text"] == refs["t1"]


def test_a_pulled_cable_of_the_hub(star, refs):
    t_cut = time.monotonic()
    with star.lab.partitioned(star.hosts["hub"]):
        got = _both(star)
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t_cut)))
    healed = time.monotonic()
    for h in PROMPTS:
        assert got[h]["text"] == refs[h], h
    for h in PROMPTS:
        _recovers(star, h, healed)
    for h, r in _both(star).items():
        assert r["text"] == refs[h], h



@pytest.fixture(scope="module")
def sun(star):
    """A SUN client (certificate `app`) and its prompts' in-process reference tokens."""
    from edge.sun.client import SunClient
    from harness.console_scripts import sun_reference as _sun_reference
    prompts = [[5, 17, 99, 3, 42, 7], [200, 11, 64, 8]]
    refs = [_sun_reference(star.maths_dir, star.dec_dir, p, 24) for p in prompts]
    client = SunClient(MqttLink(star.url, tls=star.tls("app")).connect(10), "app").start()
    yield client, list(zip(prompts, refs))
    client.close()
    client.link.close()


def test_sun_requests_across_namespaces_equal_the_in_process_run(sun):
    client, cases = sun
    for prompt, ref in cases:
        r = client.submit("maths", prompt, max_new=24).wait(REQUEST_TIMEOUT)
        assert r.tokens == ref and r.workers == ["pre1", "dec1"], r


@pytest.mark.parametrize("host", ["dec", "hub"])
def test_sun_request_through_a_pulled_cable(star, sun, host):
    """Sent while the cable is out: it waits in TCP buffers and queues, and is served (the
    same tokens) once the cable is back -- within its timeout, not never."""
    client, cases = sun
    with star.lab.partitioned(star.hosts[host]):
        handles = [client.submit("maths", p, max_new=24) for p, _ in cases]
        time.sleep(PARTITION_S)
    for h, (_, ref) in zip(handles, cases):
        assert h.wait(REQUEST_TIMEOUT).tokens == ref
