"""`edge-export`: offline exporters (ONNX, GGUF), bundles, and SUN prefill-only tuning.

    edge-export onnx smollm2-135m out/smol --graphs model,prefill --int4
    edge-export gguf smollm2-135m out/smol-q4_0.gguf --type Q4_0
    edge-export store qwen2.5-coder-0.5b --as Q4_0  # models/qwen2.5-coder-0.5b-instruct-q4_0.gguf
    edge-export bundle smollm2-135m out/bundle --onnx model --int4 --gguf Q4_0
    edge-export bundle out/bundle --show            # list and verify an existing bundle
    edge-export adapter runs/tools/adapter out/tools.lora.gguf --base out/smol-f16.gguf --task tools
    edge-export adapter runs/tools/adapter out/bundle --bundle --task tools   # into a bundle
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from export.target_format import FORMATS, NATIVE


def _fail(e: Exception):
    raise click.ClickException(str(e))


def _user_errors() -> tuple:
    """Errors a user can cause (bad path, bad checkpoint, bad bundle): a message, not a traceback."""
    from edge.model.checkpoint import CheckpointError
    from edge.engines.base import EngineError
    return (CheckpointError, EngineError, ValueError, OSError)


def _csv(value: str):
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


@click.group(help="StarSun exporters: ONNX graphs, GGUF files, bundles for devices, SUN tuning.")
def main():
    pass


@main.command("onnx", help="Export a checkpoint (GGUF, HF dir, model name or SUN module dir) as ONNX graphs.")
@click.argument("src")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--graphs", default="model", show_default=True, help="comma list of model, prefill, decoder")
@click.option("--int4", is_flag=True, help="projections as MatMulNBits on export/quant.py's int4 grid")
@click.option("--int4-lm-head", is_flag=True, help="also lm_head in int4 (an untied copy for tied models)")
@click.option("--accuracy-level", type=int, default=0, show_default=True,
              help="MatMulNBits accuracy_level: 0 = float math on the exact grid; 4 = int8 activations (faster, CPU)")
@click.option("--external-data/--no-external-data", default=None, help="weights in a side .data file (default: > 1 GiB)")
def onnx_cmd(src, out_dir, graphs, int4, int4_lm_head, accuracy_level, external_data):
    from export.bundle import _load_source
    from export.onnx import export_onnx
    try:
        model, ident, _ = _load_source(src)
        for g in _csv(graphs):
            t0 = time.perf_counter()
            path = export_onnx(model, Path(out_dir) / f"{g}{'.int4' if int4 else ''}.onnx", kind=g, int4=int4,
                               int4_lm_head=int4_lm_head, fingerprint=ident["kv_fingerprint"],
                               accuracy_level=accuracy_level, external_data=external_data)
            click.echo(f"{path}  ({time.perf_counter() - t0:.1f} s)")
    except _user_errors() as e:
        _fail(e)


@main.command("gguf", help="Write a checkpoint as a GGUF file llama.cpp runs (F32, F16, Q8_0, Q4_0; "
              "K-quants through llama.cpp's own quantiser).")
@click.argument("src")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--type", "ftype", default="Q4_0", show_default=True,
              type=click.Choice(["F32", "F16", "Q8_0", "Q4_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_S",
                                 "Q5_K_M", "Q6_K"]),
              help="Q4_0 = the QSUN int4 grid; *_K = llama.cpp's K-quant mixes (needs llama-cpp-python)")
@click.option("--float-type", default="F16", show_default=True, type=click.Choice(["F32", "F16", "Q8_0"]),
              help="embeddings / lm_head in Q4_0 files")
def gguf_cmd(src, out, ftype, float_type):
    from export.gguf import export_gguf
    try:
        click.echo(export_gguf(src, out, ftype=ftype, float_type=float_type))
    except _user_errors() as e:
        _fail(e)


@main.command("store", help="Store a GGUF model's weights in another llama.cpp format, next to it (llama.cpp's "
              "quantiser, once; then reused). Prints the file's path: pass it as --model. On an x86 hub "
              "Q4_0 is the cheaper draft; F16 / BF16 make a CPU target's verify memory-bound.")
@click.argument("model")
@click.option("--as", "fmt", required=True, type=click.Choice([f for f in FORMATS if f != NATIVE]),
              help="the storage format (benchmarks/star/draft_formats.py measures which pays)")
def store_cmd(model, fmt):
    from export.gguf import GGUFExportError
    from export.target_format import target_gguf
    try:
        click.echo(target_gguf(model, fmt))
    except _user_errors() + (GGUFExportError,) as e:
        _fail(e)


@main.command("bundle", help="Export SRC into the bundle OUT_DIR (created or extended), or --show a bundle.")
@click.argument("src")
@click.argument("out_dir", required=False, type=click.Path(file_okay=False))
@click.option("--onnx", "graphs", default="model", show_default=True,
              help="comma list of ONNX graphs (model, prefill, decoder); empty for none")
@click.option("--int4", is_flag=True, help="int4 ONNX variants (MatMulNBits on the QSUN grid)")
@click.option("--no-fp32", is_flag=True, help="skip the fp32 ONNX variants")
@click.option("--int4-lm-head", is_flag=True)
@click.option("--gguf", "gguf_types", default="", help="comma list of GGUF types: F32, F16, Q8_0, Q4_0")
@click.option("--tokenizer", default=None, help="checkpoint to take the tokenizer from (for SUN module dirs)")
@click.option("--show", is_flag=True, help="list and verify the bundle at SRC")
def bundle_cmd(src, out_dir, graphs, int4, no_fp32, int4_lm_head, gguf_types, tokenizer, show):
    from export.bundle import build_bundle, describe, validate_bundle
    try:
        if show:
            validate_bundle(src)
            for line in describe(src):
                click.echo(line)
            click.echo("bundle OK (all sizes and sha256 match)")
            return
        if not out_dir:
            raise click.UsageError("give OUT_DIR (or --show to inspect SRC)")
        build_bundle(src, out_dir, onnx_graphs=_csv(graphs), int4=int4, fp32=not no_fp32,
                     int4_lm_head=int4_lm_head, gguf_types=_csv(gguf_types), tokenizer=tokenizer,
                     log=click.echo)
        for line in describe(out_dir):
            click.echo(line)
    except _user_errors() as e:
        _fail(e)


@main.command("adapter", help="Write a PEFT LoRA adapter directory as the GGUF LoRA file llama.cpp loads beside "
              "BASE (--base: the base model's GGUF), or add it to a bundle (--bundle: OUT is the bundle directory).")
@click.argument("adapter_dir", type=click.Path(file_okay=False))
@click.argument("out")
@click.option("--base", default=None, help="the base model's GGUF (default with --bundle: the bundle's GGUF)")
@click.option("--task", default=None, help="the SUN task the adapter serves (recorded in the file and manifest)")
@click.option("--type", "ftype", default="F32", show_default=True, type=click.Choice(["F32", "F16"]))
@click.option("--bundle", "to_bundle", is_flag=True, help="OUT is a bundle: add the adapter to its manifest")
def adapter_cmd(adapter_dir, out, base, task, ftype, to_bundle):
    from export.gguf_lora import export_adapter
    try:
        if to_bundle:
            from export.bundle import add_adapter, describe
            add_adapter(out, adapter_dir, task=task, base=base, ftype=ftype, log=click.echo)
            for line in describe(out):
                click.echo(line)
            return
        if not base:
            raise click.UsageError("give --base (the base model's GGUF the adapter will be served with)")
        export_adapter(adapter_dir, base, out, ftype=ftype, task=task, log=click.echo)
    except _user_errors() as e:
        _fail(e)


# --- SUN prefill-only tuning -------------------------------------------------------------------
# The SUN helper registers `edge-export tune` here: define a click command in
# export/tune_cli.py named `tune` and it is attached below (the group stays
# importable when that module is absent or broken).
def _attach_tune():
    try:
        from export.tune_cli import tune  # noqa: F401
    except ImportError:
        return
    main.add_command(tune, "tune")


_attach_tune()

if __name__ == "__main__":
    sys.exit(main())
