"""`edge-hub demo --two-device-format`: the option reaches part one's target, which is a llama.cpp
engine of its own (closed before part two) unless native; the table's line of the fetched file alone."""
from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import server.demos.draft_memory as draft_memory
import server.demos.star_demo as star_demo
import server.demos.two_device as two_device
from server.hub_cli import main as hub_main


class _Tok:
    eos_ids = {2}

    def apply_chat_template(self, messages):
        return messages[0]["content"]

    def encode(self, text):
        return [1, len(text)]

    def fingerprint(self):
        return "tok-fake"


@pytest.fixture
def demo_calls(monkeypatch):
    """demo_command with models, star and part two replaced: what part one was given."""
    calls = {}
    shared = SimpleNamespace(name="shared", max_len=1024)
    monkeypatch.setattr(star_demo, "load_star_models", lambda *a, **k: ("draft", [shared], _Tok()))
    monkeypatch.setattr("edge.model.reference.resolve_model", lambda spec: Path(f"/m/{spec}.gguf"))

    class Target:
        def __init__(self, target, fmt, engine):
            calls["format"], calls["shared"] = fmt, engine

        def __enter__(self):
            return "part-one-engine", ("Q4_K_M", "shared")

        def __exit__(self, *exc):
            calls["closed_before_part_two"] = "part_two" not in calls

    monkeypatch.setattr(two_device, "two_device_target", Target)
    monkeypatch.setattr(two_device, "run_two_device",
                        lambda engine, *a, baseline=None, **k: calls.update(engine=engine, baseline=baseline))
    monkeypatch.setattr(draft_memory, "draft_memory", lambda *a: None)
    monkeypatch.setattr(draft_memory, "memory_lines", lambda *a: [])
    monkeypatch.setattr(star_demo, "run_star_demo",
                        lambda *a, **k: calls.update(part_two=True) or {"targets": []})
    return calls


@pytest.mark.parametrize("argv, fmt", [([], "BF16"), (["--two-device-format", "Q8_0"], "Q8_0"),
                                       (["--two-device-format", "native"], "native"),
                                       (["--backend", "torch"], "native")])
def test_the_format_reaches_part_one(demo_calls, monkeypatch, argv, fmt):
    monkeypatch.setattr("export.target_format.wide_format", lambda: "BF16")   # the default: this CPU's
    res = CliRunner().invoke(hub_main, ["demo", *argv])
    assert res.exit_code == 0, res.output
    assert demo_calls["format"] == fmt and demo_calls["shared"].name == "shared"
    assert demo_calls["engine"] == "part-one-engine" and demo_calls["baseline"] == ("Q4_K_M", "shared")
    assert demo_calls["closed_before_part_two"] and demo_calls["part_two"]


@pytest.mark.parametrize("cpuinfo, fmt", [
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n", "BF16"),   # Zen 4
    ("processor\t: 0\nflags\t\t: fpu sse avx2 f16c fma\n", "F16"),                          # AVX2 only
    ("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16 i8mm\n", "BF16"),               # Arm v8.6
    ("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp asimddp\n", "F16"),                  # Arm v8.2: no bf16
    ("model name\t: x\n", "F16")])
def test_the_wide_format_follows_the_cpus_bf16_dot(tmp_path, cpuinfo, fmt):
    from export.target_format import wide_format
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    assert wide_format(str(tmp_path / "cpuinfo")) == fmt
    assert wide_format(str(tmp_path / "missing")) == "F16"


def test_no_two_device_converts_nothing(demo_calls):
    res = CliRunner().invoke(hub_main, ["demo", "--no-two-device"])
    assert res.exit_code == 0, res.output
    assert "format" not in demo_calls and demo_calls["part_two"]


def test_a_gguf_format_on_torch_is_refused_before_loading(demo_calls):
    res = CliRunner().invoke(hub_main, ["demo", "--backend", "torch", "--two-device-format", "F16"])
    assert res.exit_code == 2 and "--two-device-format" in res.output and "llamacpp" in res.output
    res = CliRunner().invoke(hub_main, ["demo", "--two-device-format", "Q5_K"])
    assert res.exit_code == 2 and "native" in res.output
    assert "format" not in demo_calls and "part_two" not in demo_calls
    assert "--two-device-format" in CliRunner().invoke(hub_main, ["demo", "--help"]).output


def test_native_target_is_the_shared_engine():
    with two_device.two_device_target("qwen2.5-coder-1.5b", "native", "shared") as (engine, baseline):
        assert engine == "shared" and baseline is None


def test_a_stored_format_gets_its_own_one_thread_engine_closed_on_exit(monkeypatch, tmp_path):
    import edge.engines.llamacpp_engine as llamacpp_engine
    import export.target_format as target_format
    src, f16 = tmp_path / "m-q4_k_m.gguf", tmp_path / "m-f16.gguf"
    opened = []

    class Engine:
        def __init__(self, path, max_len, n_seq_max, threads):
            self.args, self.closed = (Path(path), max_len, n_seq_max, threads), False
            opened.append(self)

        def close(self):
            self.closed = True
    monkeypatch.setattr("edge.model.reference.resolve_model", lambda spec: src)
    monkeypatch.setattr(target_format, "target_gguf", lambda name, fmt: f16)
    monkeypatch.setattr(llamacpp_engine, "LlamaCppEngine", Engine)
    out = io.StringIO()
    shared = SimpleNamespace(max_len=768)
    with two_device.two_device_target("m", "F16", shared, out=out) as (engine, baseline):
        assert engine is opened[0] and engine.args == (f16, 768, 1, 1) and not engine.closed
        assert baseline == ("Q4_K_M", shared)
    assert opened[0].closed                                  # part two does not hold its memory
    assert "target stored as F16 (m-f16.gguf)" in out.getvalue() and "memory-bound" in out.getvalue()


def test_format_name_reads_the_file_name():
    assert two_device.format_name(Path("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")) == "Q4_K_M"
    assert two_device.format_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "Q4_1"
    assert two_device.format_name(Path("model.gguf")) == "model.gguf"


def _row(label, alone, star_tps, baseline):
    mode = {"tok_s": star_tps, "speedup": star_tps / alone, "acceptance": 1.0, "gamma_mean": 3.0,
            "same_text": True, "split_at": None, "wait_overhead_ms": 5.0, "wait_per_draft_ms": 1.0}
    return {"label": label, "alone_tok_s": alone, "step_ms": 100.0, "verify_steps": {1: 1.0, 4: 1.6},
            "g3": mode, "baseline_tok_s": baseline}


def test_the_table_sets_the_fetched_file_alone_next_to_the_star():
    modes = two_device.parse_modes("3")
    lines = two_device.two_device_table([_row("a", 6.8, 13.0, 21.0), _row("b", 6.9, 7.0, 20.0)], modes, "Q4_K_M")
    scale = lines[-1]
    assert "the Q4_K_M file alone decodes 21.00 / 20.00 tok/s" in scale and "13.00 / 7.00" in scale
    assert "faster file on this CPU" in scale and "--two-device-format native" in scale
    lines = two_device.two_device_table([_row("a", 6.8, 13.0, 9.0)], modes, "Q4_K_M")
    assert "faster file" not in lines[-1]                    # said only when measured so
    rows = [_row("a", 6.8, 13.0, None)]
    assert not two_device.two_device_table(rows, modes)[-1].startswith("for scale")
