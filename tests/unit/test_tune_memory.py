"""Tuning's memory options (export/tune_memory.py) minimise the same loss: micro-batches accumulate
to the whole batch's step, gradient checkpointing gives the same weights, frozen embeddings stay the
base's own tensors (not copied, not trained, not in a checkpoint), and a checkpoint is written once
cfg.ckpt_every_s seconds of the run's clock have passed -- a run killed after it resumes there and
ends where an uninterrupted one does."""
import copy
import json

import pytest
import torch

from edge.model.transformer import Transformer, tiny_config
from export.tasks import SYNTHETIC, VOCAB, split
from export.tune import TuneConfig, split_loss, split_loss_sum, tune
from export.tune_memory import accumulate, checkpointed_blocks

BASE = dict(steps=3, batch_size=4, lr=1e-2, warmup=0, seed=3)


def setup(arch="qwen2"):
    torch.manual_seed(0)
    base = Transformer(tiny_config(vocab_size=VOCAB, num_layers=2, max_position=64, arch=arch))
    tr, _ = split(SYNTHETIC["reverse"], 64, 0, seed=1)
    return base, tr


def weights(cfg, base, tr, **kw):
    return tune(base, tr, cfg, progress=False, **kw).prefill.state_dict()


@pytest.mark.parametrize("mode", ["full", "sun"])
def test_micro_batches_and_checkpointing_give_the_whole_batchs_gradient(mode):
    """Compared on the gradient: AdamW turns float-rounding differences of near-zero gradients into
    visible weight differences within a few steps, whichever way the sum is taken."""
    base, tr = setup()
    batch = tr[:4]

    def grads(run):
        m = copy.deepcopy(base).train()
        for p in m.parameters():
            p.requires_grad_(True)
        dec = m if mode == "full" else base
        run(m, dec)
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    ref = grads(lambda m, dec: split_loss(m, dec, batch).backward())
    for micro, ck in ((1, False), (3, False), (2, True)):
        def run(m, dec):
            with checkpointed_blocks(m, dec, enabled=ck):
                accumulate(split_loss_sum, m, dec, batch, micro, "cpu", False)
        got = grads(run)
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{micro} {ck} {k}")
    assert all("forward" not in b.__dict__ for b in base.model.layers)   # the patch is gone after


@pytest.mark.parametrize("arch", ["qwen2", "llama"])          # untied head / tied head
def test_frozen_embeddings_are_the_bases_own_and_untouched(arch, tmp_path):
    base, tr = setup(arch)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = TuneConfig(mode="full", freeze_embeddings=True, ckpt_every=1, **BASE)
    model = tune(base, tr, cfg, out_dir=tmp_path, progress=False).prefill
    assert model.model.embed_tokens.weight is base.model.embed_tokens.weight
    if arch == "qwen2":
        assert model.lm_head.weight is base.lm_head.weight
    assert torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before["model.layers.0.mlp.up_proj.weight"])
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k                          # the base itself is unchanged
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "checkpoint" / "state.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in saved)


def test_a_checkpoint_every_few_minutes_and_a_kill_resumes_there(tmp_path):
    base, tr = setup()
    cfg = TuneConfig(mode="sun", ckpt_every_s=250.0, **{**BASE, "steps": 6})
    whole = weights(cfg, base, tr)
    now = [0.0]

    def clock():
        return now[0]

    def step_done(step):                       # each step takes 100 s of the fake clock; killed after step 5
        now[0] += 100.0
        if step == 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tune(base, tr, cfg, out_dir=tmp_path, progress=False, clock=clock, on_step=step_done)
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and state["elapsed_s"] >= 0   # checked at 300 s after the start (>= 250), not at 5
    resumed = tune(base, tr, cfg, out_dir=tmp_path, progress=False, clock=clock)
    assert [h["step"] for h in resumed.history[:-1]] == [1, 2, 3, 4, 5, 6]
    for k, v in resumed.prefill.state_dict().items():
        torch.testing.assert_close(v, whole[k], rtol=0, atol=0)


@pytest.mark.parametrize("adapter", ["", "lora"])
def test_bf16_autocast_trains_with_every_memory_option(adapter, tmp_path):
    """bf16 matmuls, fp32 weights and optimiser state: the step's gradient is the fp32 one to bf16
    precision, and a run with every option on (as the Qwen table runs) trains, saves and resumes."""
    base, tr = setup()
    batch = tr[:4]
    m = copy.deepcopy(base).train()
    for p in m.parameters():
        p.requires_grad_(True)
    ref_loss = float(split_loss(m, base, batch).detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = accumulate(split_loss_sum, m, base, batch, 1, "cpu", True)
    assert loss == pytest.approx(ref_loss, rel=2e-2) and all(p.dtype == torch.float32 for p in m.parameters())
    lora = dict(adapter="lora", rank=4, alpha=8.0) if adapter else {}
    cfg = TuneConfig(mode="sun", bf16=True, micro_batch=1, grad_checkpoint=True, freeze_embeddings=True,
                     ckpt_every=2, **lora, **{**BASE, "steps": 4})
    whole = tune(base, tr, cfg, progress=False)
    assert whole.history[-2]["loss"] < whole.history[0]["loss"] * 1.5 and whole.history[-1]["step"] == 4

    def die(step):
        if step == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tune(base, tr, cfg, out_dir=tmp_path, progress=False, on_step=die)
    resumed = tune(base, tr, cfg, out_dir=tmp_path, progress=False)
    assert [h["loss"] for h in resumed.history[:-1]] == pytest.approx([h["loss"] for h in whole.history[:-1]],
                                                                       rel=1e-5)
