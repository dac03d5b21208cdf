"""Prefill-only LoRA adapters (edge/model/lora/apply.py) on tiny float64 models.

* an all-zeros adapter gives the base's prefill bit for bit (logits and KV);
* a non-zero adapter changes the prefill, while the decoder (the base object) keeps its
  weights and decodes a given KV exactly as before -- the adapter never reaches it;
* a batch mixing tasks (and rows with no adapter, and different lengths) gives every row
  what its task alone gives, within 1e-12;
* gradients of a split loss reach the adapter only, never the shared weights.
"""
import pytest
import torch

from edge.model.lora.adapter import ALL_TARGETS, init_adapter, zeros_adapter
from edge.model.lora.apply import LoraTransformer, lora_prefill
from edge.model.lora.error import AdapterError
from edge.model.sun_modules import pad_right, prefill_batch, split_generate
from harness.tiny_models import random_model

ARCHS = ("llama", "qwen2")       # qwen2: q/k/v biases, untied head


def trained_like(cfg, seed, rank=4, targets=ALL_TARGETS, alpha=8.0):
    """An adapter as a tuning leaves it: PEFT's init, then B moved off zero."""
    ad = init_adapter(cfg, rank, alpha, targets, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 100)
    for t in ad.lora_b.values():
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.2)
    return ad


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def kv_equal(x, y):
    return all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(x, y) for a, b in ((ka, kb), (va, vb)))


@pytest.mark.parametrize("arch", ARCHS)
def test_zeros_adapter_gives_the_base_prefill_bit_for_bit(arch):
    base = random_model(1, arch=arch)
    view = LoraTransformer.over(base)
    view.add_adapter("zero", zeros_adapter(base.cfg, 8, dtype=torch.float64))
    toks, lens = pad_right(prompts((7, 3, 11)))
    with torch.no_grad():
        want_logits, want_kv, _ = prefill_batch(base, toks, lens)
        for tasks in ("zero", ["zero", None, "zero"]):
            got_logits, got_kv, _ = lora_prefill(view, toks, lens, tasks)
            assert torch.equal(got_logits, want_logits)
            assert kv_equal(got_kv, want_kv)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_adapter_changes_the_prefill_only_never_the_decoder(arch):
    base = random_model(2, arch=arch)
    before = {n: p.detach().clone() for n, p in base.state_dict().items()}
    toks, lens = pad_right(prompts((6, 9), seed=1))
    step = torch.tensor([[17], [42]])
    with torch.no_grad():
        base_logits, base_kv, _ = prefill_batch(base, toks, lens)
        want_step, _ = base(step, past=base_kv, past_lengths=lens)
        view = LoraTransformer.over(base)
        view.add_adapter("task", trained_like(base.cfg, 3))
        logits, kv, _ = lora_prefill(view, toks, lens, "task")
        assert (logits - base_logits).abs().max() > 1e-3            # the adapter does something
        assert max((k - bk).abs().max() for (k, _), (bk, _) in zip(kv, base_kv)) > 1e-3
        # the decoder is the base object: same tensors, same values, same outputs on a given KV
        assert all(torch.equal(before[n], p) for n, p in base.state_dict().items())
        got_step, _ = base(step, past=base_kv, past_lengths=lens)
        assert torch.equal(got_step, want_step)
        # ... and the view shares those tensors (no copy of the base)
        ptrs = {p.data_ptr() for p in base.parameters()}
        assert all(p.data_ptr() in ptrs for p in view.parameters())
        # SUN split generation: adapter prefill, base decoding -- differs from plain base decoding
        ps = prompts((5, 8), seed=4)
        with view.rows("task"):
            adapted = split_generate(view, base, ps, 6)
        assert adapted != split_generate(base, base, ps, 6)
        assert all(torch.equal(before[n], p) for n, p in base.state_dict().items())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_task_batch_gives_each_row_what_its_task_alone_gives(arch):
    base = random_model(4, arch=arch)
    view = LoraTransformer.over(base)
    view.add_adapter("maths", trained_like(base.cfg, 5, rank=4))
    view.add_adapter("code", trained_like(base.cfg, 6, rank=8, targets=("q_proj", "v_proj", "down_proj")))
    view.add_adapter("tools", trained_like(base.cfg, 7, rank=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj")))
    lengths = (9, 4, 13, 1, 7, 11)
    tasks = ["maths", None, "code", "tools", "maths", "code"]
    rows = prompts(lengths, seed=8)
    with torch.no_grad():
        toks, lens = pad_right(rows)
        logits, kv, _ = lora_prefill(view, toks, lens, tasks)
        for b, (row, task) in enumerate(zip(rows, tasks)):
            t1, l1 = pad_right([row])
            want_logits, want_kv, _ = lora_prefill(view, t1, l1, task)
            assert (logits[b] - want_logits[0]).abs().max() <= 1e-12
            for (k, v), (wk, wv) in zip(kv, want_kv):        # the row's real KV entries
                assert (k[b, :, : len(row)] - wk[0]).abs().max() <= 1e-12
                assert (v[b, :, : len(row)] - wv[0]).abs().max() <= 1e-12
        # the tasks really differ from each other and from the base on the same prompt
        t1, l1 = pad_right([rows[0]])
        outs = [lora_prefill(view, t1, l1, t)[0] for t in (None, "maths", "code", "tools")]
        assert min((a - b).abs().max() for i, a in enumerate(outs) for b in outs[i + 1:]) > 1e-4


def test_gradients_reach_the_adapter_and_never_the_shared_weights():
    base = random_model(9)
    for p in base.parameters():
        p.requires_grad_(True)              # even a base that would accept gradients gets none
    view = LoraTransformer.over(base)
    ad = view.add_adapter("t", init_adapter(base.cfg, 4, seed=0, dtype=torch.float64))
    for t in ad.parameters():
        t.requires_grad_(True)
    toks, lens = pad_right(prompts((5, 8), seed=2))
    logits, kv, _ = lora_prefill(view, toks, lens, "t")
    (logits.square().sum() + sum(k.square().sum() for k, _ in kv)).backward()
    assert all(p.grad is None for p in base.parameters())
    assert all(p.grad is None for p in view.parameters())
    # at PEFT's init B = 0, so A gets no gradient yet and every B does
    assert all(ad.lora_b[k].grad.abs().sum() > 0 for k in ad.lora_b)


def test_rows_refuse_unknown_adapters_and_a_batch_of_another_size():
    base = random_model(0)
    view = LoraTransformer.over(base)
    view.add_adapter("a", zeros_adapter(base.cfg, 2, dtype=torch.float64))
    toks, lens = pad_right(prompts((3, 4)))
    with pytest.raises(AdapterError, match="no adapter 'b' is loaded here .loaded: a."):
        lora_prefill(view, toks, lens, ["a", "b"])
    with pytest.raises(AdapterError, match="the batch has 2 rows but 3 tasks"):
        lora_prefill(view, toks, lens, ["a", None, "a"])
    with pytest.raises(NotImplementedError, match="lora_prefill"):
        view.forward_cached(toks, cache=None)
    assert view.remove_adapter("a") is not None and view.adapter_names == []
    deeper = random_model(0, num_layers=3).cfg
    with pytest.raises(AdapterError, match="model.layers.2.* which this base .2 layers.*made for another base"):
        view.add_adapter("c", zeros_adapter(deeper, 2, dtype=torch.float64))
