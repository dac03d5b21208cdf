"""`edge-agent plan --role prefill --bundle B` counts the adapters B's manifest lists: their GGUF
files' bytes, what a llama.cpp prefill worker loads from the bundle."""
import json

from click.testing import CliRunner

from edge.cli.plan_command import plan
from edge.model.gguf_header import read_gguf_header
from export.bundle import add_adapter, build_bundle
from harness.tiny_lora import peft_adapter


def test_plan_of_a_bundle_counts_its_adapters(exports, tmp_path):
    d = tmp_path / "bundle"
    build_bundle(exports.gguf("llama", "F32"), d, onnx_graphs=[], gguf_types=["F32"], log=lambda m: None)
    bare = json.loads(CliRunner().invoke(plan, ["--role", "prefill", "--bundle", str(d), "--json",
                                                "--memory-budget", "4G"]).output)
    for task, seed in (("tools", 1), ("code", 2)):
        peft_adapter(exports.model("llama"), tmp_path / task, seed=seed)
        add_adapter(d, tmp_path / task, task=task, log=lambda m: None)
    r = CliRunner().invoke(plan, ["--role", "prefill", "--bundle", str(d), "--json", "--memory-budget", "4G"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    files = [d / "adapters" / t / "adapter.gguf" for t in ("tools", "code")]
    assert got["adapters"] == 2 and "adapters" not in bare["parts_bytes"]
    assert got["parts_bytes"]["adapters"] == sum(f.stat().st_size for f in files)
    tensors = sum(t.n_bytes for f in files for t in read_gguf_header(f).tensors)
    assert tensors < got["parts_bytes"]["adapters"] < tensors + 2 * 64 * 1024   # tensors + small headers
    assert got["total_bytes"] - bare["total_bytes"] == got["parts_bytes"]["adapters"]
