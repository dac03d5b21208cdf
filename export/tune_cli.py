"""`edge-export tune`: train one SUN / QSUN specialist (or the full-FT baseline) from the command line.

  edge-export tune --base smollm2-135m --task maths --out runs/maths-sun --save-decoder runs/decoder-fp32
  edge-export tune --base smollm2-135m --task maths --decoder int4 --init runs/maths-sun --out runs/maths-qsun
  edge-export tune --base smollm2-135m --task maths --full --out runs/maths-full

Runs resume from their last checkpoint in --out; the saved manifest names the
decoder fingerprint the specialist was tuned for (edge/sun/prefill.py puts it
on every KV blob). `python -m export.tune_cli ...` is `edge-export tune ...`.
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from export.tune import TuneConfig, build_decoder, save_decoder
from export.tune import tune as run_tune


@click.command("tune")
@click.option("--base", required=True, help="base model: GGUF file, HF directory or a name from edge.model.fetch")
@click.option("--task", type=click.Choice(["maths", "tools", "code"]), help="a shipped task (DATA.md)")
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
@click.option("--steps", default=600, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--lr", default=2e-5, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--eval-every", default=100, show_default=True)
@click.option("--ckpt-every", default=50, show_default=True)
@click.option("--n-train", default=2000, show_default=True)
@click.option("--n-eval", default=64, show_default=True)
@click.option("--max-len", default=512, show_default=True, help="drop pairs longer than this (memory)")
@click.option("--threads", default=0, help="torch threads (0: default)")
def tune(base, task, data, out, full, precision, init_dir, decoder_dir, steps, batch_size, lr, seed,
             eval_every, ckpt_every, n_train, n_eval, max_len, threads):
    """Prefill-only tuning of one task specialist against a frozen decoder (SUN / QSUN)."""
    from edge.model.checkpoint import CheckpointError, load_model
    from edge.model.spec import ModelNotFound, resolve_model
    from edge.model.sun_modules import load_module
    if bool(task) == bool(data):
        raise click.UsageError("give exactly one of --task or --data")
    if full and precision != "fp32":
        raise click.UsageError("--full trains the whole model; --decoder int4 applies to SUN tuning only")
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
    cfg = TuneConfig(mode="full" if full else "sun", decoder=precision, steps=steps, batch_size=batch_size,
                     lr=lr, seed=seed, eval_every=eval_every, ckpt_every=ckpt_every, max_new=max_new,
                     stop_ids=stops, threads=threads, warmup=min(50, steps // 10))
    init = load_module(init_dir, dtype=torch.float32)[0] if init_dir else None
    dec = None if full else build_decoder(model, precision)
    if dec is not None and decoder_dir:
        save_decoder(decoder_dir, dec[0], precision, dec[1], base=str(src))
    res = run_tune(model, train, cfg, eval_set=ev, out_dir=out, init=init, decoder=dec,
               log=lambda r: click.echo(f"step {r['step']}: eval {r['eval_acc']:.3f}"),
               manifest_extra={"task": task or Path(data).stem, "base": str(src),
                               "tokenizer_fingerprint": tok.fingerprint()})
    click.echo(f"saved {out} (decoder {res.decoder_fingerprint[:12]}, final {res.history[-1]})")


if __name__ == "__main__":
    tune()
