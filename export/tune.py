"""Prefill-only tuning (SUN), its QSUN variant, and the full fine-tuning baseline.

SUN: the trainable prefill module (a copy of the base) runs the prompt -> KV +
first-token logits; the FROZEN decoder runs the answer with teacher forcing,
attending to that KV. Loss = cross-entropy on the first answer token (prefill
logits) and on every later answer token (decoder logits), averaged per token.
Gradients reach the prefill weights only through the KV and the first logits.

* `mode="full"`: the decoder IS the trainable module (ordinary fine-tuning on
  the answer tokens) - the one-model-per-task baseline, same loss, same data.
* `decoder="int4"` (QSUN): the frozen decoder's projections are replaced by
  their int4 values from export/quant.py (bit-identical to the exporters).
* `adapter="lora"`: the trainable module is the frozen base plus one LoRA adapter
  applied while prefilling (export/tune_lora.py); only the adapter's A and B
  train, the output is an adapter directory (PEFT's files + manifest.json).

Runs are seeded and resumable: the batch of step s is drawn from
rng(seed, s), so a resumed run sees exactly the batches an uninterrupted one
would; model + AdamW state are checkpointed as safetensors (never pickle).
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from edge.model.lora.adapter import ALL_TARGETS, LoraAdapter, parse_targets
from edge.model.transformer import Transformer
from edge.model.sun_modules import (exact_match, pad_right, prefill_batch, save_module, split_generate,
                      weights_fingerprint)
from export.quant import fake_quant_state_dict
from export import tune_memory
from export.tasks import Example
from export.tune_lora import make_trainee, save_lora_specialist
from export.tune_select import BestStep, held_back_ce, hold_back

MODES = ("sun", "full")
ADAPTERS = ("", "lora")           # "": the specialist is a full copy of the prefill module
CKPT_DIR = "checkpoint"


class TuneError(ValueError):
    """A tuning request that cannot run as asked (bad option, mismatched resume)."""


@dataclass
class TuneConfig:
    mode: str = "sun"             # "sun" (prefill-only) or "full" (the baseline)
    decoder: str = "fp32"         # frozen decoder precision for SUN: "fp32" or "int4" (QSUN)
    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_frac: float = 0.1      # cosine decays to lr * this
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 0           # 0: evaluate only at the end
    ckpt_every: int = 0           # 0: no intermediate checkpoints
    max_new: int = 16             # generation budget for evaluation
    stop_ids: Tuple[int, ...] = (2,)
    threads: int = 0              # 0: leave torch's default
    device: str = "cpu"
    adapter: str = ""             # "lora": train a prefill-only LoRA adapter, the base frozen
    rank: int = 16
    alpha: float = 32.0
    targets: Tuple[str, ...] = ALL_TARGETS
    # memory and time on a real base (export/tune_memory.py): none changes the loss being minimised
    micro_batch: int = 0          # 0: a step's batch in one pass; n: accumulated over passes of n examples
    grad_checkpoint: bool = False  # recompute block activations in backward
    freeze_embeddings: bool = False  # embedding + output head frozen and shared with the base (not a copy)
    bf16: bool = False            # autocast matmuls to bfloat16 (fp32 weights, gradients, AdamW state)
    ckpt_every_s: float = 0.0     # also checkpoint once this many seconds passed since the last one
    # keep the best step (export/tune_select.py): judge every select_every steps, step 0 included, on
    # select_n training pairs held back from it; 0: the last step is the result
    select_every: int = 0
    select_n: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise TuneError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.decoder not in ("fp32", "int4"):
            raise TuneError(f"decoder must be 'fp32' or 'int4', got {self.decoder!r}")
        if self.mode == "full" and self.decoder != "fp32":
            raise TuneError("--full trains the whole model; an int4 decoder only applies to SUN tuning")
        self.stop_ids = tuple(int(s) for s in self.stop_ids)
        if self.adapter not in ADAPTERS:
            raise TuneError(f"adapter must be 'lora' or none, got {self.adapter!r}")
        if self.adapter and self.mode == "full":
            raise TuneError("--full trains the whole model; an adapter applies to SUN (prefill-only) tuning")
        if (self.select_every > 0) != (self.select_n > 0) or self.select_every < 0 or self.select_n < 0:
            raise TuneError(f"step selection needs both select_every and select_n > 0 (or neither), got "
                            f"{self.select_every} and {self.select_n}")
        if type(self.rank) is not int or self.rank < 1 or not self.alpha > 0:
            raise TuneError(f"LoRA rank must be a positive integer and alpha positive, got {self.rank!r}, {self.alpha!r}")
        self.targets = parse_targets(",".join(self.targets))


@dataclass
class TuneResult:
    prefill: Transformer          # the tuned module (the whole model for "full"; a LoraTrainee with an adapter)
    decoder: Transformer          # the decoder it was tuned for (frozen; == prefill for "full")
    decoder_fingerprint: str
    history: List[dict] = field(default_factory=list)


# -- the frozen decoder ------------------------------------------------------------------------

def build_decoder(base: Transformer, precision: str = "fp32") -> Tuple[Transformer, str]:
    """A frozen copy of the base, int4 fake-quantised for QSUN, and its fingerprint."""
    dec = copy.deepcopy(base).float().eval()
    if precision == "int4":
        dec.load_state_dict(fake_quant_state_dict(dec.state_dict()))
    elif precision != "fp32":
        raise TuneError(f"decoder precision must be 'fp32' or 'int4', got {precision!r}")
    for p in dec.parameters():
        p.requires_grad_(False)
    return dec, weights_fingerprint(dec, precision)


def save_decoder(directory, decoder: Transformer, precision: str, fingerprint: str, **meta) -> Path:
    """A shared-decoder directory the edge roles load (weights as the decoder computes with them)."""
    return save_module(directory, decoder, {"kind": "sun-decoder", "precision": precision,
                                            "fingerprint": fingerprint, **meta})


# -- the loss ---------------------------------------------------------------------------------

def split_loss(prefill: Transformer, decoder: Transformer, batch: Sequence[Example]) -> torch.Tensor:
    """Mean CE over all answer tokens: the first from the prefill, the rest from the decoder."""
    total, count = split_loss_sum(prefill, decoder, batch)
    return total / count


def split_loss_sum(prefill: Transformer, decoder: Transformer, batch: Sequence[Example]):
    """(CE summed over the batch's answer tokens, their count): split_loss before the mean."""
    dev = next(prefill.parameters()).device
    toks, plens = pad_right([e.prompt for e in batch], device=dev)
    first_logits, kv, plens = prefill_batch(prefill, toks, plens)
    return answer_ce_sum(decoder, first_logits, kv, plens, [e.answer for e in batch])


def answer_ce_sum(decoder: Transformer, first_logits, kv, plens, answers: Sequence[Sequence[int]]):
    """(CE summed over the answers' tokens, their count) after a prefill (prefill_batch's output):
    the first token from its logits, the rest from the decoder, teacher-forced."""
    dev = first_logits.device
    ans, alens = pad_right(answers, device=dev)
    total = F.cross_entropy(first_logits.float(), ans[:, 0], reduction="sum")
    if ans.shape[1] > 1:
        logits, _ = decoder(ans[:, :-1], past=kv, past_lengths=plens)
        tgt = ans[:, 1:].clone()
        tgt[torch.arange(tgt.shape[1], device=dev)[None, :] >= (alens - 1)[:, None]] = -100
        total = total + F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total, alens.sum()


def evaluate(prefill: Transformer, decoder: Transformer, examples: Sequence[Example], max_new: int,
             stop_ids: Sequence[int]) -> float:
    """Exact-match accuracy of greedy split generation."""
    was = prefill.training
    prefill.eval()
    preds = split_generate(prefill, decoder, [e.prompt for e in examples], max_new, stop_ids)
    prefill.train(was)
    return exact_match(preds, [e.answer for e in examples])


# -- checkpoints (safetensors + json, never pickle) --------------------------------------------

def _lr_at(cfg: TuneConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _frozen_names(model, cfg: TuneConfig) -> set:
    """State-dict names a checkpoint leaves out: embeddings frozen and shared with the base."""
    if not cfg.freeze_embeddings or cfg.adapter:
        return set()
    ids = {id(p) for p in tune_memory.embedding_params(model)}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def _save_ckpt(d: Path, step: int, model: Transformer, opt: torch.optim.Optimizer, cfg: TuneConfig,
               history: list, dec_fp: str, elapsed_s: float = 0.0) -> None:
    d.mkdir(parents=True, exist_ok=True)
    frozen = _frozen_names(model, cfg)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items() if k not in frozen}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    for n, p in zip(names, params):
        for k, v in opt.state.get(p, {}).items():
            tensors[f"opt.{n}.{k}"] = v.detach().reshape(-1).contiguous() if k == "step" else v.detach().contiguous()
    tmp = d / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(d / "state.safetensors")  # atomic: a crash never leaves half a checkpoint
    (d / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg), "history": history,
                                              "decoder_fingerprint": dec_fp, "elapsed_s": round(elapsed_s, 1)}))


def _load_ckpt(d: Path, model: Transformer, opt: torch.optim.Optimizer, cfg: TuneConfig, dec_fp: str):
    meta = json.loads((d / "state.json").read_text())
    saved = TuneConfig(**{**meta["config"], "stop_ids": tuple(meta["config"]["stop_ids"])})
    for key in ("mode", "decoder", "seed", "batch_size", "lr", "steps", "adapter", "rank", "alpha", "targets",
                "select_n"):
        if getattr(saved, key) != getattr(cfg, key):
            raise TuneError(f"cannot resume {d}: it was started with {key}={getattr(saved, key)!r}, "
                            f"now {key}={getattr(cfg, key)!r}; use another --out or the same options")
    if meta["decoder_fingerprint"] != dec_fp:
        raise TuneError(f"cannot resume {d}: it was tuned against another decoder "
                        f"({meta['decoder_fingerprint'][:12]} vs {dec_fp[:12]})")
    tensors = load_file(str(d / "state.safetensors"))
    frozen = _frozen_names(model, cfg)
    missing, unexpected = model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")},
                                                strict=not frozen)
    if set(missing) - frozen or unexpected:
        raise TuneError(f"cannot resume {d}: its tensors do not match the model (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        st = {k.split(".")[-1]: v for k, v in tensors.items()
              if k.startswith(f"opt.{n}.") and k.count(".") == n.count(".") + 2}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = st
    return meta["step"], meta["history"], float(meta.get("elapsed_s", 0.0))


# -- the loop ---------------------------------------------------------------------------------

def tune(base: Transformer, train: Sequence[Example], cfg: TuneConfig,
         eval_set: Sequence[Example] = (), out_dir=None, init: Union[Transformer, LoraAdapter, None] = None,
         decoder: Optional[Tuple[Transformer, str]] = None, progress: bool = True,
         log: Optional[Callable[[dict], None]] = None, manifest_extra: Optional[dict] = None,
         clock: Callable[[], float] = time.monotonic, on_step: Optional[Callable[[int], None]] = None) -> TuneResult:
    """Train one specialist; optionally checkpoint/resume in out_dir and save it there.

    init: the starting prefill weights (default: the base), or with cfg.adapter the starting
    adapter (default: PEFT's seeded init); decoder: a prebuilt (frozen decoder, fingerprint)
    to share between runs (default: built from base); clock: what cfg.ckpt_every_s is measured on;
    on_step(step): called after every step (and its checkpoint).
    """
    if not train:
        raise TuneError("no training examples")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.mode == "full":
        model = _trainable_copy(init, base, cfg)
        dec, dec_fp = model, ""
    else:
        dec, dec_fp = decoder if decoder is not None else build_decoder(base, cfg.decoder)
        dec = dec.to(cfg.device)
        model = _lora_trainee(base, dec, init, cfg) if cfg.adapter else _trainable_copy(init, base, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            betas=(0.9, 0.98))
    step, history, before_s = 0, [], 0.0
    ck = Path(out_dir) / CKPT_DIR if out_dir else None
    if ck is not None and (ck / "state.json").is_file():
        step, history, before_s = _load_ckpt(ck, model, opt, cfg, dec_fp)

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc=f"{cfg.mode}{'-lora' if cfg.adapter else ''}/{cfg.decoder}", leave=False)
    t0 = time.perf_counter()
    train, judge = hold_back(train, cfg.select_n, cfg.seed)
    best = BestStep(ck) if judge else None
    with tune_memory.checkpointed_blocks(model, dec, enabled=cfg.grad_checkpoint):
        if best is not None:
            best.load(model)
            judge_at = _judge(best, judge, model, dec, cfg)
            judge_at(step)                      # step 0: the start as it is competes too
            on_step = _then(judge_at, on_step)
        step = _steps(model, dec, opt, train, cfg, step, history, ck, dec_fp, eval_set, bar, log,
                      lambda: before_s + time.perf_counter() - t0, clock, on_step)
    if bar is not None:
        bar.close()
    picked = best.restore(model) if best is not None else {}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    final = {"step": step, "train_s": round(before_s + time.perf_counter() - t0, 2), **picked}
    if eval_set:
        final["eval_acc"] = evaluate(model, dec, eval_set, cfg.max_new, cfg.stop_ids)
    history.append(final)
    if cfg.mode == "full":
        dec_fp = weights_fingerprint(model, "fp32")  # a full-FT model is its own decoder
    if out_dir and cfg.adapter:
        save_lora_specialist(out_dir, model, cfg, dec_fp, history, manifest_extra or {})
    elif out_dir:
        save_specialist(out_dir, model, cfg, dec_fp, history, manifest_extra or {})
    return TuneResult(model, dec, dec_fp, history)


def _steps(model, dec, opt, train, cfg: TuneConfig, step: int, history: list, ck, dec_fp: str, eval_set, bar,
           log, elapsed, clock, on_step) -> int:
    """The optimisation steps from `step` to cfg.steps, checkpointed every cfg.ckpt_every steps and
    every cfg.ckpt_every_s seconds of `clock`; elapsed(): training seconds so far (resumed runs summed)."""
    last_ckpt = clock()
    while step < cfg.steps:
        rng = np.random.default_rng([cfg.seed, step])
        batch = [train[i] for i in rng.integers(0, len(train), size=cfg.batch_size)]
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss = tune_memory.accumulate(split_loss_sum, model, dec, batch, cfg.micro_batch, cfg.device, cfg.bf16)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        rec = {"step": step, "loss": loss}
        if eval_set and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            rec["eval_acc"] = evaluate(model, dec, eval_set, cfg.max_new, cfg.stop_ids)
        history.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: round(v, 3) for k, v in rec.items() if k != "step"})
        if log and "eval_acc" in rec:
            log(rec)
        by_steps = cfg.ckpt_every and step % cfg.ckpt_every == 0
        by_time = cfg.ckpt_every_s and clock() - last_ckpt >= cfg.ckpt_every_s
        if ck is not None and (by_steps or by_time) and step < cfg.steps:
            _save_ckpt(ck, step, model, opt, cfg, history, dec_fp, elapsed())
            last_ckpt = clock()
        if on_step is not None:
            on_step(step)
    return step


def _judge(best: BestStep, judge, model, dec, cfg: TuneConfig) -> Callable[[int], None]:
    """judge_at(step): the held-back CE at step 0, every cfg.select_every steps and after the last
    (once per step, resumes included)."""
    def judge_at(step: int) -> None:
        if (step % cfg.select_every == 0 or step == cfg.steps) and not best.judged(step):
            best.offer(step, held_back_ce(split_loss_sum, model, dec, judge, cfg.batch_size, cfg.device,
                                          cfg.bf16), model)
    return judge_at


def _then(first: Callable[[int], None], then: Optional[Callable[[int], None]]) -> Callable[[int], None]:
    def both(step: int) -> None:
        first(step)
        if then is not None:
            then(step)
    return both


def _trainable_copy(init, base: Transformer, cfg: TuneConfig) -> Transformer:
    if isinstance(init, LoraAdapter):
        raise TuneError("an adapter (--init ADAPTER_DIR) starts LoRA tuning only: add --adapter lora")
    src = init if init is not None else base
    shared = tune_memory.embedding_params(src) if cfg.freeze_embeddings else []
    model = copy.deepcopy(src, memo={id(p): p for p in shared}).float().to(cfg.device).train()
    for p in model.parameters():
        p.requires_grad_(not any(p is q for q in shared))
    return model


def _lora_trainee(base: Transformer, dec: Transformer, init, cfg: TuneConfig):
    """The frozen fp base + a trainable adapter. An fp decoder IS the fp base: the adapter is
    applied over its tensors (no second copy); an int4 one is not, so the base is used."""
    if init is not None and not isinstance(init, LoraAdapter):
        raise TuneError("--adapter lora starts from an adapter (--init ADAPTER_DIR), not a full prefill module")
    fp_base = dec if cfg.decoder == "fp32" else base.float().to(cfg.device)
    return make_trainee(fp_base, cfg.rank, cfg.alpha, cfg.targets, cfg.seed, init).train()


def save_specialist(out_dir, model: Transformer, cfg: TuneConfig, dec_fp: str, history: list,
                    extra: dict) -> Path:
    kind = "full-ft" if cfg.mode == "full" else ("qsun-prefill" if cfg.decoder == "int4" else "sun-prefill")
    man = {"kind": kind, "decoder_fingerprint": dec_fp, "decoder_precision": cfg.decoder,
           "tune": asdict(cfg), "history_tail": history[-5:], **extra}
    if cfg.mode == "full":
        man["fingerprint"] = dec_fp
        man["precision"] = "fp32"
    return save_module(out_dir, model, man)
