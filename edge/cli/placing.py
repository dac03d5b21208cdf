"""Placement as a command applies it: where a role's model runs, decided before it loads
(edge/engines/placement.py) from --accelerator / --gpu-layers / --repack, the --profile and the installed
runtime, with its warnings and refusals shown the way a command shows errors.

The start line (`placement: ...; backend: <why that backend>`, then `loaded ...: <where>` once
the engine says where it put the model) is what provisioning reads to confirm a Jetson decodes
on its GPU.
"""
from __future__ import annotations

from typing import Optional

import click

START_LINE = "placement: "


def profile_facts(profile: Optional[str]):
    """DeviceFacts of a --profile (None without one), read by edge/cli/device_profiles.py."""
    if not profile:
        return None
    from edge.cli.device_profiles import load_device
    from edge.engines.placement import DeviceFacts
    return DeviceFacts.from_profile(load_device(profile))


def place_model(model, device: str = "auto", gpu_layers=None, profile: Optional[str] = None, caps=None,
                repack: str = "auto", exact_rows: bool = False):
    """The Placement of a ResolvedModel on its backend, shown on stderr with why that backend; a
    request the runtime cannot honour is a click error naming the fix. caps: injected
    capabilities (tests); None asks the installed runtime. repack / exact_rows: --repack, --exact-rows
    (llama.cpp)."""
    from edge.engines.base import EngineError
    from edge.engines.placement import decide_placement, parse_gpu_layers
    try:
        p = decide_placement(model.backend, device or "auto", parse_gpu_layers(gpu_layers), profile_facts(profile),
                             caps, repack or "auto", exact_rows)
    except EngineError as e:           # PlacementError: it says what to do
        raise click.ClickException(str(e)) from None
    for w in p.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(START_LINE + p.describe() + f"; backend: {model.reason}", err=True)
    return p
