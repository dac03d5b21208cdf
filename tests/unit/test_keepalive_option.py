"""--keepalive on `edge-agent run` (targets, draft services, SUN workers) and `edge-hub serve`: from
the command line or the TOML config ([broker] of hub.toml, a flat key in agent.toml), the default
unchanged (15 s), and every link the process opens carries it."""
from __future__ import annotations

import click
import pytest

from edge.cli.agent_run import agent_config_from, run
from server.hub import Hub
from server.hub_config import hub_config_from
from server.hub_external import ExternalTlsHub
from server.hub_serve import serve


def _agent(*args):
    return agent_config_from(run.make_context("run", ["--role", "draft", "--model", "m", "--broker",
                                                      "mqtt://a:1,mqtt://b:2", *args]).params)


def test_the_agents_links_take_the_keepalive(tmp_path):
    assert _agent().broker.keepalive == 15                       # default unchanged
    cfg = _agent("--keepalive", "5")
    assert cfg.broker.keepalive == 5 and cfg.broker.link().keepalive == 5
    conf = tmp_path / "agent.toml"
    conf.write_text('keepalive = 6\n')
    assert _agent("--config", str(conf)).broker.keepalive == 6
    assert _agent("--config", str(conf), "--keepalive", "9").broker.keepalive == 9   # the command line wins
    with pytest.raises(click.BadParameter):
        _agent("--keepalive", "1")                               # below 2 s: refused


def test_the_hubs_links_take_the_keepalive(tmp_path):
    assert hub_config_from(serve.make_context("serve", []).params).broker.keepalive == 15
    conf = tmp_path / "hub.toml"
    conf.write_text('[broker]\nbroker = "mqtt://a:1,mqtt://b:2"\nkeepalive = 4\n')
    cfg = hub_config_from(serve.make_context("serve", ["--config", str(conf)]).params)
    assert cfg.broker.keepalive == 4
    cfg = hub_config_from(serve.make_context("serve", ["--config", str(conf), "--keepalive", "8"]).params)
    assert cfg.broker.keepalive == 8
    hub = Hub(broker_url="mqtt://a:1,mqtt://b:2", hub_id="h", keepalive=4)
    hub.link = hub._mqtt_link(hub.url, "h")                      # what start() builds (not connected here)
    assert hub.link.keepalive == 4 and hub._second_link("h-draft").keepalive == 4
    tls = ExternalTlsHub(tls=None, broker_url="mqtt://a:1", hub_id="h", keepalive=3)
    assert tls._tls_link("h").keepalive == 3
