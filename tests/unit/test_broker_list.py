"""Several broker URLs (the nodes of a clustered broker): parsing, and the order a link fails over in."""
import click
import pytest

from edge.cli.config_file import read_config
from edge.wire.link import BrokerList, LinkError, MqttLink, parse_urls


def test_comma_list_and_python_list_parse_alike():
    spec = "mqtts://a.example:8883, mqtts://b.example:8884,mqtts://c.example"
    assert parse_urls(spec) == ["mqtts://a.example:8883", "mqtts://b.example:8884", "mqtts://c.example"]
    assert parse_urls(["mqtt://x:1", "mqtt://y:2"]) == ["mqtt://x:1", "mqtt://y:2"]
    assert parse_urls("mqtt://solo:1883") == ["mqtt://solo:1883"]


@pytest.mark.parametrize("spec, says", [
    ("", "no broker URL"),
    (" , ", "no broker URL"),
    ("mqtt://a:1,http://b:2", "must look like mqtt://"),
    ("mqtt://a:1,mqtt://b:notaport", "bad port"),
    ("mqtt://a:1,mqtts://b:2", "mixes mqtt:// and mqtts://"),
])
def test_bad_lists_say_what_to_fix(spec, says):
    with pytest.raises(LinkError, match=says):
        parse_urls(spec)


def test_failover_goes_round_the_list_in_order():
    b = BrokerList("mqtt://a:1,mqtt://b:2,mqtt://c:3")
    assert b.current == "mqtt://a:1"
    assert [b.advance() for _ in range(4)] == [("b", 2), ("c", 3), ("a", 1), ("b", 2)]
    assert b.failovers == 4 and b.current == "mqtt://b:2"


def test_one_broker_is_retried_without_counting_a_failover():
    b = BrokerList("mqtt://only:1883")
    assert b.advance() == ("only", 1883) and b.failovers == 0


def test_link_starts_on_the_first_and_moves_only_after_an_attempt(monkeypatch):
    link = MqttLink("mqtt://127.0.0.1:1,mqtt://127.0.0.1:2")
    tried = []
    monkeypatch.setattr("paho.mqtt.client.Client.reconnect", lambda self: tried.append((self._host, self._port)))
    link._client._host, link._client._port = link.host, link.port      # what connect_async sets
    for _ in range(3):
        link._client.reconnect()
    assert tried == [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 1)]
    assert link.url == "mqtt://127.0.0.1:1,mqtt://127.0.0.1:2"


def test_toml_list_becomes_the_comma_form(tmp_path):
    @click.command()
    @click.option("--broker", "hub_url")
    @click.option("--tag", multiple=True)
    def cmd(hub_url, tag):
        pass
    f = tmp_path / "agent.toml"
    f.write_text('broker = ["mqtts://a:8883", "mqtts://b:8883"]\ntag = ["x", "y"]\n')
    assert read_config(f, cmd) == {"hub_url": "mqtts://a:8883,mqtts://b:8883", "tag": ["x", "y"]}


def test_a_move_to_another_broker_is_logged_with_the_broker_and_the_time(monkeypatch, caplog):
    import logging
    import re

    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode
    link = MqttLink("mqtt://127.0.0.1:1,mqtt://127.0.0.1:2")
    monkeypatch.setattr("paho.mqtt.client.Client.reconnect", lambda self: None)
    c = link._client
    c._host, c._port = link.host, link.port                  # what connect_async sets
    up, lost = ReasonCode(PacketTypes.CONNACK, "Success"), ReasonCode(PacketTypes.DISCONNECT, "Unspecified error")
    with caplog.at_level(logging.INFO, logger="edge.wire.link"):
        c.reconnect()                                         # paho's first attempt: the first broker
        link._on_connect(c, None, None, up, None)
        link._on_disconnect(c, None, None, lost, None)        # lost: paho's loop reconnects ...
        c.reconnect()                                         # ... to the next broker of the list
        link._on_connect(c, None, None, up, None)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    moved = [ln for ln in lines if "moved to broker" in ln]
    assert len(moved) == 1, lines
    assert re.search(r"moved to broker mqtt://127\.0\.0\.1:2 \(2 of 2 in its list\) \d+\.\d\d s after losing "
                     r"mqtt://127\.0\.0\.1:1$", moved[0]), moved[0]
    assert any("disconnected from 127.0.0.1:1" in ln for ln in lines)
