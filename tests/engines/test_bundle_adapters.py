"""Bundles with one base and many LoRA adapters (export/bundle.py add_adapter, edge/engines/lora_bundle.py):
the manifest lists each adapter's task, rank, targets and files with sha256; a device checks them
before llama.cpp loads one, refuses a tampered adapter and keeps the others."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edge.engines.loader import BundleError
from edge.engines.lora_bundle import adapter_file, check_adapters, load_bundle_adapters
from export.bundle import add_adapter, build_bundle, describe, validate_bundle
from export.export_cli import main as export_cli

from harness.tiny_lora import peft_adapter

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
from edge.engines.llamacpp_lora import LlamaCppAdapters  # noqa: E402
from edge.engines.loader import load_engine  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8]


def quiet(msg):
    pass


@pytest.fixture
def bundle(exports, tmp_path):
    """A bundle of the tiny llama (F32 GGUF) with two adapters, tools (all modules) and code (q, v)."""
    d = tmp_path / "bundle"
    build_bundle(exports.gguf("llama", "F32"), d, onnx_graphs=[], gguf_types=["F32"], log=quiet)
    merged = {}
    for task, seed, targets in (("tools", 1, None), ("code", 2, ["q_proj", "v_proj"])):
        kw = {"targets": targets} if targets else {}
        merged[task] = peft_adapter(exports.model("llama"), tmp_path / task, seed=seed, **kw)
        add_adapter(d, tmp_path / task, task=task, log=quiet)
    return d, merged


def test_two_adapters_round_trip(bundle, exports):
    d, merged = bundle
    man = validate_bundle(d)
    entries = {a["task"]: a for a in man["adapters"]}
    assert set(entries) == {"tools", "code"}
    assert entries["tools"]["rank"] == 4 and entries["tools"]["alpha"] == 8.0
    assert entries["tools"]["targets"] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert entries["code"]["targets"] == ["q", "v"]
    base = man["artifacts"][0]
    assert entries["code"]["base"] == base["name"] and entries["code"]["base_fingerprint"] == base["fingerprint"]
    assert [f["path"] for f in entries["code"]["files"]] == [
        "adapters/code/adapter.gguf", "adapters/code/adapter_config.json", "adapters/code/adapter_model.safetensors"]
    shown = "\n".join(describe(d))
    assert "adapter tools" in shown and "adapter code" in shown and "q,v" in shown
    # a device loads the base and both adapters from the bundle: each gives its task's logits
    e = load_engine(d, backend="llamacpp", max_len=64, n_seq_max=2, threads=1, kv_type="f32", flash_attn=False)
    ad = LlamaCppAdapters(e)
    assert load_bundle_adapters(ad, d) == {} and sorted(ad.names) == ["code", "tools"]
    for task in ("tools", "code"):
        with torch.no_grad():
            ref = merged[task](torch.tensor([PROMPT]))[0][0].numpy()
        s = e.new_sequence()
        with ad.using(task):
            got = e.forward(s, PROMPT)
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
        e.free(s)
    ad.close()
    e.close()


def test_a_tampered_adapter_is_refused_by_sha256(bundle):
    d, _ = bundle
    entry = check_adapters(d, tasks=["code"])[0]
    path = adapter_file(d, entry)
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0x40                                  # one bit of a tensor value: same size, other bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="adapter 'code'.*sha256"):
        check_adapters(d)
    with pytest.raises(BundleError, match="sha256"):
        validate_bundle(d)
    check_adapters(d, deep=False)                    # sizes alone cannot see it
    # the device refuses that adapter and serves the other
    e = load_engine(d, backend="llamacpp", max_len=64, n_seq_max=2, threads=1)
    ad = LlamaCppAdapters(e)
    refused = load_bundle_adapters(ad, d)
    assert list(refused) == ["code"] and "sha256" in refused["code"] and ad.names == ["tools"]
    with ad.using("tools"):
        assert e.forward(e.new_sequence(), PROMPT).shape == (len(PROMPT), e.vocab_size)
    ad.close()
    e.close()


def test_bad_manifest_entries_and_tasks(bundle, tmp_path):
    d, _ = bundle
    with pytest.raises(BundleError, match="no adapter for maths"):
        check_adapters(d, tasks=["maths"])
    with pytest.raises(BundleError, match="task name"):
        add_adapter(d, tmp_path / "tools", task="../evil", log=quiet)
    man = json.loads((d / "manifest.json").read_text())
    man["adapters"][0]["files"][0]["path"] = "../../etc/passwd"
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BundleError, match="outside the bundle"):
        check_adapters(d)


def test_cli_adds_an_adapter_to_a_bundle(bundle, tmp_path):
    d, _ = bundle
    r = CliRunner().invoke(export_cli, ["adapter", str(tmp_path / "code"), str(d), "--bundle", "--task", "sql"])
    assert r.exit_code == 0, r.output
    assert "adapter sql" in r.output
    assert {a["task"] for a in check_adapters(d)} == {"tools", "code", "sql"}
    r = CliRunner().invoke(export_cli, ["bundle", str(d), "--show"])
    assert r.exit_code == 0 and "adapter sql" in r.output and "bundle OK" in r.output
    r = CliRunner().invoke(export_cli, ["adapter", str(tmp_path / "code"), str(tmp_path / "nobundle"), "--bundle"])
    assert r.exit_code == 1 and "not a bundle" in r.output
