"""The hub beyond loopback: `edge-hub certs`, `edge-hub serve --listen ... --tls-dir`, and an
`edge-agent run` target over mqtts:// with its client certificate -- real processes, with a
real Mosquitto (`--mosquitto`) and with the embedded amqtt broker (each test that takes the star
runs on both). A client without a certificate, with a certificate of another CA, with plain
MQTT on the TLS port, or with another device's certificate or password gets nothing of this
device's session. (127.0.0.2 is a loopback address that is not the hub's own 127.0.0.1
listener, so the TLS listener is the only way in.)"""
from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from edge.wire.link import LinkError, MqttLink
from server.broker import find_free_port
from server.certs import make_certs
from harness.canary import canary_after
from harness.console_scripts import BIN, MAX_NEW, PROMPT, Procs, greedy_text, hf_model as _hf_model

ADDR = "127.0.0.2"


@pytest.fixture(scope="module", params=["mosquitto", "embedded"])
def tls_star(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tls-{request.param}")
    model = _hf_model(root / "tiny-hf")
    certs = root / "certs"
    r = subprocess.run([BIN / "edge-hub", "certs", "--out", certs, "--host", ADDR, "--client-id", "dev1",
                        "--client-id", "dev2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    port = find_free_port(ADDR)
    ps = Procs(root)
    common = ["--threads", "1", "--dtype", "float64"]
    try:
        kind = ["--mosquitto"] if request.param == "mosquitto" else []
        local = find_free_port()                  # the hub's own loopback listener (password, no TLS)
        ps.start("hub", BIN / "edge-hub", "serve", *kind, "--acl", "--port", local,
                 "--tls-dir", certs, "--listen", f"{ADDR}:{port}", "--draft-model", model,
                 "--stats-every", "0", "--user", "dev1", "--user", "dev2", "--user", "monitor:hub",
                 "--credentials-out", root / "users.txt", *common)
        ps.wait_for("hub", f"devices: mqtts://{ADDR}:{port}")
        ps.credentials = root / "users.txt"       # NAME:ROLE:PASSWORD lines the hub wrote, mode 600
        ps.local = f"mqtt://127.0.0.1:{local}"
        yield ps, f"mqtts://{ADDR}:{port}", certs, model, common
    finally:
        ps.close()


def test_certs_are_idempotent_and_name_the_client(tmp_path):
    from server.certs import client_files, common_name
    assert make_certs(tmp_path, ["hub.local"], ["jetson1"])
    assert make_certs(tmp_path, ["hub.local"], ["jetson1"]) == []            # nothing new
    assert common_name(client_files(tmp_path, "jetson1").cert) == "jetson1"
    assert make_certs(tmp_path, ["hub.local"], ["jetson2"]) == [str(tmp_path / "clients" / "jetson2.crt"),
                                                               str(tmp_path / "clients" / "jetson2.key")]


def test_a_target_over_tls_decodes_its_plain_greedy_text(tls_star):
    from edge.engines.loader import open_model
    ps, url, certs, model, common = tls_star
    ps.start("target", BIN / "edge-agent", "run", "--role", "target", "--broker", url, "--tls-dir", certs,
             "--client-id", "dev1", "--model", model, "--prompt", PROMPT, "-n", MAX_NEW, "-g", "3", *common)
    _, text = greedy_text(*open_model(str(model), dtype="float64", threads=1, max_len=4096), PROMPT, MAX_NEW)
    assert ps.procs["target"].wait(90) == 0, ps.err("target")
    assert ps.out("target") == text
    err = ps.err("target")
    assert "joined the star" in err, err
    assert int(err.split("answered ")[1].split("/")[0]) > 0, err


def test_without_the_right_certificate_a_client_gets_nothing(tls_star, tmp_path, inbox):
    ps, url, certs, _, _ = tls_star
    ca = str(certs / "ca.crt")
    pws = {ln.split(":")[0]: ln.split(":")[2] for ln in ps.credentials.read_text().splitlines()
           if not ln.startswith("#")}
    dev1_pw = pws["dev1"]
    assert dev1_pw not in ps.err("hub") and "password in" in ps.err("hub")      # the log says where, not what
    # a refused TLS handshake ends the connect at once with its cause (edge/wire/tls_failure.py); the
    # 3 s are a hang guard, not what a refusal waits
    refused = "did not accept our TLS client certificate"
    with pytest.raises(LinkError, match=refused + ".*no client certificate"):          # no certificate
        MqttLink(url, tls=(ca, None, None)).connect(3)
    with pytest.raises(LinkError, match=refused):                       # dev1's password is no certificate
        MqttLink(url, username="dev1", password=dev1_pw, tls=(ca, None, None)).connect(3)
    other = tmp_path / "other-ca"
    make_certs(other, [ADDR], ["dev1"])                                 # same CN, another CA
    with pytest.raises(LinkError, match=refused + ".*other-ca"):
        MqttLink(url, tls=(ca, str(other / "clients" / "dev1.crt"), str(other / "clients" / "dev1.key"))).connect(3)
    with pytest.raises(LinkError, match="is not the one our CA names"):  # the broker's certificate, another CA's
        MqttLink(url, tls=(str(other / "ca.crt"), str(certs / "clients" / "dev1.crt"),
                           str(certs / "clients" / "dev1.key"))).connect(3)
    with pytest.raises(LinkError, match="closed our connections before answering"):   # plain MQTT, TLS port
        MqttLink(url.replace("mqtts://", "mqtt://")).connect(3)
    # dev2's own certificate, claiming dev1's name and password: admitted as dev2 (the CN), and
    # dev1's session topics never reach it
    spy = inbox()
    link = MqttLink(url, username="dev1", password=dev1_pw,
                    tls=(ca, str(certs / "clients" / "dev2.crt"), str(certs / "clients" / "dev2.key"))).connect(5)
    try:
        link.subscribe("ss/s/dev1/#", spy)
        link.subscribe("ss/c/dev1/joined", spy)
        dev1 = MqttLink(url, tls=(ca, str(certs / "clients" / "dev1.crt"), str(certs / "clients" / "dev1.key"))).connect(5)
        monitor = MqttLink(ps.local, username="monitor", password=pws["monitor"]).connect(5)   # role hub
        try:
            dev1.publish("ss/s/dev1/s1/hub/up", b"x", "draft")             # its own topic: allowed
            dev1.publish("ss/s/dev1/s1/hub/down", b"y", "draft")           # (the ACL lets a client write only up)
            # a canary dev1 sends after them reaches the spy through the hub-role monitor (harness/canary.py)
            canary_after(monitor, [(dev1, "dev1")], [link], inbox)
        finally:
            dev1.close()
            monitor.close()
        assert spy.items == []
    finally:
        link.close()


def test_listening_beyond_loopback_needs_acl_and_tls_unless_insecure(tmp_path):
    from server.hub_cli import main
    r = CliRunner().invoke(main, ["serve", "--listen", "192.0.2.10:1883"])
    assert r.exit_code == 2 and "needs authentication and TLS" in r.output and "--insecure" in r.output, r.output
    r = CliRunner().invoke(main, ["serve", "--acl", "--listen", "192.0.2.10"])
    assert r.exit_code == 2 and "--tls-dir" in r.output, r.output
    r = CliRunner().invoke(main, ["serve", "--acl", "--tls-dir", str(tmp_path), "--listen", "192.0.2.10"])
    assert r.exit_code == 2 and "edge-hub certs" in r.output, r.output          # an empty dir: say how to make it
