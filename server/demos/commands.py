"""`edge-hub demo` and `edge-hub demo-sun`: the demos' command lines (server/demos/ may import export/)."""
from __future__ import annotations

from pathlib import Path

import click

from edge.cli.options import gamma_option, renamed_option
from edge.cli.sections import TARGET
from export.target_format import FORMATS


@click.command("demo")
@click.option("--targets", "-N", "n_targets", default=4, show_default=True, help="targets in the star")
@click.option("--max-new", "-n", default=48, show_default=True, help="new tokens per target")
@gamma_option(TARGET, "the N targets' drafted tokens per verification")
@click.option("--draft", "-D", default="qwen2.5-coder-0.5b", show_default=True, help="the hub's draft model")
@click.option("--target", "-T", default="qwen2.5-coder-1.5b", show_default=True, help="every target's model")
@click.option("--backend", type=click.Choice(["llamacpp", "torch"]), default="llamacpp", show_default=True)
@renamed_option("--broker", "--broker-kind embedded|mosquitto (the broker the demo starts)")
@click.option("--broker-kind", "broker", type=click.Choice(["embedded", "mosquitto"]), default="embedded", show_default=True,
              help="the broker the demo starts")
@click.option("--check", is_flag=True, help="then decode alone and compare each target's output")
@click.option("--plot", "plot_path", default=None, help="plot path [default: runs/demo-star/star_demo.png]")
@click.option("--live/--no-live", default=True, show_default=True, help="refresh the table in place")
@click.option("--show-text", is_flag=True, help="print each target's text at the end")
@click.option("--target-nice", default=5, show_default=True,
              help="lower the targets' priority so they do not starve the hub's draft on shared cores (0: off)")
@click.option("--two-device/--no-two-device", default=True, show_default=True,
              help="first: one target alone vs through a star whose hub + draft run on another core")
@click.option("--two-device-gammas", default="3,auto", show_default=True, metavar="γ,auto",
              help="the γ modes of the two-device part (integers and/or auto[:N])")
@click.option("--two-device-format", default=None, type=click.Choice(FORMATS),
              help="the two-device target's GGUF: as fetched (Q4_K_M: compute-bound on a CPU, no draft pays) or "
                   "the same weights stored as F16 / BF16 / Q8_0 (memory-bound, a Jetson GPU's regime; written once "
                   "to models/)  [default with llama.cpp: BF16 where the CPU has a BF16 dot product "
                   "(avx512_bf16, Arm bf16), else F16; native with torch]")
def demo(**options):
    """StarSD on this machine: one hub + draft service, N targets, each on its own prompt."""
    from server.demos.star_demo import demo_command
    demo_command(**options)


@click.command("demo-sun")
@click.option("--requests", "n_requests", default=120, show_default=True, help="requests to serve")
@click.option("--rate", default=150.0, show_default=True, help="mean arrivals per second (Poisson)")
@click.option("--zipf", default=1.2, show_default=True, help="task popularity skew (Zipf exponent)")
@click.option("--max-batch", default=32, show_default=True, help="decoder: sequences per step")
@click.option("--work", default=str(Path(__file__).resolve().parents[2] / "runs" / "demo-sun"),
              show_default=True, type=click.Path(file_okay=False), help="where the specialists are made and cached")
@click.option("--seed", default=0, show_default=True)
def demo_sun(**options):
    """SUN: three task specialists, adapters on one prefill worker, share one int4 decoder over MQTT (tunes once)."""
    from server.demos.sun_demo import demo_command
    demo_command(**options)
