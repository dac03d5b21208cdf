"""--prompt-cache / --prompt-cache-mb / --prompt-cache-ram on `edge-agent plan`, `run` (also from a
--config file) and `generate`: the plan counts the cache (its host-memory tier at its bound, the
default fitted to a budget), a llama.cpp target gets n_seq_max = 1 + its slots, and the target's
StarTarget / generation gets the cache."""
import json

import pytest
from click.testing import CliRunner

from edge.cli.agent import main
from edge.model.fetch import model_path


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from conftest import ExportCache
    return str(ExportCache(tmp_path_factory.mktemp("plan")).gguf("qwen2", "F32"))


def _plan(*args):
    return json.loads(CliRunner().invoke(main, ["plan", "--role", "target", "-b", "llamacpp", "--json", *args]).output)


def test_plan_counts_the_prompt_cache(gguf):
    base = _plan("-m", gguf, "--prompt-cache", "0", "--parallel", "1")
    four = _plan("-m", gguf, "--parallel", "1")                   # the default: 4 slots
    assert base["engine_kwargs"] == {"n_seq_max": 1} and four["engine_kwargs"] == {"n_seq_max": 5}
    assert _plan("-m", gguf)["engine_kwargs"] == {"n_seq_max": 7}     # --parallel's default 2: and a spare
    table = CliRunner().invoke(main, ["plan", "--role", "target", "-b", "llamacpp", "-m", gguf]).output
    assert "x 2 + 4 in the prompt cache + 1 spare to gather running ones" in table
    assert four["prompt_cache"] == 4 and four["parts_bytes"]["kv"] == 5 * base["parts_bytes"]["kv"]
    budget = base["total_bytes"] + 2 * base["parts_bytes"]["kv"]  # room for two slots
    short = _plan("-m", gguf, "--memory-budget", str(budget), "--parallel", "1")
    assert not short["fits"] and "lower --prompt-cache to 2 or less" in short["advice"]
    table = CliRunner().invoke(main, ["plan", "--role", "target", "-b", "llamacpp", "-m", gguf,
                                       "--parallel", "1"]).output
    assert "x 1 + 4 in the prompt cache" in table


def test_plan_counts_the_saved_prompts_and_fits_their_default_to_a_budget(gguf):
    MB = 10 ** 6
    default = _plan("-m", gguf, "--parallel", "1")
    assert default["parts_bytes"]["saved prompts"] == 512 * MB == default["prompt_cache_saved_bytes"]
    assert _plan("-m", gguf, "--parallel", "1", "--prompt-cache-ram", "64")["parts_bytes"]["saved prompts"] == 64 * MB
    assert "saved prompts" not in _plan("-m", gguf, "--parallel", "1", "--prompt-cache-ram", "0")["parts_bytes"]
    assert "saved prompts" not in _plan("-m", gguf, "--prompt-cache", "0")["parts_bytes"]    # no cache, no tier
    rest = default["total_bytes"] - 512 * MB
    fitted = _plan("-m", gguf, "--parallel", "1", "--memory-budget", str(rest + 100 * MB))
    assert fitted["fits"] and fitted["parts_bytes"]["saved prompts"] == 100 * MB       # the default gives way
    asked = _plan("-m", gguf, "--parallel", "1", "--memory-budget", str(rest + 100 * MB), "--prompt-cache-ram", "512")
    assert not asked["fits"] and "lower --prompt-cache-ram to 100 MB or less" in asked["advice"]


def test_run_gives_the_target_the_saved_prompts_its_plan_left(monkeypatch, gguf):
    budget = _plan("-m", gguf, "--parallel", "1", "--prompt-cache-ram", "0")["total_bytes"] + 30 * 10 ** 6
    _, target = _run(monkeypatch, "-b", "llamacpp", "-m", gguf, "--parallel", "1", "--memory-budget", str(budget))
    assert target.prompt_cache_ram == 30.0
    _, target = _run(monkeypatch, "-b", "llamacpp", "-m", gguf, "--parallel", "1")       # no budget: the default
    assert target.prompt_cache_ram == 512.0
    _, target = _run(monkeypatch, "-b", "llamacpp", "-m", gguf, "--parallel", "1", "--prompt-cache-ram", "7")
    assert target.prompt_cache_ram == 7.0


def _run(monkeypatch, *extra):
    """`edge-agent run --role target` up to the engine load, which records its arguments and stops."""
    import edge.cli.agent_run as agent_run
    loaded, started = {}, {}

    def fake_open(*a, **kw):
        loaded.update(kw)
        return "engine", "tok"

    def fake_target(engine, tok, link, client_id, model, target, *a, **kw):
        started["target"] = target
    monkeypatch.setattr(agent_run, "open_model_for_command", fake_open)
    monkeypatch.setattr(agent_run, "run_target", fake_target)
    r = CliRunner().invoke(main, ["run", "--role", "target", "--broker", "mqtt://127.0.0.1:1", *extra])
    assert r.exit_code == 0, r.output
    return loaded, started["target"]


def test_run_takes_the_options_and_the_config_file(monkeypatch, gguf, tmp_path):
    loaded, target = _run(monkeypatch, "-b", "llamacpp", "-m", gguf, "--prompt-cache", "2", "--prompt-cache-mb", "64",
                          "--parallel", "1")
    assert loaded["n_seq_max"] == 3 and (target.prompt_cache, target.prompt_cache_mb) == (2, 64.0)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'model = "{gguf}"\nbackend = "llamacpp"\nprompt_cache = 0\nparallel = 1\n')
    loaded, target = _run(monkeypatch, "--config", str(cfg))
    assert loaded["n_seq_max"] == 1 and target.prompt_cache == 0
    cfg.write_text(f'model = "{gguf}"\nbackend = "llamacpp"\nprompt_cache_ram = 64\nparallel = 1\n')
    assert _run(monkeypatch, "--config", str(cfg))[1].prompt_cache_ram == 64.0


def test_run_target_builds_the_cache():
    from edge.cli.options import open_prompt_cache
    from harness.http_endpoints import tiny_engine
    engine = tiny_engine(0)
    cache = open_prompt_cache(engine, 3, 2.5)
    assert cache.slots == 3 and cache.max_bytes == 2_500_000 and cache.engine is engine and cache.saved is None
    assert open_prompt_cache(engine, 3, 2.5, None).saved.max_bytes == 512 * 10 ** 6     # the default tier
    assert open_prompt_cache(engine, 0, 2.5) is None


@pytest.mark.skipif(not model_path("smollm2-135m").exists(), reason="SmolLM2 absent: run `make test-models`")
def test_generate_compares_on_the_cached_prompt():
    from edge.cli.agent import run_generation
    rows = run_generation("smollm2-135m", "ngram", "Count: 1 2 3", (3, False), 6, 0.0, 0, 1.0, 0, True, True,
                          "float32", 2, 256, "llamacpp", prompt_cache=2)
    (_, spec), (_, plain) = rows
    # the same prompt again: all of it but its last token (llama.cpp texts are not compared: its
    # one-token and many-token calls round differently)
    assert spec.cached_tokens == 0 and plain.cached_tokens > 0 and plain.n_generated == 6
