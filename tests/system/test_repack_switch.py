"""--repack auto|on|off as a user gives it (edge/engines/llamacpp_repack.py): in agent.toml and hub.toml
(the command line overriding the file), on `edge-agent generate`, on the hub's own draft, through
`edge-agent run`'s own opening of a target (its memory plan, then the engine), and in a real star:
a draft service and a target, both Qwen2.5-Coder-0.5B Q4_K_M on llama.cpp with `--repack on`,
answering a prompt with drafts from the service. Each start line says what was chosen and why."""
import pytest
from click.testing import CliRunner

from edge.cli.agent import main as agent
from edge.cli.agent_run import agent_config_from, run
from harness.agent_asks import fetched_or_skip
from harness.console_scripts import BIN, Procs

MODEL = "qwen2.5-coder-0.5b"
ON = "weight repacking on (on as asked; a long prompt prefills slower repacked"
AUTO = "weight repacking off (auto: Q4_K, Q5_0, Q6_K weights stay unrepacked: a long prompt prefills slower"


def test_agent_toml_and_hub_toml_carry_repack_and_exact_rows(tmp_path):
    from server.hub_config import hub_config_from
    from server.hub_serve import serve
    cfg = tmp_path / "agent.toml"
    cfg.write_text('role = "target"\nbroker = "mqtt://127.0.0.1:1883"\nmodel = "m.gguf"\nrepack = "on"\n')
    assert agent_config_from(run.make_context("run", ["--config", str(cfg)]).params).model.repack == "on"
    o = run.make_context("run", ["--config", str(cfg), "--repack", "off"]).params       # the command line wins
    assert agent_config_from(o).model.repack == "off"
    plain = run.make_context("run", ["--role", "draft", "-m", "m", "--broker", "mqtt://127.0.0.1:1"]).params
    assert agent_config_from(plain).model.repack == "auto"
    hub = tmp_path / "hub.toml"
    hub.write_text('[model]\nrepack = "off"\n')
    assert hub_config_from(serve.make_context("serve", ["--config", str(hub)]).params).repack == "off"
    cfg.write_text('role = "target"\nbroker = "mqtt://127.0.0.1:1883"\nmodel = "m.gguf"\nexact_rows = true\n')
    assert agent_config_from(run.make_context("run", ["--config", str(cfg)]).params).model.exact_rows is True
    assert agent_config_from(plain).model.exact_rows is False
    hub.write_text('[model]\nexact_rows = true\n')
    assert hub_config_from(serve.make_context("serve", ["--config", str(hub)]).params).exact_rows is True
    hub.write_text('[model]\nrepack = "maybe"\n')
    r = CliRunner().invoke(serve, ["--config", str(hub)])
    assert r.exit_code == 2 and "'maybe' is not one of 'auto', 'on', 'off'" in r.output


def test_generate_says_what_it_chose():
    path, = fetched_or_skip(MODEL)
    base = ["generate", "def add(a, b):", "-T", str(path), "-D", "ngram", "-n", "2", "--no-compare", "--threads", "1",
            "--max-len", "256"]
    r = CliRunner().invoke(agent, base + ["--repack", "on"])
    assert r.exit_code == 0, r.output
    assert "placement: llamacpp on cpu: all layers on the CPU, --repack on (" in r.output
    assert ON in r.output
    r = CliRunner().invoke(agent, base)
    assert r.exit_code == 0 and AUTO in r.output, r.output


def test_the_hubs_draft_and_a_runs_target_get_it(capsys):
    """edge-hub serve --repack on: its own draft engine repacks; edge-agent run --repack off: the target
    opened the way run opens it (placement, memory plan, engine) does not."""
    from edge.cli.agent_run import _open_planned
    from edge.cli.startup import resolve_for_command
    from server.hub_config import hub_config_from
    from server.hub_serve import _make_hub, serve
    path, = fetched_or_skip(MODEL)
    cfg = hub_config_from(serve.make_context("serve", ["--draft-model", str(path), "--repack", "on",
                                                       "--max-len", "256", "--threads", "1"]).params)
    hub = _make_hub(cfg)
    engine = hub.draft_core.engine
    assert engine.repack.extra_bufts is True and engine.model_params.use_extra_bufts and not engine.mmap
    assert "weight repacking on (on as asked" in capsys.readouterr().err
    engine.close()
    run_cfg = agent_config_from(run.make_context("run", ["--role", "target", "-m", str(path), "--repack", "off",
                                                         "--broker", "mqtt://127.0.0.1:1", "--max-len", "256",
                                                         "--threads", "1"]).params)
    target, _ = _open_planned(run_cfg, resolve_for_command(str(path), "auto", "target"))
    assert target.repack.why == "off as asked" and not target.model_params.use_extra_bufts and target.mmap
    assert "weight repacking off (off as asked)" in capsys.readouterr().err
    target.close()


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.broker
def test_a_real_star_with_repack_on(tmp_path, mosquitto):
    """A draft service and a target, processes as a user starts them, both repacking the real Q4_K_M
    0.5B: the target answers its prompt with the service's drafts, and each says it repacks and why."""
    from server.hub import Hub
    path, = fetched_or_skip(MODEL)
    hub = Hub(broker_url=mosquitto.url).start()
    ps = Procs(tmp_path)
    common = [BIN / "edge-agent", "run", "--broker", mosquitto.url, "--threads", "1", "--max-len", "512", "-m", path,
              "--repack", "on"]
    try:
        ps.start("draft", *common, "--role", "draft", "--client-id", "draft-repacked", "--no-ahead")
        ps.wait_for("draft", "registered at", timeout=120)
        ps.start("target", *common, "--role", "target", "--client-id", "target-repacked", "--prompt",
                 "def fibonacci(n):", "-n", "24", "-g", "3", "--temperature", "0")
        assert ps.procs["target"].wait(300) == 0, ps.err("target") + ps.err("draft")
        err = ps.err("target")
        assert ON in err and "joined the star" in err, err
        assert int(err.split("answered ")[1].split("/")[0]) > 0, err + ps.err("draft")
        assert "weight repacking on (on as asked" in ps.err("draft")
        assert ps.out("target").strip()
    finally:
        ps.close()
        hub.stop()
