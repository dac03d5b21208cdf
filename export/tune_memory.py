"""What keeps tuning a real base (Qwen2.5-Coder-0.5B on a shared 24 GiB CPU box) within memory.

* gradient accumulation (`micro_batch`): a step's batch runs in passes of a few examples, each
  pass's backward frees its activations; the gradient is the whole batch's (each pass's answer-token
  CE sum is divided by the batch's answer-token count, exactly the split loss of the whole batch);
* gradient checkpointing (`grad_checkpoint`): each block's activations are recomputed in backward
  instead of kept (the frozen decoder's too: gradients cross it on their way to the prefill's KV;
  not a LoRA trainee's prefill, whose adapter applies only within its own forward);
* frozen embeddings (`freeze_embeddings`): the token embedding and the output head are not trained
  and are SHARED with the base (no copy); with AdamW they would cost four fp32 copies of their
  weights (2 x 136M parameters on Qwen2.5-0.5B as loaded: ~4.4 GB);
* bf16 autocast (`bf16`): matmuls in bfloat16, weights, gradients, AdamW state and the loss in fp32.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def embedding_params(model) -> List[torch.nn.Parameter]:
    """The token embedding and (untied) output head of a Transformer."""
    out = [model.model.embed_tokens.weight]
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is not out[0]:
        out.append(head.weight)
    return out


@contextlib.contextmanager
def checkpointed_blocks(*models, enabled: bool = True) -> Iterator[None]:
    """Within the block, each transformer block of `models` recomputes its activations in backward.
    The patch is an instance attribute removed on exit, so a deepcopy or a saved module never carries it."""
    patched = []
    if enabled:
        for m in models:
            if hasattr(m, "view"):
                # a LoRA trainee: its view applies the adapter only inside the trainee's forward, so a
                # recomputation in backward would run without it; its activations are kept instead
                continue
            for blk in m.model.layers:
                if "forward" not in blk.__dict__:
                    inner = blk.forward
                    blk.forward = (lambda *a, _f=inner: checkpoint(_f, *a, use_reentrant=False))
                    patched.append(blk)
    try:
        yield
    finally:
        for blk in patched:
            del blk.forward


def autocast(device: str, enabled: bool):
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def accumulate(loss_sum, model, decoder, batch: Sequence, micro_batch: int, device: str, bf16: bool) -> float:
    """Backward of the batch's mean answer-token CE in passes of `micro_batch` examples (0: one pass);
    returns that mean. loss_sum(prefill, decoder, examples) -> (CE summed over answer tokens, count)."""
    tokens = sum(len(e.answer) for e in batch)
    step = micro_batch or len(batch)
    total = 0.0
    for i in range(0, len(batch), step):
        with autocast(device, bf16):
            s, _ = loss_sum(model, decoder, batch[i: i + step])
        (s / tokens).backward()
        total += float(s.detach())
    return total / tokens


def share_embeddings(model, base) -> None:
    """Point a loaded specialist's embedding / head at the base's when they hold the same values
    (frozen in tuning): one copy in memory, not two. Nothing changes where they differ."""
    for mine, theirs in zip(embedding_params(model), embedding_params(base)):
        if mine is theirs or mine.shape != theirs.shape or not torch.equal(mine, theirs):
            continue
        if mine is model.model.embed_tokens.weight:
            model.model.embed_tokens.weight = theirs
        else:
            model.lm_head.weight = theirs
