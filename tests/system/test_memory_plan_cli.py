"""`edge-agent plan` (table and --json) and `edge-agent run --memory-budget / --profile`, which
refuses a role that does not fit before anything loads, and hands the plan's engine arguments on."""
import json

import pytest
from click.testing import CliRunner

from edge.cli.agent import main
from edge.memory.fit import Workload, estimate
from edge.memory.model_shape import read_shape


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from conftest import ExportCache
    return str(ExportCache(tmp_path_factory.mktemp("plan")).gguf("qwen2", "F32"))


def _plan(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_plan_json_has_the_numbers_and_the_most_that_fits(gguf):
    need = estimate(read_shape(gguf), Workload("draft", "llamacpp", 512, 8)).total
    r = _plan("--memory-budget", str(need + 1000), "--role", "draft", "-m", gguf, "-b", "llamacpp",
              "--max-len", "512", "--max-sessions", "8", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["fits"] is True and d["total_bytes"] == need and d["headroom_bytes"] == 1000
    assert d["sequences"] == 8 and d["engine_kwargs"] == {"n_seq_max": 8}
    assert d["kv_bytes_per_token"] == read_shape(gguf).kv_elements_per_token() * 2     # llama.cpp f16
    assert d["max_context"] >= 512 and d["max_sequences"] >= 8 and d["advice"] == []
    r = _plan("--memory-budget", str(need - 1), "--role", "draft", "-m", gguf, "-b", "llamacpp",
              "--max-len", "512", "--max-sessions", "8", "--json")
    d = json.loads(r.output)
    assert d["fits"] is False and d["headroom_bytes"] == -1
    assert d["max_context"] < 512 and d["max_sequences"] < 8
    assert any("--max-len" in a for a in d["advice"]) and any("--max-sessions" in a for a in d["advice"])


def test_plan_table_against_a_profile(gguf):
    r = _plan("--profile", "jetson-orin-nano-8gb", "--role", "target", "-m", gguf, "-b", "llamacpp")
    assert r.exit_code == 0, r.output
    assert "budget" in r.output and "5.200 GB (jetson-orin-nano-8gb)" in r.output
    assert "fits                 yes" in r.output and "largest context" in r.output
    r = _plan("--memory-budget", "1M", "--role", "target", "-m", gguf, "-b", "llamacpp")
    assert r.exit_code == 0 and "NO, short by" in r.output and "change" in r.output


def test_plan_usage_errors(gguf):
    assert "exactly one of" in _plan("--role", "target", "--memory-budget", "1G").output
    r = _plan("--role", "target", "-m", gguf, "--memory-budget", "lots")
    assert r.exit_code != 0 and "not a size" in r.output
    r = _plan("--role", "target", "-m", gguf, "--profile", "toaster")
    assert r.exit_code != 0 and "unknown device profile" in r.output


def _run(monkeypatch, gguf, *extra):
    """`edge-agent run --role target` up to the engine load, which records its arguments and stops."""
    import edge.cli.agent_run as agent_run
    loaded = {}

    def fake_open(model, *a, **kw):
        loaded.update(kw, role=model.role)
        raise SystemExit(0)
    monkeypatch.setattr(agent_run, "open_model_for_command", fake_open)
    r = CliRunner().invoke(main, ["run", "--role", "target", "--broker", "mqtt://127.0.0.1:1", "-b", "llamacpp",
                                  "-m", gguf, "--max-len", "4096", *extra])
    return r, loaded


def test_run_refuses_a_role_that_does_not_fit_before_loading(monkeypatch, gguf):
    r, loaded = _run(monkeypatch, gguf, "--memory-budget", "20M")
    assert r.exit_code != 0 and not loaded, r.output           # refused: the engine was never opened
    assert "does not fit --memory-budget 20M" in r.output
    assert "needs" in r.output and "GB" in r.output and "the budget is 0.02 GB" in r.output
    assert "lower --max-len to" in r.output or "even without KV" in r.output


def test_run_passes_the_plan_to_the_engine(monkeypatch, gguf):
    r, loaded = _run(monkeypatch, gguf, "--profile", "jetson-orin-nano-8gb")
    assert r.exit_code == 0, r.output
    assert loaded.get("n_seq_max") == 7 and loaded.get("role") == "target"    # --parallel 2 + the cache's 4 + a spare
    assert "memory plan:" in r.output
    r, loaded = _run(monkeypatch, gguf)                        # no budget: nothing enforced, same engine
    assert r.exit_code == 0 and loaded.get("n_seq_max") == 7 and "memory plan:" not in r.output
    r, loaded = _run(monkeypatch, gguf, "--prompt-cache", "0")
    assert r.exit_code == 0 and loaded.get("n_seq_max") == 2     # --parallel 2, no cache


def test_real_model_on_an_orin_nano():
    from edge.model.fetch import model_path
    if not model_path("qwen2.5-coder-1.5b").exists():
        pytest.skip("Qwen2.5-Coder-1.5B is not fetched: `make models`")
    r = _plan("--profile", "jetson-orin-nano-8gb", "--role", "target", "-m", "qwen2.5-coder-1.5b", "-b",
              "llamacpp", "--json")
    d = json.loads(r.output)
    assert d["fits"] and d["parts_bytes"]["weights"] == 1_111_370_240 and d["kv_bytes_per_token"] == 28672
    r = _plan("--profile", "jetson-orin-nano-8gb", "--role", "target", "-m", "qwen2.5-coder-1.5b", "-b", "torch",
              "--json")
    assert json.loads(r.output)["fits"] is False           # fp32 torch: 1.78e9 params x 4 bytes > 5.2 GB
