"""One meaning per flag: every old spelling fails with a message naming the option that replaced it,
on the command line and in a config file."""
import pytest
from click.testing import CliRunner

from devices.provision import main as provision
from edge.cli.agent import main as agent
from server.hub_cli import main as hub

CASES = [
    (agent, ["run", "--hub", "mqtt://h:1883", "--role", "target"], "--broker"),
    (agent, ["run", "--broker", "mqtt://h:1883", "--hubs", "a,b"], "--hub-ids"),
    (agent, ["run", "--broker", "mqtt://h:1883", "--device", "cpu"], "--accelerator"),
    (agent, ["plan", "--device", "cpu", "-m", "x"], "--accelerator"),
    (hub, ["serve", "--device", "cpu"], "--accelerator"),
    (hub, ["serve", "--hubs", "a,b"], "--hub-ids"),
    (hub, ["certs", "--out", "x", "--device", "jet1"], "--client-id"),
    (hub, ["top", "--hub", "mqtt://h:1883"], "--broker"),
    (hub, ["demo", "--broker", "embedded"], "--broker-kind"),
    (provision, ["--device", "nv@jet", "--broker", "mqtt://h:1883"], "--ssh"),
    (provision, ["--ssh", "nv@jet", "--hub", "mqtt://h:1883"], "--broker"),
]


@pytest.mark.parametrize("cli, args, new", CASES)
def test_an_old_spelling_names_the_new_one(cli, args, new):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    old = next(a for a in args if a in ("--hub", "--hubs", "--device") or (a == "--broker" and cli is hub))
    assert f"{old} is gone: write {new}" in r.output, r.output


@pytest.mark.parametrize("key, new", [("hub", "broker"), ("hubs", "hub_ids"), ("device", "accelerator")])
def test_an_old_config_key_names_the_new_one(tmp_path, key, new):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'role = "target"\n{key} = "x"\n')
    r = CliRunner().invoke(agent, ["run", "--config", str(cfg)])
    assert r.exit_code == 2 and f"'{key}' is gone: write {new} = " in r.output, r.output


@pytest.mark.parametrize("cli, sub", [(agent, "run"), (hub, "serve")])
def test_verbose_goes_before_or_after_the_subcommand(cli, sub):
    for args in (["-v", sub, "--help"], [sub, "-vv", "--help"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, (args, r.output)
