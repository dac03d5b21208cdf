"""What /proc/cpuinfo says of this CPU: its name (for benchmark reports) and its feature flags
(which storage format it computes natively: export/target_format.wide_format)."""
from __future__ import annotations

import platform
from typing import List

CPUINFO = "/proc/cpuinfo"


def _field(names, path: str):
    """The first line's value whose key is one of `names`, or None (no such line, no file)."""
    try:
        with open(path) as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() in names), None)
    except OSError:
        return None


def cpu_name(path: str = CPUINFO) -> str:
    """'AMD EPYC ...' (x86 'model name'), else what platform knows, else 'unknown'."""
    return _field(("model name",), path) or platform.processor() or "unknown"


def cpu_flags(path: str = CPUINFO) -> List[str]:
    """The first CPU's feature flags (x86 'flags', Arm 'Features'); [] where none are listed."""
    return (_field(("flags", "Features"), path) or "").split()
