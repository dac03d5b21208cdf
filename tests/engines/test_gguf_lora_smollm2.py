"""GGUF LoRA on the real SmolLM2-135M: llama.cpp (base GGUF + adapter GGUF) vs our torch module.

The tiny random models of test_gguf_lora.py check the format; this checks that it holds on a real
model's weights and scale: the fetched SmolLM2-135M (dequantised, as torch runs it) written as an
F32 GGUF, a rank-16 adapter on all seven linears (PEFT's init for A, B random and non-zero, so the
adapter moves the logits by ~2) saved in PEFT's format and exported with export/gguf_lora.py. The
torch side is edge/model/lora's LoraTransformer (the base's weights plus B A per row, never merged).
F32 weights, F32 KV and flash attention off (as test_gguf_lora.py): only the summation order
differs. Measured here: max |delta logit| 1.3e-4 on a logit scale of 38 (3e-6 of it), KV 3.4e-5 on a
scale of 20; the bound is test_gguf_export.py's F32 one, 1e-4 of the scale (1e-5 for the KV).
~35 s on 2 shared cores (most of it torch's forward passes and the 540 MB F32 GGUF).
"""
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.real_model, pytest.mark.llamacpp, pytest.mark.slow]

RANK = 16


def close(got, want, rel):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err <= rel * scale, f"max |delta| {err:.3g} > {rel:g} x {scale:.3g}"
    return err


def _adapter(cfg, seed):
    from edge.model.lora.adapter import init_adapter
    ad = init_adapter(cfg, RANK, seed=seed)                      # PEFT's A, alpha = rank (scale 1)
    g = torch.Generator().manual_seed(seed + 100)
    for k in sorted(ad.lora_b):
        ad.lora_b[k].copy_(torch.randn(ad.lora_b[k].shape, generator=g) * 0.02)
    return ad


@pytest.fixture(scope="module")
def smollm2_lora(module_tmp_path):
    """(base model, tokenizer, F32 base GGUF, {task: (LoraAdapter, adapter GGUF)})."""
    from edge.model.fetch import model_path
    path = model_path("smollm2-135m")
    if not path.exists():
        pytest.skip(f"{path} is missing; run `make models` to fetch SmolLM2-135M")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install .[llama])")
    from edge.model.checkpoint import load_model
    from edge.model.lora.files import save_adapter
    from export.gguf import write_gguf
    from export.gguf_lora import export_adapter
    model, ck = load_model(path)
    model.eval()
    root = module_tmp_path
    base = write_gguf(root / "base-F32.gguf", ck.config, ck.state_dict, ck.tokenizer, "F32")
    tasks = {}
    for task, seed in (("tools", 1), ("code", 2)):
        ad = _adapter(model.cfg, seed)
        save_adapter(root / task, ad)
        tasks[task] = (ad, export_adapter(root / task, base, root / f"{task}.gguf", task=task, log=lambda m: None))
    return model, ck.tokenizer, base, tasks


def _prompt(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_llamacpp_adapter_matches_torch_logits_and_kv_on_smollm2(smollm2_lora):
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.engines.llamacpp_lora import LlamaCppAdapters
    from edge.model.kv import SequenceKV
    from edge.model.lora.apply import LoraTransformer, lora_prefill
    model, tok, base, tasks = smollm2_lora
    ids = _prompt(tok, "Explain in three sentences why the sky is blue.")
    n = len(ids)
    view = LoraTransformer.over(model)
    view.add_adapter("tools", tasks["tools"][0])
    with torch.inference_mode():
        with view.rows("tools"):
            ref = view(torch.tensor([ids]))[0][0].numpy()          # every position's logits
        plain = model(torch.tensor([ids]))[0][0].numpy()
        _, kv, _ = lora_prefill(view, torch.tensor([ids]), torch.tensor([n]), ["tools"])
    e = LlamaCppEngine(base, max_len=128, n_seq_max=2, threads=1, kv_type="f32", flash_attn=False)
    ad = LlamaCppAdapters(e)
    try:
        ad.load("tools", tasks["tools"][1])
        s = e.new_sequence()
        with ad.using("tools"):
            got = e.forward(s, ids)
        err = close(got, ref, 1e-4)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert np.abs(ref - plain).max() > 1000 * err           # the adapter matters far beyond the error
        mine, _ = SequenceKV.from_bytes(e.export_kv(s, dtype="float32"))
        want = torch.stack([torch.stack([k[0], v[0]]) for k, v in kv]).numpy()   # [layers, k/v, heads, T, hd]
        close(mine.data[:, :, :, :n].numpy(), want, 1e-5)
        # the adapter cleared: the bare base again, on the same context
        assert ad.active is None
        close(e.forward(e.new_sequence(), ids), plain, 1e-4)
    finally:
        ad.close()
        e.close()


def test_mixed_task_rows_on_the_llamacpp_worker_match_torch_per_row(smollm2_lora):
    """The torch-free worker backend (edge/sun/adapter_llamacpp.py) on a batch of two tasks' rows,
    interleaved: each row's first-token logits are torch's for that row under its own adapter."""
    from edge.engines.llamacpp_engine import LlamaCppEngine
    from edge.model.lora.apply import LoraTransformer, lora_prefill
    from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
    model, tok, base, tasks = smollm2_lora
    prompts = [_prompt(tok, "What is 17 times 3?"), _prompt(tok, "Write a haiku about rain."),
               _prompt(tok, "Name a prime number above 90.")]
    names = ["code", "tools", "code"]
    view = LoraTransformer.over(model)
    for t in tasks:
        view.add_adapter(t, tasks[t][0])
    T = max(map(len, prompts))
    padded = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    with torch.inference_mode():
        ref = lora_prefill(view, padded, torch.tensor([len(p) for p in prompts]), names)[0].numpy()
    w = LlamaCppAdapterBackend(LlamaCppEngine(base, max_len=128, n_seq_max=4, threads=1, kv_type="f32",
                                              flash_attn=False))
    try:
        for t in tasks:
            w.add(t, tasks[t][1])
        before = w.adapters.switches
        rows = w.prefill_rows(prompts, names)
        assert w.adapters.switches - before == 2                   # grouped: one switch per task, not per row
        for (logits, export), want in zip(rows, ref):
            close(logits, want, 1e-4)
            export.free()
    finally:
        w.adapters.close()
        w.engine.close()
