"""--hub-ids on `edge-hub serve` and `edge-agent run`: a comma list or a TOML list, each id checked,
and a hub whose own --hub-id is missing from the list is refused with what to do."""
from __future__ import annotations

import click
import pytest

from edge.cli.agent_run import run
from server.hub_config import hub_config_from
from server.hub_serve import serve


def test_hub_list_from_the_command_line_and_from_toml(tmp_path):
    conf = tmp_path / "hub.toml"
    conf.write_text('[hub]\nhub_id = "a"\nhub_ids = ["a", "b"]\n')
    assert serve.make_context("serve", ["--config", str(conf)]).params["hubs"] == ("a", "b")
    assert hub_config_from(serve.make_context("serve", ["--config", str(conf)]).params).hubs == ("a", "b")
    ctx = run.make_context("run", ["--role", "target", "--model", "m", "--broker", "mqtt://h:1", "--hub-ids", "a, b"])
    assert ctx.params["hubs"] == ("a", "b")
    assert serve.make_context("serve", []).params["hubs"] == ()          # one hub, as before


def test_bad_hub_lists_are_refused_with_what_to_do():
    with pytest.raises(click.BadParameter, match="separated by commas"):
        serve.make_context("serve", ["--hub-ids", "a,b/c"])
    with pytest.raises(click.BadParameter, match="named twice"):
        serve.make_context("serve", ["--hub-ids", "a,a"])
    params = serve.make_context("serve", ["--hub-id", "x", "--hub-ids", "a,b"]).params
    with pytest.raises(click.BadParameter, match="this one's included"):
        hub_config_from(params)
