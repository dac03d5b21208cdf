"""A --profile read as a command-line value: the one module of edge/ that imports devices.profile
(an import-linter exception in pyproject.toml), so placement and the memory plan read it the same way."""
from __future__ import annotations

import click


def load_device(name: str):
    """The DeviceProfile a --profile names; a bad name is a click error listing the known ones."""
    from devices.profile import load_profile
    try:
        return load_profile(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--profile") from None
