"""--accelerator / --gpu-layers reach each command's config: `edge-agent run` (flat TOML, the command line
overriding it), `edge-hub serve` (its [model] table) and `edge-agent generate`'s loaded models."""
from click.testing import CliRunner

from edge.cli.agent import main as agent
from edge.cli.agent_config import read_config
from edge.cli.agent_run import agent_config_from, run


def _run_options(ctx_args):
    """`edge-agent run`'s options by parameter name as click reads them (without starting a role)."""
    ctx = run.make_context("run", list(ctx_args))
    return ctx.params


def test_agent_config_carries_the_placement(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('role = "target"\nbroker = "mqtt://127.0.0.1:1883"\nmodel = "m.gguf"\naccelerator = "cuda"\n'
                   'gpu_layers = 20\n')
    assert read_config(cfg, run)["device"] == "cuda"
    o = _run_options(["--config", str(cfg)])
    m = agent_config_from(o).model
    assert (m.device, str(m.gpu_layers)) == ("cuda", "20")
    o = _run_options(["--config", str(cfg), "--accelerator", "cpu", "--gpu-layers", "0"])   # the command line wins
    assert (agent_config_from(o).model.device, agent_config_from(o).model.gpu_layers) == ("cpu", "0")


def test_hub_config_carries_the_placement(tmp_path):
    from server.hub_config import hub_config_from
    from server.hub_serve import serve
    cfg = tmp_path / "hub.toml"
    cfg.write_text('[model]\naccelerator = "cpu"\ngpu_layers = "all"\nmax_len = 512\n')
    ctx = serve.make_context("serve", ["--config", str(cfg)])
    hub = hub_config_from(ctx.params)
    assert (hub.device, hub.gpu_layers, hub.max_len) == ("cpu", "all", 512)


def test_generate_refuses_cuda_here_before_loading(exports):
    r = CliRunner().invoke(agent, ["generate", "hi", "-T", str(exports.gguf("llama")), "-D", "ngram",
                                   "-b", "llamacpp", "--accelerator", "cuda", "-n", "2"])
    assert r.exit_code == 1, r.output
    assert "--accelerator cuda on llamacpp" in r.output and "-DGGML_CUDA=ON" in r.output
    assert "loaded" not in r.output


def test_bad_gpu_layers_is_a_usage_error(exports):
    r = CliRunner().invoke(agent, ["generate", "hi", "-T", str(exports.gguf("llama")), "-D", "ngram",
                                   "-b", "llamacpp", "--gpu-layers", "lots", "-n", "2"])
    assert r.exit_code != 0 and "--gpu-layers 'lots'" in r.output


def test_hub_draft_runs_on_the_backend_and_placement_asked(exports, capsys):
    """edge-hub serve --draft-backend llamacpp --gpu-layers 0: the hub's own draft is a llama.cpp
    engine whose model params got n_gpu_layers=0, and the hub says so as it loads it."""
    from server.hub_config import hub_config_from
    from server.hub_serve import _make_hub, serve
    ctx = serve.make_context("serve", ["--draft-model", str(exports.gguf("llama")), "--draft-backend", "llamacpp",
                                       "--gpu-layers", "0", "--max-len", "128"])
    cfg = hub_config_from(ctx.params)
    assert (cfg.draft_backend, cfg.gpu_layers) == ("llamacpp", "0")
    hub = _make_hub(cfg)
    engine = hub.draft_core.engine
    assert engine.name == "llamacpp" and engine.model_params.n_gpu_layers == 0
    assert "placement: llamacpp on cpu: all layers on the CPU (asked for --gpu-layers 0)" in capsys.readouterr().err
    engine.close()
