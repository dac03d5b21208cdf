"""Device profiles and the provisioning plan."""
import pytest
from click.testing import CliRunner

from devices.profile import list_profiles, load_profile
from devices.provision import main as provision, plan


def test_every_profile_loads_and_is_sane():
    names = list_profiles()
    assert {"cpu-2core", "jetson-orin-nano-8gb"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert 0 < p.usable_memory_gb <= p.memory_gb
        assert p.verify_cost(1, 1e9, 5e8) == pytest.approx(1.0)
        assert p.verify_cost(8, 1e9, 5e8) >= p.verify_cost(2, 1e9, 5e8) >= 1.0


def test_memory_bound_device_verifies_k_tokens_for_about_one_step():
    jet = load_profile("jetson-orin-nano-8gb")
    cpu = load_profile("cpu-2core")
    wbytes, params = 1.1e9, 1.5e9  # Qwen2.5-Coder-1.5B Q4_K_M
    assert jet.verify_cost(5, wbytes, params) < 1.2
    assert cpu.verify_cost(5, wbytes, params) > 2.0  # measured on these CPUs (DATA.md)


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="known"):
        load_profile("toaster")


def test_provision_plan_and_dry_run():
    cmds = plan("nv@jet", "jetson-orin-nano-8gb", "draft", "mqtt://pc:1883", "w.whl", None, None, "")
    flat = [" ".join(c) for c in cmds]
    assert any("onnxruntime-gpu" in c for c in flat)
    assert any("--role draft --hub mqtt://pc:1883" in c for c in flat)
    r = CliRunner().invoke(provision, ["--device", "nv@jet", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "dry run: nothing was changed" in r.output
    r = CliRunner().invoke(provision, [])
    assert r.exit_code != 0 and "--device" in r.output
