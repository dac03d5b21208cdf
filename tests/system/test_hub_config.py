"""`edge-hub serve --config hub.toml`: the example file is read, the command line overrides it,
secrets and unknown keys are refused with what to write instead; `--credentials-out` keeps the
passwords the hub makes out of its log. One real start of the example against its own broker."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

import server.hub_serve as hub_serve
from edge.wire.link import LinkError, MqttLink
from harness.console_scripts import BIN, Procs, hf_model
from server.broker import find_free_port
from server.hub_config import read_hub_config
from server.hub_cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "hub.toml"


@pytest.fixture
def started(monkeypatch):
    """serve's HubConfig as run_hub would get it (nothing starts)."""
    got = []
    monkeypatch.setattr(hub_serve, "run_hub", got.append)
    return got


def serve(*args):
    return CliRunner().invoke(main, ["serve", *map(str, args)])


def test_the_example_config_is_read_into_serve_options():
    values = read_hub_config(EXAMPLE, hub_serve.serve)
    assert values["port"] == 1883 and values["acl"] is True
    assert values["users"] == ["jetson1", "jetson2", "monitor:hub"]      # `user` is --user's list
    assert values["draft_model"] == "qwen2.5-coder-0.5b" and values["max_sessions"] == 64
    assert values["telemetry_interval"] == 10.0 and values["hub_id"] == "hub"


def test_the_command_line_overrides_the_file(started, tmp_path):
    r = serve("--config", EXAMPLE, "--port", 1999, "--drafter", "suffix", "--max-sessions", 8,
              "--credentials-out", tmp_path / "users.txt")
    assert r.exit_code == 0, r.output
    cfg = started[0]
    assert cfg.broker.port == 1999 and cfg.broker.acl and cfg.broker.credentials_out == str(tmp_path / "users.txt")
    assert [(u.name, u.role) for u in cfg.broker.users] == [("jetson1", "client"), ("jetson2", "client"),
                                                            ("monitor", "hub")]
    assert (cfg.draft.kind, cfg.draft.model, cfg.draft.limits.max_sessions) == ("suffix", "qwen2.5-coder-0.5b", 8)
    assert cfg.draft.limits.p_min == 0.75 and cfg.client_share == 0.5 and cfg.stats_every == 5.0


@pytest.mark.parametrize("toml, says", [
    ('[broker]\npassword = "hunter2"\n', ["'password' would put a secret", "password_file"]),
    ('[broker]\nctl_key = "0123456789abcdef"\n', ["'ctl_key' would put a secret", "ctl_key_file"]),
    ('password = "hunter2"\n', ["'password' would put a secret"]),
    ('[broker]\nacl = true\nuser = ["dev1:client:hunter2"]\n', ["user 'dev1' carries a password", "credentials_out"]),
])
def test_secrets_in_the_file_are_refused(started, tmp_path, toml, says):
    p = tmp_path / "hub.toml"
    p.write_text(toml)
    r = serve("--config", p)
    assert r.exit_code == 2 and not started, r.output
    for text in says:
        assert text in r.output, r.output
    assert "hunter2" not in r.output


@pytest.mark.parametrize("toml, says", [
    ("[draft]\nmax_sesions = 4\n", "[draft] unknown key 'max_sesions'"),
    ("[draft]\nport = 1884\n", "[draft] unknown key 'port'; it belongs in [broker]"),
    ("[brokers]\nport = 1884\n", "unknown table [brokers]"),
    ("port = 1884\n", "'port' outside a table"),
])
def test_unknown_keys_are_refused_by_name(started, tmp_path, toml, says):
    p = tmp_path / "hub.toml"
    p.write_text(toml)
    r = serve("--config", p)
    assert r.exit_code == 2 and not started and says in r.output, r.output


def test_a_user_without_password_needs_credentials_out(started):
    r = serve("--acl", "--user", "dev1", "--user", "app:client:given")
    assert r.exit_code == 2 and not started
    assert "--user dev1 has no password" in r.output and "--credentials-out FILE" in r.output
    r = serve("--acl", "--user", "app:client:given")          # every password given: nothing to write
    assert r.exit_code == 0 and started[0].broker.users[0].password == "given"
    r = serve("--broker", "mqtt://127.0.0.1:1", "--credentials-out", "x.txt")
    assert r.exit_code == 2 and "--credentials-out" in r.output and "do not apply with --broker" in r.output


def test_credentials_are_written_mode_600_whole(tmp_path):
    out = tmp_path / "keep" / "users.txt"
    out.parent.mkdir()
    out.write_text("old\n")
    out.chmod(0o644)                                  # a file that was there keeps no looser mode
    hub_serve.write_credentials(out, [("dev1", "client", "pw1"), ("d1", "draft", "pw2")], "hub")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    lines = [ln for ln in out.read_text().splitlines() if not ln.startswith("#")]
    assert lines == ["dev1:client:pw1", "d1:draft:pw2"]
    assert [p.name for p in out.parent.iterdir()] == ["users.txt"]       # no temporary left behind


def test_the_example_starts_a_hub_whose_users_find_their_passwords_in_the_file(tmp_path):
    """The example as is, but on a free port and with a tiny model's suffix draft (tokenizer only)."""
    model = hf_model(tmp_path / "tiny-hf")
    port, users = find_free_port(), tmp_path / "users.txt"
    ps = Procs(tmp_path)
    try:
        ps.start("hub", BIN / "edge-hub", "serve", "--config", EXAMPLE, "--port", port, "--stats-every", "0",
                 "--draft-model", model, "--drafter", "suffix", "--credentials-out", users)
        ps.wait_for("hub", "serving on")
        log = ps.err("hub")
        assert f"mqtt://127.0.0.1:{port}" in log and "(suffix)" in log, log
        assert stat.S_IMODE(users.stat().st_mode) == 0o600
        rows = dict((ln.split(":")[0], ln.split(":")) for ln in users.read_text().splitlines()
                    if not ln.startswith("#"))
        assert sorted(rows) == ["jetson1", "jetson2", "monitor"] and rows["monitor"][1] == "hub"
        assert f"user jetson1 (client): password in {users}" in log
        for _, _, pw in rows.values():
            assert pw not in log                      # the log says where, never what
        url = f"mqtt://127.0.0.1:{port}"
        MqttLink(url, username="jetson1", password=rows["jetson1"][2]).connect(10).close()
        with pytest.raises(LinkError):
            MqttLink(url, username="jetson1", password="wrong").connect(3)
        assert ps.stop("hub") == 0, ps.err("hub")
    finally:
        ps.close()
