"""The reverse star's console scripts as real processes (#46): one `edge-hub serve` (Mosquitto with
the ACL) runs both directions, a draft service (--draft-model) and a verify service
(--verify-model); `edge-agent run --role drafter` serves the hub target's own greedy text on its
OpenAI endpoint (tiny float64 model; the drafter drafts with the same model here, so every draft is
accepted); `edge-hub top` shows the verify service's row and the drafter's; `edge-hub plan` says
which way each device joins. A json_schema request on the drafter's endpoint is answered with the
hub target's own constrained greedy text, which validates (the hub's verify service masks its rows)."""
from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from harness.console_scripts import BIN, MAX_NEW, PROMPT, PW, Procs, greedy_text
from harness.console_scripts import hf_model as _hf_model
from harness.http_endpoints import TEMPLATE, post
from harness.sun_grammars import PERSON
from harness.waiting import wait_until


class _Server:
    def __init__(self, port):
        self.port = port


@pytest.fixture(scope="module")
def star(tmp_path_factory):
    from server.broker import find_free_port
    root = tmp_path_factory.mktemp("reverse-cli")
    model = _hf_model(root / "tiny-hf")
    (model / "chat_template.jinja").write_text(TEMPLATE)      # chat requests (response_format is chat-only)
    port, http = find_free_port(), find_free_port()
    ps = Procs(root)
    common = ["--threads", "1", "--dtype", "float64"]
    users = [f"pi:client:{PW}", f"monitor:hub:{PW}"]
    try:
        ps.start("hub", BIN / "edge-hub", "serve", "--mosquitto", "--acl", "--port", port, "--draft-model", model,
                 "--verify-model", model, "--stats-every", "0.25", "--telemetry-interval", "0.5", *common,
                 *[x for u in users for x in ("--user", u)])
        ps.wait_for("hub", "serving on", 300)
        ps.start("drafter", BIN / "edge-agent", "run", "--broker", f"mqtt://127.0.0.1:{port}", "--role", "drafter",
                 "--model", model, "--username", "pi", "--password", PW, "--http-port", http, "-g", "3",
                 "--telemetry-interval", "0.5", *common)
        ps.wait_for("drafter", "OpenAI endpoint on", 300)
        pw = root / "monitor.pw"
        pw.write_text(PW)
        yield ps, model, port, _Server(http), pw
    finally:
        ps.close()


def test_drafter_process_serves_the_hub_targets_text(star):
    from edge.engines.loader import open_model
    ps, model, _, server, _ = star
    _, text = greedy_text(*open_model(str(model), dtype="float64", threads=1, max_len=4096), PROMPT, MAX_NEW)
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0})
    assert out["choices"][0]["text"] == text
    assert "joined the hub's verify service" in ps.err("drafter")
    ps.wait_for("hub", "verify: sessions=1")            # its stats line: the session and its requests


def test_top_shows_both_directions(star):
    ps, _, port, _, pw = star
    ps.wait_for("hub", "requests=")                     # served at least once (the test above)

    def table() -> str:
        return subprocess.run([str(BIN / "edge-hub"), "top", "--broker", f"mqtt://127.0.0.1:{port}", "--username",
                               "monitor", "--password-file", str(pw), "--once"], capture_output=True, text=True,
                              timeout=60).stdout
    seen = []

    def both() -> bool:                                 # the retained reports of all three, once published
        seen.append(table())
        return all(role in seen[-1] for role in (" verify ", " drafter ", " hub "))
    assert wait_until(both, 30), seen[-1]


def test_plan_says_which_way_each_device_joins():
    from server.hub_cli import main
    r = CliRunner().invoke(main, ["plan", "--device", "jetson-orin-nano-8gb", "--device", "rtx4090-workstation",
                                  "--target-gb", "8.9"])
    assert r.exit_code == 0, r.output
    rows = {line.split("|")[1].strip(): line for line in r.output.splitlines() if line.startswith("| ")}
    assert "drafter (reverse)" in rows["jetson-orin-nano-8gb"] and "target (StarSD)" in rows["rtx4090-workstation"]
    r = CliRunner().invoke(main, ["plan", "--hub-call-ms", "1=150,4=155,8=165,16=190,32=250", "--device-draft-ms",
                                  "25", "--alpha", "0.7", "--ns", "1,4"])
    assert r.exit_code == 0 and "| 4 |" in r.output and "vs plain" in r.output, r.output
    r = CliRunner().invoke(main, ["plan", "--hub-call-ms", "1=150", "--alpha", "0.7"])
    assert r.exit_code != 0 and "--device-draft-ms" in r.output


def test_a_target_that_does_not_fit_is_told_it_may_draft(star):
    from edge.cli.agent import main as agent
    _, model, _, _, _ = star
    r = CliRunner().invoke(agent, ["plan", "--memory-budget", "1M", "--role", "target", "-m", str(model)])
    assert "join as a drafter instead" in r.output and "--role drafter" in r.output, r.output


def test_the_drafters_json_schema_answer_is_the_targets_constrained_text(star):
    import json

    import jsonschema

    from edge.engines.loader import open_model
    from edge.speculative.generate import generate_plain
    from edge.speculative.grammar import Grammar, grammar_from_json_schema, grammar_tokenizer
    _, model, _, server, _ = star
    ask = [{"role": "user", "content": "json please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = post(server, "/v1/chat/completions", {"messages": ask, "max_tokens": 120, "temperature": 0,
                                                "response_format": fmt})["choices"][0]
    text = out["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    engine, tok = open_model(str(model), dtype="float64", threads=1, max_len=4096)
    grammar = Grammar(grammar_from_json_schema(PERSON), grammar_tokenizer(tok, engine.vocab_size))
    want = generate_plain(engine, tok.encode(tok.apply_chat_template(ask)), 120, stop_ids=tuple(tok.eos_ids),
                          grammar=grammar)
    assert out["finish_reason"] == "stop" and text == tok.decode(want.tokens, skip_special=True)
