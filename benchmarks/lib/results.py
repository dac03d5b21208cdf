"""Where the benchmarks write, and the repository they run from.

Every script runs from the repository root as a module (`python -m benchmarks.GROUP.SCRIPT`)
and writes one variant per run: benchmarks/results/<script>/<variant>.{json,md,png}. A run
with the script's defaults writes the variant `default` (a few scripts name it from their
options, e.g. the device profile); `--out benchmarks/results/<script>/<name>` writes a named
one. benchmarks/results/README.md names each question's figure of record and its command.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def result_stem(script: str, variant: str = "default") -> Path:
    """benchmarks/results/<script>/<variant>: the path a run's .json, .md and .png share."""
    return RESULTS / script / variant
