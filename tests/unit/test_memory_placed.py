"""Memory plans that know where bytes live (edge/memory/placed.py): a Jetson's GPU shares its
usable memory, a discrete GPU's VRAM and host RAM are separate budgets, and a role that does not
fit where it is placed is refused with the side and the reason."""
import click
import pytest
from click.testing import CliRunner

from devices.profile import load_profile
from edge.cli.agent import main
from edge.cli.plan_command import check_before_load
from edge.engines.placement import Capabilities, decide_placement
from edge.memory.model_shape import read_shape
from edge.memory.placed import MemorySides, check_sides, gpu_fraction, planned_placement, split
from edge.memory.fit import Workload, estimate

GB = 1e9
CUDA = Capabilities(llama_gpu_offload=True, torch_cuda=True)


def target_estimate(context=4096, sequences=1, backend="llamacpp"):
    return estimate(read_shape("qwen2.5-coder-1.5b"), Workload("target", backend, context, sequences))


def test_profiles_give_their_sides():
    jetson = MemorySides.of_profile(load_profile("jetson-orin-nano-8gb"))
    assert (jetson.host, jetson.gpu, jetson.unified) == (int(5.2 * GB), None, True)
    rtx = MemorySides.of_profile(load_profile("rtx4090-workstation"))
    assert (rtx.host, rtx.gpu, rtx.unified) == (int(56 * GB), int(22.5 * GB), False)
    cpu = MemorySides.of_profile(load_profile("x86-cpu-generic"), budget=int(3 * GB))
    assert (cpu.host, cpu.gpu) == (int(3 * GB), None)       # --memory-budget stands for the placed side


def test_split_follows_the_layers_on_the_gpu():
    e = target_estimate()
    layers = e.shape.layers
    all_on = decide_placement("llamacpp", "auto", None, None, CUDA)
    half = decide_placement("llamacpp", "auto", layers // 2, None, CUDA)
    assert gpu_fraction(all_on, layers) == 1.0 and gpu_fraction(half, layers) == pytest.approx(0.5, abs=0.02)
    host, gpu = split(e, 1.0)
    assert host + gpu == e.total
    assert host == e.parts["runtime"] + e.parts["tokenizer"]             # the process stays on the host
    h2, g2 = split(e, gpu_fraction(half, layers))
    assert h2 + g2 == e.total and g2 < gpu and h2 > host
    assert split(e, 0.0) == (e.total, 0)
    saved = estimate(e.shape, Workload("target", "llamacpp", 4096, 1, cache_slots=2, saved_bytes=10 ** 8))
    assert saved.parts["saved prompts"] == 10 ** 8                       # copied off the GPU: host memory
    assert split(saved, 1.0)[0] == saved.parts["runtime"] + saved.parts["tokenizer"] + 10 ** 8


def test_unified_pool_counts_both_sides_together():
    e = target_estimate(context=32768, sequences=4)              # ~3.7 GB of f16 KV on top of the weights
    host, gpu = split(e, 1.0)
    shared = MemorySides("jetson", host=gpu + host // 2, unified=True)
    assert gpu < shared.host                                     # the GPU side alone would fit ...
    why = check_sides(e, 1.0, shared)                            # ... but the pool holds both
    assert why and "CPU and GPU share it" in why


def test_discrete_gpu_checks_vram_and_host_apart():
    e = target_estimate(context=32768, sequences=4)
    host, gpu = split(e, 1.0)
    roomy_host = MemorySides("ws", host=int(64 * GB), gpu=int(gpu * 0.8))
    assert "on the GPU" in check_sides(e, 1.0, roomy_host)
    assert check_sides(e, 0.5, MemorySides("ws", host=int(64 * GB), gpu=int(gpu * 0.8))) is None
    small_host = MemorySides("ws", host=int(host * 0.5), gpu=int(64 * GB))
    assert "host RAM" in check_sides(e, 1.0, small_host)
    assert check_sides(e, 1.0, MemorySides("ws", host=None, gpu=int(64 * GB))) is None   # host not said


def test_plan_assumes_the_profiles_gpu_and_shows_the_sides():
    p = planned_placement("llamacpp", "auto", None, load_profile("jetson-orin-nano-8gb"))
    assert p.device == "cuda" and p.gpu_layers == -1
    assert planned_placement("llamacpp", "auto", None, load_profile("x86-cpu-generic")).device == "cpu"
    out = CliRunner().invoke(main, ["plan", "--profile", "rtx4090-workstation", "--role", "draft", "-m",
                                    "qwen2.5-coder-0.5b", "-b", "torch", "--dtype", "bfloat16",
                                    "--max-sessions", "4000"])
    assert out.exit_code == 0, out.output
    assert "on the GPU" in out.output and "NO: it needs" in out.output and "GPU has 22.50 GB" in out.output


def _q05_torch():
    from edge.model.resolved import resolve
    return resolve("qwen2.5-coder-0.5b", "torch", "draft")


def test_run_refuses_a_gpu_placement_that_does_not_fit_the_gpu():
    big = decide_placement("torch", "cuda", None, None, CUDA)
    with pytest.raises(click.ClickException) as e:
        check_before_load("draft", _q05_torch(), 4096, "rtx4090-workstation", None,
                          max_sessions=4000, dtype="bfloat16", max_kv_mb=None, placement=big)
    assert "placed on cuda does not fit profile rtx4090-workstation" in e.value.message
    assert "GPU has 22.50 GB" in e.value.message
    # the same role with a handful of sessions fits the card
    assert check_before_load("draft", _q05_torch(), 4096, "rtx4090-workstation", None,
                             max_sessions=8, dtype="bfloat16", placement=big) == {}


def test_a_cpu_placement_on_a_gpu_workstation_is_checked_against_host_ram():
    """The card's 22.5 GB is not the budget of a model on the workstation's CPU: its 56 GB of RAM is."""
    cpu = decide_placement("torch", "cpu", None, None, CUDA)
    assert check_before_load("draft", _q05_torch(), 4096, "rtx4090-workstation", None,
                             max_sessions=800, dtype="bfloat16", placement=cpu) == {}   # ~40 GB
    with pytest.raises(click.ClickException, match="does not fit profile rtx4090-workstation"):
        check_before_load("draft", _q05_torch(), 4096, "rtx4090-workstation", None,
                          max_sessions=800, dtype="bfloat16")          # unplaced: the card's 22.5 GB, as before
    with pytest.raises(click.ClickException, match="placed on cpu does not fit .* of host RAM"):
        check_before_load("draft", _q05_torch(), 4096, "rtx4090-workstation", None,
                          max_sessions=4000, dtype="bfloat16", placement=cpu)


def test_plan_json_says_where_the_bytes_live():
    import json
    out = CliRunner().invoke(main, ["plan", "--profile", "jetson-orin-nano-8gb", "--role", "target", "-m",
                                    "qwen2.5-coder-1.5b", "-b", "llamacpp", "--gpu-layers", "14", "--json"])
    assert out.exit_code == 0, out.output
    p = json.loads(out.output)["placement"]
    assert (p["device"], p["gpu_layers"], p["unified"], p["refusal"]) == ("cuda", 14, True, None)
    assert 0 < p["gpu_fraction"] < 1 and p["host_bytes"] + p["gpu_bytes"] == json.loads(out.output)["total_bytes"]
    cpu = CliRunner().invoke(main, ["plan", "--profile", "jetson-orin-nano-8gb", "--role", "target", "-m",
                                    "qwen2.5-coder-1.5b", "-b", "llamacpp", "--accelerator", "cpu", "--json"])
    assert json.loads(cpu.output)["placement"]["gpu_bytes"] == 0
