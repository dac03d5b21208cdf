"""The planner's adapter bytes are the saved adapter's tensor bytes; a plan with adapters that do not
fit is refused with the reason (issue 37 point 4)."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge.cli.plan_command import plan
from edge.memory.adapters import adapter_bytes, parse_targets, specialists_that_fit
from edge.memory.model_shape import read_shape
from edge.model.gguf_header import read_gguf_header
from edge.model.lora.adapter import init_adapter
from edge.model.lora.files import save_adapter
from edge.memory.model_shape import safetensors_bytes
from edge.model.transformer import ModelConfig

SMOL = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _config_of(shape) -> ModelConfig:
    return ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                       head_dim=shape.head_dim)


@pytest.mark.parametrize("rank,targets", [(8, "q,k,v,o,gate,up,down"), (16, "q,v"), (3, "down")])
def test_plan_adapter_bytes_equal_the_saved_adapters_tensor_bytes(tmp_path, rank, targets):
    shape = read_shape(str(SMOL))
    ad = init_adapter(_config_of(shape), rank, targets=parse_targets(targets), seed=1)
    d = save_adapter(tmp_path / "a", ad)
    saved = safetensors_bytes(sorted(Path(d).glob("*.safetensors")))
    assert saved == ad.nbytes == adapter_bytes(shape, rank, parse_targets(targets), itemsize=4)


@pytest.mark.parametrize("ftype,itemsize", [("F32", 4), ("F16", 2)])
def test_plan_adapter_bytes_equal_the_gguf_loras_tensor_bytes(tmp_path, ftype, itemsize):
    from export.gguf_lora import read_base, read_peft_lora, write_gguf_lora
    shape = read_shape(str(SMOL))
    ad = init_adapter(_config_of(shape), 8, targets=parse_targets("q,k,v,o"), seed=2)
    d = save_adapter(tmp_path / "a", ad)
    out = write_gguf_lora(read_peft_lora(d), read_base(SMOL), tmp_path / "a.gguf", ftype=ftype)
    stored = sum(t.n_bytes for t in read_gguf_header(out).tensors)
    assert stored == adapter_bytes(shape, 8, parse_targets("q,k,v,o"), itemsize=itemsize)


def _plan(*extra):
    return CliRunner().invoke(plan, ["--role", "prefill", "-m", str(SMOL), "--json", *extra])


def test_plan_adds_n_adapters_to_the_prefill_worker():
    import json
    none = json.loads(_plan("--memory-budget", "2G").output)
    many = json.loads(_plan("--memory-budget", "2G", "--adapters", "10", "--adapter-rank", "8").output)
    one = adapter_bytes(read_shape(str(SMOL)), 8)
    assert many["parts_bytes"]["adapters"] == 10 * one
    assert many["total_bytes"] - none["total_bytes"] == 10 * one
    assert many["specialists"]["adapters"] > many["specialists"]["full_copies"] > 0


def test_planner_refuses_adapters_that_do_not_fit_saying_how_many_do():
    r = CliRunner().invoke(plan, ["--role", "prefill", "-m", str(SMOL), "--memory-budget", "1G",
                                  "--adapters", "64", "--adapter-rank", "64"])
    assert r.exit_code == 0, r.output
    assert "NO, short by" in r.output and "hold at most 6 adapters of 78.15 MB" in r.output


def test_run_check_refuses_adapters_over_the_budget_with_the_reason():
    import click
    from edge.cli.plan_command import make_plan, refusal
    from edge.model.resolved import resolve
    f, _ = make_plan("prefill", resolve(str(SMOL), role="prefill"), 10 ** 9,
                     adapters=(64, 64, parse_targets("q,k,v,o,gate,up,down"), 4))
    assert not f.fits
    why = refusal(f, "--memory-budget 1G")
    assert "adapters 5.002" in why and "hold at most 6 adapters" in why
    with pytest.raises(click.UsageError, match="only the prefill worker holds adapters"):
        make_plan("target", resolve(str(SMOL), role="target"), 10 ** 9, adapters=(1, 8, ("q_proj",), 4))


def test_bad_adapter_arguments_are_clear_errors():
    assert "unknown adapter target 'x'" in _plan("--adapters", "2", "--adapter-targets", "q,x").output
    assert "positive integer" in _plan("--adapters", "2", "--adapter-rank", "0").output
    with pytest.raises(ValueError):
        adapter_bytes(read_shape(str(SMOL)), 0)


def test_specialists_that_fit_divides_what_is_left():
    sp = specialists_that_fit(1000, 300, 7)
    assert (sp.full_copies, sp.adapters) == (3, 142)
    assert specialists_that_fit(-5, 300, 7).adapters == 0
