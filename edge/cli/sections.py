"""Options that carry their section: `--help` shows one heading per section, and a sectioned
`--config` file (edge/cli/config_file.py) takes each option in its section's TOML table.

click 8 has no option sections: an option made by `option(SECTION, ...)` remembers its
Section, and `SectionedCommand.format_options` writes one help section per Section, in the
order the options are declared; options without one (--config, --help) come last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click


@dataclass(frozen=True)
class Section:
    title: str      # the --help heading
    table: str      # the TOML table of a sectioned config file


ROLE = Section("Role", "role")
BROKER = Section("Broker", "broker")
HUB = Section("Hub", "hub")
MODEL = Section("Model", "model")
GENERATION = Section("Generation", "generation")
TARGET = Section("Target", "target")
DRAFT = Section("Draft service", "draft")
SUN = Section("SUN", "sun")
TELEMETRY = Section("Telemetry", "telemetry")


class SectionOption(click.Option):
    """A click.Option with the Section it belongs to (None: the command's plain options)."""

    def __init__(self, *args, section: Optional[Section] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.section = section


def option(section: Section, *param_decls, **attrs):
    """click.option for an option of `section`."""
    return click.option(*param_decls, cls=SectionOption, section=section, **attrs)


def section_of(param: click.Parameter) -> Optional[Section]:
    return getattr(param, "section", None)


class SectionedCommand(click.Command):
    """A command whose --help lists its options under their sections' headings."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                section = section_of(param)
                rows.setdefault(section.title if section else None, []).append(record)
        for title in [t for t in rows if t is not None] + ([None] if None in rows else []):
            with formatter.section(title or "Other options"):
                formatter.write_dl(rows[title])
