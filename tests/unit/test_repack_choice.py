"""--repack auto|on|off|both (edge/engines/llamacpp_repack.py) and --exact-rows: what llama.cpp is told for a
GGUF, and why, from its weight types (read from the real files' headers) and the build (the AMX guard wins over
`on`); the placement carries the mode to the engine's arguments; click refuses other values."""
import pytest
from click.testing import CliRunner

from edge.engines.llamacpp_repack import SLOWER_PREFILL, choose_repack, unrepacked_types
from edge.engines.placement import Capabilities, PlacementError, decide_placement
from harness.agent_asks import fetched_or_skip

CPU = Capabilities(llama_gpu_offload=False, ort_providers=("CPUExecutionProvider",), torch_cuda=False)


@pytest.fixture(scope="module")
def q4_k_m():
    return str(fetched_or_skip("qwen2.5-coder-1.5b")[0])


def test_auto_keeps_todays_choice(q4_k_m, exports):
    assert unrepacked_types(q4_k_m) == ["Q4_K", "Q6_K"]
    c = choose_repack(None, False, q4_k_m)
    assert (c.extra_bufts, c.on, c.amx_guard) == (False, False, False)
    assert c.describe().startswith("weight repacking off (auto: Q4_K, Q6_K weights stay unrepacked: a long prompt "
                                   "prefills slower repacked (docs/models.md), or not measured; --repack on decodes")
    f32 = str(exports.gguf("llama"))                       # F32 only: llama.cpp's own default (on)
    c = choose_repack(None, False, f32)
    assert (c.extra_bufts, c.on) == (None, True) and "every weight type" in c.why


def test_on_and_off_are_what_was_asked(q4_k_m, exports):
    on = choose_repack(True, False, q4_k_m)
    assert (on.extra_bufts, on.on) == (True, True)
    assert on.describe() == f"weight repacking on (on as asked; {SLOWER_PREFILL})"
    assert choose_repack(True, False, str(exports.gguf("llama"))).why == "on as asked"
    off = choose_repack(False, False, q4_k_m)
    assert (off.extra_bufts, off.why) == (False, "off as asked")
    assert choose_repack(False, True, q4_k_m).why == "off as asked"


def test_the_amx_guard_wins_over_on(q4_k_m, exports):
    for path in (q4_k_m, str(exports.gguf("llama"))):
        c = choose_repack(True, True, path)
        assert (c.extra_bufts, c.on, c.amx_guard) == (False, False, True)
        assert c.why.startswith("on was asked, refused: this llama.cpp was built with ggml's AMX backend")
        assert "`make llama`" in c.why
        auto = choose_repack(None, True, path)
        assert (auto.extra_bufts, auto.amx_guard) == (False, True) and auto.why.startswith("auto: ")


def test_an_unreadable_header_is_not_trusted(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    assert unrepacked_types(str(bad)) is None
    assert choose_repack(None, False, str(bad)).extra_bufts is False
    assert choose_repack(True, False, str(bad)).extra_bufts is True


def test_the_placement_carries_the_mode_to_the_engine():
    assert decide_placement("llamacpp", "cpu", None, None, CPU).engine_kwargs() == {"n_gpu_layers": 0}
    on = decide_placement("llamacpp", "cpu", None, None, CPU, repack="on")
    assert on.engine_kwargs() == {"n_gpu_layers": 0, "extra_bufts": True}
    assert on.describe().startswith("llamacpp on cpu: all layers on the CPU, --repack on (")
    off = decide_placement("llamacpp", "auto", None, None, CPU, repack="off")
    assert off.engine_kwargs() == {"n_gpu_layers": 0, "extra_bufts": False}
    onnx = decide_placement("onnx", "cpu", None, None, CPU, repack="on")     # said, not passed on
    assert onnx.engine_kwargs() == {"providers": ["CPUExecutionProvider"]}
    assert onnx.warnings == ("--repack on is for llama.cpp models; onnx ignores it",)
    exact = decide_placement("llamacpp", "cpu", None, None, CPU, exact_rows=True)
    assert exact.engine_kwargs() == {"n_gpu_layers": 0, "exact_rows": True}
    assert exact.describe().startswith("llamacpp on cpu: all layers on the CPU, --exact-rows (")
    torch = decide_placement("torch", "cpu", None, None, CPU, exact_rows=True)
    assert torch.warnings == ("--exact-rows is for llama.cpp models; torch ignores it",)
    with pytest.raises(PlacementError, match="--repack 'maybe': use auto, on, off or both"):
        decide_placement("llamacpp", "cpu", None, None, CPU, repack="maybe")


def test_both_loads_a_repacked_model_with_an_unrepacked_twin():
    both = decide_placement("llamacpp", "cpu", None, None, CPU, repack="both")
    assert both.engine_kwargs() == {"n_gpu_layers": 0, "extra_bufts": True, "prefill_twin": True}
    assert both.describe().startswith("llamacpp on cpu: all layers on the CPU, --repack both (")
    with pytest.raises(PlacementError, match="--repack both cannot go with --exact-rows"):
        decide_placement("llamacpp", "cpu", None, None, CPU, repack="both", exact_rows=True)
    torch = decide_placement("torch", "cpu", None, None, CPU, repack="both", exact_rows=True)
    assert torch.warnings == ("--repack both is for llama.cpp models; torch ignores it",
                              "--exact-rows is for llama.cpp models; torch ignores it")


@pytest.mark.parametrize("argv", [
    ["run", "--role", "target", "-m", "m.gguf", "--repack", "maybe"],
    ["generate", "hi", "-D", "ngram", "--repack", "maybe"],
    ["plan", "--role", "target", "-m", "m.gguf", "--repack", "maybe"],
])
def test_click_refuses_other_values(argv):
    from edge.cli.agent import main as agent
    r = CliRunner().invoke(agent, argv)
    assert r.exit_code == 2, r.output
    assert "Invalid value for '--repack': 'maybe' is not one of 'auto', 'on', 'off', 'both'" in r.output


def test_the_hub_refuses_other_values():
    from server.hub_cli import main as hub
    r = CliRunner().invoke(hub, ["serve", "--repack", "yes"])
    assert r.exit_code == 2 and "Invalid value for '--repack': 'yes' is not one of 'auto', 'on', 'off', 'both'" in r.output


def test_the_plan_takes_repack_and_counts_one_copy_of_the_weights(q4_k_m):
    """Repacked weights are read, not mapped (LlamaCppEngine.mmap): one copy resident either way, so
    the estimate is the same (measured: benchmarks/device/memory_plan.py's repack=on cases)."""
    import json

    from edge.cli.agent import main as agent
    got = {}
    for mode in ("on", "off", "auto", "both"):
        r = CliRunner().invoke(agent, ["plan", "--role", "target", "-m", q4_k_m, "--profile", "x86-cpu-generic",
                                       "--repack", mode, "--json"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        assert d["placement"]["repack"] == mode
        got[mode] = d["total_bytes"]
        parts = d["parts_bytes"]
        assert ("prefill twin" in parts) == (mode == "both")
    assert got["on"] == got["off"] == got["auto"]
    # both: the repacked copy of the file, the twin's one sequence of KV and the buffer it moves through
    assert got["both"] - got["on"] == parts["prefill twin"] > 1_000_000_000
