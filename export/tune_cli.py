"""`edge-export tune`: train one SUN / QSUN specialist (or the full-FT baseline) from the command line.

  edge-export tune --base smollm2-135m --task maths --out runs/maths-sun --save-decoder runs/decoder-fp32
  edge-export tune --base smollm2-135m --task maths --decoder int4 --init runs/maths-sun --out runs/maths-qsun \
      --steps 40 --select-every 10
  edge-export tune --base smollm2-135m --task maths --full --out runs/maths-full
  edge-export tune --base smollm2-135m --task tools --adapter lora --rank 16 --out runs/tools-lora
  edge-export tune --base smollm2-135m --task tools --adapter lora --rank 16 --decoder int4 \
      --init runs/tools-lora --out runs/tools-qlora --steps 40 --select-every 10

With --adapter lora the specialist is a prefill-only LoRA adapter over the frozen base
(PEFT's adapter_config.json + adapter_model.safetensors + our manifest.json): megabytes, not a model.
Its default learning rate is 1e-3, not the 2e-5 of a full prefill copy (or --full): on a new
task a LoRA adapter at 2e-5 scored 0.000 after 60 steps, 0.958 at 1e-3. --lr sets either.

Runs resume from their last checkpoint in --out; the saved manifest names the
decoder fingerprint the specialist was tuned for (edge/sun/prefill.py puts it
on every KV blob). `python -m export.tune_cli ...` is `edge-export tune ...`.
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from edge.model.lora.adapter import parse_targets
from edge.model.lora.error import AdapterError
from export.tune import TuneConfig, TuneError, build_decoder, save_decoder
from export.tune import tune as run_tune

FULL_LR = 2e-5          # a full prefill copy (SUN / QSUN) or --full
LORA_LR = 1e-3          # a LoRA adapter: low-rank updates need a larger step to move at all


def default_lr(adapter) -> float:
    """The learning rate `tune` uses when --lr is not given: by what is trained."""
    return LORA_LR if adapter == "lora" else FULL_LR


@click.command("tune")
@click.option("--base", required=True, help="base model: GGUF file, HF directory or a name from edge.model.fetch")
@click.option("--task", type=click.Choice(["maths", "tools", "code"]), help="a shipped task (docs/models.md)")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="JSONL of {\"prompt\": ..., \"answer\": ...} (plain text, chat-templated)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="specialist directory (resumes)")
@click.option("--full", is_flag=True, help="ordinary full fine-tuning (the baseline), not prefill-only")
@click.option("--decoder", "precision", type=click.Choice(["fp32", "int4"]), default="fp32",
              help="the frozen decoder: the base as is, or its int4 grid (QSUN)")
@click.option("--init", "init_dir", type=click.Path(exists=True, file_okay=False),
              help="start from this specialist (e.g. the SUN prefill when re-tuning for int4)")
@click.option("--save-decoder", "decoder_dir", type=click.Path(file_okay=False),
              help="also write the shared decoder here")
@click.option("--adapter", type=click.Choice(["lora"]), default=None,
              help="train a prefill-only LoRA adapter (base frozen) instead of a full prefill copy")
@click.option("--rank", default=16, show_default=True, help="LoRA rank (with --adapter lora)")
@click.option("--alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
@click.option("--targets", default="q,k,v,o,gate,up,down", show_default=True,
              help="linears the adapter applies to (q,k,v,o,gate,up,down or PEFT's names)")
@click.option("--steps", default=600, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--lr", type=float, default=None,
              help=f"learning rate  [default: {LORA_LR:g} with --adapter lora, else {FULL_LR:g}]")
@click.option("--seed", default=0, show_default=True)
@click.option("--eval-every", default=100, show_default=True)
@click.option("--ckpt-every", default=50, show_default=True)
@click.option("--n-train", default=2000, show_default=True)
@click.option("--n-eval", default=64, show_default=True)
@click.option("--max-len", default=512, show_default=True, help="drop pairs longer than this (memory)")
@click.option("--select-every", default=0, show_default=True,
              help="keep the best step: judge the answer CE on --select-n held-back training pairs at step 0 "
                   "and every this many steps, end at the lowest (0: the last step; for a re-tune from --init "
                   "that may overfit a small set)")
@click.option("--select-n", default=32, show_default=True, help="training pairs held back for --select-every")
@click.option("--threads", default=0, help="torch threads (0: default)")
def tune(base, task, data, out, full, precision, init_dir, decoder_dir, adapter, rank, alpha, targets, steps,
         batch_size, lr, seed, eval_every, ckpt_every, n_train, n_eval, max_len, select_every, select_n, threads):
    """Prefill-only tuning of one task specialist against a frozen decoder (SUN / QSUN)."""
    from edge.model.checkpoint import CheckpointError, load_model
    from edge.model.reference import ModelNotFound, resolve_model
    if bool(task) == bool(data):
        raise click.UsageError("give exactly one of --task or --data")
    if full and precision != "fp32":
        raise click.UsageError("--full trains the whole model; --decoder int4 applies to SUN tuning only")
    if full and adapter:
        raise click.UsageError("--full trains the whole model; --adapter lora applies to SUN tuning only")
    try:
        target_names = parse_targets(targets)
    except AdapterError as e:
        raise click.BadParameter(str(e), param_hint="--targets") from None
    try:
        src = resolve_model(base)
        model, ckpt = load_model(src)
    except ModelNotFound as e:
        raise click.BadParameter(str(e), param_hint="--base") from None
    except CheckpointError as e:
        raise click.ClickException(f"--base {base}: {e}") from None
    tok = ckpt.tokenizer
    if task:
        from export.real_tasks import REAL_TASKS
        kw = {"maths": dict(n_train=n_train, n_eval=n_eval), "tools": {}, "code": dict(n_train=n_train)}[task]
        td = REAL_TASKS[task](tok, **kw)
        train, ev, max_new, stops = td.train, td.eval[:n_eval], td.max_new, td.stop_ids
    else:
        from export.real_tasks import _examples
        rows = [json.loads(x) for x in Path(data).read_text().splitlines() if x.strip()]
        exs = _examples(tok, [(r["prompt"], r["answer"]) for r in rows], True)
        train, ev, max_new, stops = exs[n_eval:], exs[:n_eval], 256, tuple(sorted(tok.eos_ids))
    train = [e for e in train if len(e.prompt) + len(e.answer) <= max_len]
    click.echo(_start_line(src, task or data, full, adapter, precision, steps, lr, len(train)))
    lr = default_lr(adapter) if lr is None else lr
    if select_every and select_n >= len(train):
        raise click.BadParameter(f"cannot hold back {select_n} of {len(train)} training pairs", param_hint="--select-n")
    cfg = TuneConfig(mode="full" if full else "sun", decoder=precision, steps=steps, batch_size=batch_size,
                     lr=lr, seed=seed, eval_every=eval_every, ckpt_every=ckpt_every, max_new=max_new,
                     stop_ids=stops, threads=threads, warmup=min(50, steps // 10), adapter=adapter or "",
                     rank=rank, alpha=alpha if alpha is not None else 2.0 * rank, targets=target_names,
                     select_every=select_every, select_n=select_n if select_every else 0)
    init = _load_init(init_dir, model, bool(adapter)) if init_dir else None
    dec = None if full else build_decoder(model, precision)
    if dec is not None and decoder_dir:
        save_decoder(decoder_dir, dec[0], precision, dec[1], base=str(src))
    try:
        res = run_tune(model, train, cfg, eval_set=ev, out_dir=out, init=init, decoder=dec,
                       log=lambda r: click.echo(f"step {r['step']}: eval {r['eval_acc']:.3f}"),
                       manifest_extra={"task": task or Path(data).stem, "base": str(src),
                                       "tokenizer_fingerprint": tok.fingerprint()})
    except (TuneError, AdapterError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"saved {out} (decoder {res.decoder_fingerprint[:12]}, final {res.history[-1]})")


def _start_line(src, on, full: bool, adapter, precision: str, steps: int, lr, n_train: int) -> str:
    """What is tuned, how long and at which learning rate (and where that rate came from)."""
    what = ("full fine-tuning" if full else
            f"{'a LoRA adapter' if adapter else 'a prefill copy'} against the {precision} decoder")
    rate = (f"lr {lr:g} (--lr)" if lr is not None else
            f"lr {default_lr(adapter):g} (the default{' with --adapter ' + adapter if adapter else ''}; --lr sets it)")
    return f"tuning {what} of {src} on {on}: {steps} steps, {rate}, {n_train} training examples"


def _load_init(init_dir, model, lora: bool):
    """--init: an adapter directory for --adapter lora, a full prefill module otherwise."""
    from edge.model.lora.adapter import base_fingerprint
    from edge.model.lora.files import CONFIG_FILE, load_adapter
    from edge.model.sun_modules import load_module
    is_adapter = (Path(init_dir) / CONFIG_FILE).is_file()
    if is_adapter != lora:
        raise click.UsageError(f"--init {init_dir} is {'an adapter' if is_adapter else 'a full prefill module'}: "
                               f"{'add' if is_adapter else 'drop'} --adapter lora, or --init the other kind")
    try:
        if lora:
            return load_adapter(init_dir, model.cfg, base_fingerprint=base_fingerprint(model), dtype=torch.float32)
        return load_module(init_dir, dtype=torch.float32)[0]
    except AdapterError as e:
        raise click.BadParameter(str(e), param_hint="--init") from None


if __name__ == "__main__":
    tune()
