"""AdapterPrefillWorker (edge/sun/adapter_prefill.py) with the torch backend, on a tiny float64 base:

* one step prefills queued prompts of several tasks in ONE lora_prefill call, and every row gets
  what its task alone gives: the same first token, the same KV (within 1e-12), and the shared
  decoder continues it to the in-process split run's greedy output;
* adapters added while the worker holds others: a bad one (sha256, rank, target, shape, corrupt
  file) is refused with what is wrong, and the worker's tasks and outputs are unchanged.
"""
import hashlib
import shutil

import numpy as np
import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.kv import SequenceKV
from edge.model.lora.error import AdapterError
from edge.model.sun_modules import weights_fingerprint
from edge.sun.adapter_prefill import AdapterPrefillWorker
from edge.sun.adapter_torch import TorchAdapterBackend
from edge.sun.decoder import SharedDecoder
from harness.sun_adapters import Reference, edit_config, trained_adapter
from harness.tiny_models import random_model

TASKS = ("code", "maths", "tools")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = random_model(3)
    made = {t: trained_adapter(base, root, t, seed=i + 1) for i, t in enumerate(TASKS)}
    return base, weights_fingerprint(base), made, root


def worker_of(base, fp, made, tasks=TASKS):
    w = AdapterPrefillWorker(TorchAdapterBackend(base, fp), kv_dtype="float64", max_rows=8)
    for t in tasks:
        w.add(t, made[t][0], sha256=made[t][1])
    return w


def kv_of(blob):
    kv, head = SequenceKV.from_bytes(blob, dtype=torch.float64)
    return kv.data[:, :, :, : kv.length], head


def test_a_mixed_task_step_gives_each_row_what_its_task_alone_gives(setup):
    base, fp, made, _ = setup
    g = np.random.default_rng(0)
    jobs = [(t, g.integers(3, 256, size=n).tolist()) for t, n in
            zip(("maths", "code", "tools", "maths", "code"), (5, 11, 3, 8, 7))]
    w = worker_of(base, fp, made)
    for i, (t, p) in enumerate(jobs):
        w.submit(p, f"r{i}", task=t)
    mixed = w.step()                          # one step, every row
    assert w.steps == [tuple(t for t, _ in jobs)] and not w.has_work()
    ref = Reference(base, {t: made[t][0] for t in TASKS})
    dec = SharedDecoder(TorchEngine(base, fingerprint=fp), max_batch=8)
    for i, ((t, p), out) in enumerate(zip(jobs, mixed)):
        alone = worker_of(base, fp, made, tasks=[t])
        alone.submit(p, "solo", task=t)
        solo = alone.step()[0]
        assert (out.task, out.first_token, out.decoder_fingerprint) == (t, solo.first_token, fp)
        got, head = kv_of(out.blob)
        want, _ = kv_of(solo.blob)
        assert got.shape == want.shape and float((got - want).abs().max()) < 1e-12
        assert head["meta"]["task"] == t and head["tokens"] == p
        # the shared decoder continues the row to what the split run gives for that task
        dec.admit(out.blob, f"d{i}", max_new=6, first_token=out.first_token)
        while dec.has_work():
            dec.step()
        assert dec.pop_result(f"d{i}").tokens == ref.expect(t, p, 6)


def bad_adapters(base, made, root):
    """(name, path, sha256, what the refusal must say) of every way an added adapter can be wrong."""
    good_dir, good_sha = made["tools"]
    out = [("sha256 mismatch", good_dir, "0" * 64, "sha256")]
    rank = shutil.copytree(good_dir, root / "bad-rank")
    edit_config(rank, r=8)
    out.append(("wrong rank", rank, good_sha, "wrong rank"))
    module = shutil.copytree(good_dir, root / "bad-module")
    edit_config(module, target_modules=["q_proj", "x_proj"])
    out.append(("unknown module", module, good_sha, "x_proj"))
    other = random_model(4, intermediate_size=96)
    shape_dir, shape_sha = trained_adapter(other, root / "other", "shape", seed=9, record_base=False)
    out.append(("wrong base shape", shape_dir, shape_sha, "wrong base shape"))
    corrupt = shutil.copytree(good_dir, root / "bad-corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    out.append(("corrupt file", corrupt, hashlib.sha256(b"\x00garbage" * 10).hexdigest(), "safetensors"))
    return out


def test_bad_adapters_are_refused_and_the_worker_serves_on(setup, tmp_path):
    base, fp, made, _ = setup
    w = worker_of(base, fp, made, tasks=["maths"])
    prompt = [5, 9, 33, 120, 7]
    w.submit(prompt, "before", task="maths")
    before = w.step()[0]
    for what, path, sha, says in bad_adapters(base, made, tmp_path):
        with pytest.raises(AdapterError, match=says):
            w.add("tools", path, sha256=sha)
        assert w.tasks == ["maths"], what
    w.submit(prompt, "after", task="maths")
    after = w.step()[0]
    assert after.first_token == before.first_token and after.blob != b""
    assert torch.equal(kv_of(after.blob)[0], kv_of(before.blob)[0])
    w.add("tools", *made["tools"])                  # the good one still loads
    assert w.tasks == ["maths", "tools"]


def test_torch_worker_adds_a_bundle_entry_checked_against_its_manifest(tmp_path):
    """bundle=True: the PEFT files of the bundle's entry, the request's sha256 = the entry's GGUF as
    the manifest lists it; a wrong digest or a tampered file of the entry is refused."""
    import json

    from edge.model.sun_modules import load_module
    from export.bundle import add_adapter, build_bundle
    from harness.console_scripts import hf_model, sun_dirs
    dec_dir, _ = sun_dirs(tmp_path)
    sun = tmp_path / "sun"
    build_bundle(dec_dir, sun, onnx_graphs=(), gguf_types=("F32",), tokenizer=hf_model(tmp_path / "hf"),
                 log=lambda *_: None)
    base, _ = load_module(dec_dir)
    peft, _ = trained_adapter(base, tmp_path / "peft", "tools", seed=4)
    add_adapter(sun, peft, task="tools", log=lambda *_: None)
    entry = json.loads((sun / "manifest.json").read_text())["adapters"][0]
    listed = entry["files"][0]["sha256"]
    w = AdapterPrefillWorker(TorchAdapterBackend(base, weights_fingerprint(base)), kv_dtype="float64")
    with pytest.raises(AdapterError, match="sha256 mismatch"):
        w.add("tools", sun, sha256="0" * 64, bundle=True)
    weights = sun / "adapters/tools/adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-4] + b"\x00\x00\x00\x01")
    with pytest.raises(Exception, match="sha256"):
        w.add("tools", sun, sha256=listed, bundle=True)
    assert w.tasks == []
    weights.write_bytes(good)
    w.add("tools", sun, sha256=listed, bundle=True)
    ref = Reference(base, {"tools": peft})
    w.submit([7, 8, 9, 100], "r", task="tools")
    out = w.step()[0]
    assert out.first_token == ref.expect("tools", [7, 8, 9, 100], 1)[0]
