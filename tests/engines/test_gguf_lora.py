"""GGUF LoRA adapters (export/gguf_lora.py, edge/engines/lora_gguf.py, edge/engines/llamacpp_lora.py).

A PEFT-written adapter of a tiny random llama / qwen2 becomes a GGUF LoRA that llama.cpp loads
beside the F32 base GGUF (export/gguf.py). The reference is PEFT's own merge (W + scale B A in a
copy of the torch weights). Tolerance: docs/models.md (Runtimes) says to compare backends by logit
closeness, not equality; with F32 weights, an F32 KV cache and flash attention off only the
summation order differs, so the bound is test_gguf_export.py's F32 one, 1e-4 of the logit scale
(measured here: ~2e-7 of it). llama.cpp's CPU flash attention works in F16 inside, hence off.
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFReader
from safetensors.numpy import load_file, save_file

from edge.engines.lora_gguf import AdapterError, check_adapter, read_adapter
from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer, tiny_config
from export.export_cli import main as export_cli
from export.gguf import permute_qk, write_gguf
from export.gguf_lora import AdapterExportError, export_adapter, read_peft_lora

from harness.tiny_lora import peft_adapter

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
from edge.engines.llamacpp_engine import LlamaCppEngine  # noqa: E402
from edge.engines.llamacpp_lora import LlamaCppAdapters  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 140, 2, 31, 199]


def quiet(msg):
    pass


def close(got, want, rel=1e-4):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err <= rel * scale, f"max |delta| {err:.3g} > {rel:g} x {scale:.3g}"
    return err


def lcpp(base):
    return LlamaCppEngine(base, max_len=64, n_seq_max=4, threads=1, kv_type="f32", flash_attn=False)


@pytest.fixture(scope="module")
def made(exports, tmp_path_factory):
    """{arch: (base gguf, base model, {task: (adapter gguf, merged torch model, peft dir)})}."""
    out = {}
    root = tmp_path_factory.mktemp("lora")
    for arch in ("llama", "qwen2"):
        m = exports.model(arch)
        tasks = {}
        for task, seed, targets in (("tools", 1, None), ("code", 2, ["q_proj", "v_proj", "down_proj"])):
            d = root / f"{arch}-{task}"
            kw = {"targets": targets} if targets else {}
            merged = peft_adapter(m, d, seed=seed, **kw)
            g = export_adapter(d, exports.gguf(arch, "F32"), root / f"{arch}-{task}.gguf", task=task, log=quiet)
            tasks[task] = (g, merged, d)
        out[arch] = (exports.gguf(arch, "F32"), m, tasks)
    return out


def test_adapter_file_is_llamacpps_format(made):
    base, model, tasks = made["llama"]
    path, _, peft_dir = tasks["tools"]
    r = GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.type"] == "adapter" and f["adapter.type"] == "lora"
    assert f["adapter.lora.alpha"] == 8.0 and f["general.architecture"] == "llama"
    assert f["starsun.adapter.task"] == "tools"
    kinds = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    want = {f"blk.{i}.{k}.weight.lora_{ab}" for i in range(2) for k in kinds for ab in "ab"}
    by_name = {t.name: t for t in r.tensors}
    assert set(by_name) == want
    peft = load_file(str(peft_dir / "adapter_model.safetensors"))
    pre = "base_model.model.model.layers.0"
    a, b = by_name["blk.0.attn_q.weight.lora_a"], by_name["blk.0.attn_q.weight.lora_b"]
    assert list(a.shape) == [64, 4] and list(b.shape) == [4, 64]          # ne: [in, r], [r, out]
    np.testing.assert_array_equal(np.asarray(a.data), peft[f"{pre}.self_attn.q_proj.lora_A.weight"])
    # q's B rows permuted exactly as the base's q rows (4 heads); v's B as it is
    want_b = permute_qk(torch.from_numpy(peft[f"{pre}.self_attn.q_proj.lora_B.weight"]), 4).numpy()
    np.testing.assert_array_equal(np.asarray(b.data), want_b)
    assert not np.array_equal(want_b, peft[f"{pre}.self_attn.q_proj.lora_B.weight"])
    np.testing.assert_array_equal(np.asarray(by_name["blk.1.attn_v.weight.lora_b"].data),
                                  peft["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    info = check_adapter(path, base)
    assert (info.ranks, info.targets, info.layers, info.pairs) == ((4,), ("q", "k", "v", "o", "gate", "up", "down"),
                                                                   (0, 1), 14)
    assert read_adapter(tasks["code"][0])[0].targets == ("q", "v", "down")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llamacpp_with_adapter_matches_torch_logits_and_kv(made, arch):
    from edge.model.kv import SequenceKV
    base, model, tasks = made[arch]
    path, merged, _ = tasks["tools"]
    with torch.no_grad():
        ref = merged(torch.tensor([PROMPT]))[0][0].numpy()
        plain = model(torch.tensor([PROMPT]))[0][0].numpy()
    e = lcpp(base)
    ad = LlamaCppAdapters(e)
    ad.load("tools", path)
    s = e.new_sequence()
    with ad.using("tools"):
        got = e.forward(s, PROMPT)
    err = close(got, ref)
    assert np.abs(ref - plain).max() > 1000 * max(err, 1e-6)        # the adapter matters far beyond the error
    # the KV llama.cpp computed under the adapter is torch's under the merged weights
    t = TorchEngine(merged, fingerprint="x")
    ts = t.new_sequence()
    t.forward(ts, PROMPT)
    mine, _ = SequenceKV.from_bytes(e.export_kv(s, dtype="float32"))
    want, _ = SequenceKV.from_bytes(t.export_kv(ts, dtype="float32"))
    n = len(PROMPT)
    close(mine.data[:, :, :, :n].numpy(), want.data[:, :, :, :n].numpy(), 1e-5)
    # cleared: the bare base again
    s2 = e.new_sequence()
    assert ad.active is None
    close(e.forward(s2, PROMPT), plain)
    ad.close()
    e.close()


def test_rslora_and_per_module_ranks_and_alphas_are_folded(exports, tmp_path):
    """llama.cpp scales every pair by alpha / rank; PEFT's rsLoRA and patterns are folded into B."""
    m = exports.model("llama")
    merged = peft_adapter(m, tmp_path / "p", r=4, alpha=6, seed=5, use_rslora=True,
                          rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3})
    lora = read_peft_lora(tmp_path / "p")
    assert lora.pairs[(0, "self_attn.q_proj")][0].shape[0] == 2
    path = export_adapter(tmp_path / "p", exports.gguf("llama", "F32"), tmp_path / "p.gguf", log=quiet)
    e = lcpp(exports.gguf("llama", "F32"))
    ad = LlamaCppAdapters(e)
    ad.load("p", path)
    assert ad.info["p"].ranks == (2, 4)
    with torch.no_grad():
        ref = merged(torch.tensor([PROMPT]))[0][0].numpy()
    with ad.using("p"):
        close(e.forward(e.new_sequence(), PROMPT), ref)
    ad.close()
    e.close()


def test_prefill_only_adapters_then_the_shared_base_decodes(made):
    """Rows of different tasks on one model: each prefilled under its adapter, then all decode on the
    bare base in one step -- each row is what its task alone gives (torch: merged prefill, base step)."""
    base, model, tasks = made["llama"]
    e = lcpp(base)
    ad = LlamaCppAdapters(e)
    for task in tasks:
        ad.load(task, tasks[task][0])
    rows = [("tools", PROMPT), ("code", PROMPT), (None, PROMPT[:7]), ("tools", PROMPT[3:])]
    seqs = [e.new_sequence() for _ in rows]
    for s, (task, prompt) in zip(seqs, rows):
        ad.prefill(s, prompt, task)
    ad.use(None)
    got = ad.step_by_adapter(seqs, [9] * 4, [None] * 4)          # the shared decoder: one call, no adapter
    base_torch = TorchEngine(model, fingerprint="x")
    for row, (task, prompt) in zip(got, rows):
        t = TorchEngine(tasks[task][1] if task else model, fingerprint="x")
        ts = t.new_sequence()
        t.forward(ts, prompt)
        bs = base_torch.import_kv(t.export_kv(ts, dtype="float32"))
        close(row, base_torch.step([bs], [9])[0])
    # a mixed-adapter step: one decode per adapter, each row as under its own adapter alone
    before = ad.switches
    mixed = ad.step_by_adapter(seqs, [4] * 4, ["code", None, "tools", "code"])
    # the active set (none) runs first, then code, then tools: two switches, not three
    assert ad.switches - before == 2 and ad.active == "tools"
    for i, name in enumerate(["code", None, "tools", "code"]):
        e.truncate(seqs[i], e.length(seqs[i]) - 1)
        with ad.using(name):
            close(mixed[i], e.step([seqs[i]], [4])[0], 1e-5)
    ad.close()
    e.close()


def _corrupt(src, dst, edit):
    import shutil
    shutil.copytree(src, dst)
    t = load_file(str(dst / "adapter_model.safetensors"))
    edit(t)
    save_file(t, str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_adapters_are_refused_with_a_reason(made, exports, tmp_path):
    base, model, tasks = made["llama"]
    peft_dir = tasks["tools"][2]
    # an adapter made for another base shape (a wider MLP), and for a deeper one
    wide = Transformer(tiny_config("llama", vocab_size=320, intermediate_size=96)).eval()
    peft_adapter(wide, tmp_path / "wide")
    with pytest.raises(AdapterError, match="another base shape"):
        export_adapter(tmp_path / "wide", base, tmp_path / "w.gguf", log=quiet)
    deep = Transformer(tiny_config("llama", vocab_size=320, num_layers=3)).eval()
    peft_adapter(deep, tmp_path / "deep", targets=["q_proj"])
    with pytest.raises(AdapterError, match="does not have"):
        export_adapter(tmp_path / "deep", base, tmp_path / "d.gguf", log=quiet)
    # unknown modules: in the config, and as a tensor
    untied = Transformer(tiny_config("qwen2", vocab_size=320)).eval()
    peft_adapter(untied, tmp_path / "head", targets=["q_proj", "lm_head"])
    with pytest.raises(AdapterExportError, match="lm_head"):
        read_peft_lora(tmp_path / "head")
    odd = _corrupt(peft_dir, tmp_path / "odd", lambda t: t.update(
        {"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": np.zeros((4, 64), np.float32)}))
    with pytest.raises(AdapterExportError, match="rotary"):
        read_peft_lora(odd)
    # wrong rank tensors, half a pair, not finite
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    bad_rank = _corrupt(peft_dir, tmp_path / "rank", lambda t: t.update({key: np.zeros((128, 3), np.float32)}))
    with pytest.raises(AdapterExportError, match="wrong rank"):
        read_peft_lora(bad_rank)
    half = _corrupt(peft_dir, tmp_path / "half", lambda t: t.pop(key))
    with pytest.raises(AdapterExportError, match="only lora_A"):
        read_peft_lora(half)
    nan = _corrupt(peft_dir, tmp_path / "nan", lambda t: t[key].__setitem__((0, 0), np.nan))
    with pytest.raises(AdapterExportError, match="finite"):
        read_peft_lora(nan)
    with pytest.raises(AdapterExportError, match="no adapter_config.json"):
        read_peft_lora(tmp_path)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (tmp_path / "junk" / "adapter_model.safetensors").write_bytes(b"\x08" + b"\0" * 40)
    with pytest.raises(AdapterExportError, match="not a readable safetensors"):
        read_peft_lora(tmp_path / "junk")
    with pytest.raises(AdapterExportError, match="base model's GGUF"):
        export_adapter(peft_dir, tmp_path, tmp_path / "x.gguf", log=quiet)


def test_engine_refuses_bad_adapter_files_and_keeps_serving(made, tmp_path):
    base, model, tasks = made["llama"]
    e = lcpp(base)
    ad = LlamaCppAdapters(e)
    ad.load("tools", tasks["tools"][0])
    # the qwen2 adapter is for another architecture; the base GGUF is no adapter; a truncated file
    with pytest.raises(AdapterError, match="architecture 'qwen2'"):
        ad.load("q", made["qwen2"][2]["tools"][0])
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        ad.load("b", base)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tasks["code"][0].read_bytes()[:3000])
    with pytest.raises(AdapterError, match="not a readable GGUF"):
        ad.load("cut", cut)
    with pytest.raises(AdapterError, match="already loaded"):
        ad.load("tools", tasks["tools"][0])
    with pytest.raises(AdapterError, match="no adapter 'nope'"):
        ad.use("nope")
    assert ad.names == ["tools"]
    with torch.no_grad():
        ref = tasks["tools"][1](torch.tensor([PROMPT]))[0][0].numpy()
    with ad.using("tools"):
        close(e.forward(e.new_sequence(), PROMPT), ref)
    ad.unload("tools")
    assert ad.names == [] and ad.active is None
    e.close()


def test_cli_writes_the_adapter_and_explains_bad_input(made, tmp_path):
    base, _, tasks = made["qwen2"]
    out = tmp_path / "a.gguf"
    r = CliRunner().invoke(export_cli, ["adapter", str(tasks["code"][2]), str(out), "--base", str(base),
                                        "--task", "code", "--type", "F16"])
    assert r.exit_code == 0, r.output
    assert "rank 4" in r.output and "wrote" in r.output
    info = check_adapter(out, base)
    assert info.task == "code" and info.targets == ("q", "v", "down")
    assert {t.tensor_type.name for t in GGUFReader(str(out)).tensors} == {"F16"}
    r = CliRunner().invoke(export_cli, ["adapter", str(tmp_path), str(out), "--base", str(base)])
    assert r.exit_code == 1 and "no adapter_config.json" in r.output and "Traceback" not in r.output


def test_base_shapes_come_from_the_header_alone_as_gguf_reads_them(made, tmp_path):
    """The base's tensor shapes (what an adapter is checked against) from the GGUF header, without
    mapping the weights (gguf.GGUFReader touched ~450 MiB of a 0.5B base: the agent's startup peak)."""
    from edge.engines.lora_gguf import base_shapes
    for arch, (base, _, _) in made.items():
        r = GGUFReader(str(base))
        want = {t.name: (int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1) for t in r.tensors}
        assert base_shapes(base) == (arch, want)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(Path(made["qwen2"][0]).read_bytes()[:100])
    with pytest.raises(AdapterError, match="not a readable GGUF"):
        base_shapes(bad)
    with pytest.raises(AdapterError, match="no base model file"):
        base_shapes(tmp_path / "missing.gguf")
