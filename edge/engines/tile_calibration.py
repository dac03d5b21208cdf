"""A llama.cpp engine's own TileCosts (edge/engines/llamacpp_tiles.py): measured once per model
file, thread count, CPU and llama.cpp version, kept in ~/.cache/starsun/tile_costs.json.

Whether a short prefill over a long cache should feed held tokens again to fill a 64-row tile
depends on the model: the fitted defaults are Qwen2.5-Coder-0.5B's, and on the 1.5B they made a
chat's next turn a 64-row call of 1.40 s where its 25 new rows alone took 0.99 s (one thread,
1,800 cached tokens). So a target with a prompt cache measures at start, on a scratch sequence:
calls of CAL_SIZES rows and a 64-row tile over an empty cache, CAL_ROWS rows and a tile over
CAL_DEPTH cached tokens (the fastest of `reps`): ~10 s on the 0.5B, ~20 s on the 1.5B at one
thread, once (the file keeps it).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, Optional

from edge.engines.llamacpp_tiles import FA_TILE_ROWS, TileCosts

log = logging.getLogger(__name__)
CAL_DEPTH = 512
MIN_DEPTH = 192
CAL_SIZES = (8, 16, 32, 48)        # rows over an empty cache: the matmuls' cost by rows (fewer: below 8)
CAL_ROWS = 16                      # rows over CAL_DEPTH: the row-by-row attention's cost by depth


def costs_from(rows0: Dict[int, float], rows_d: float, tile0: float, tile_d: float, depth: int = CAL_DEPTH,
               rows: int = CAL_ROWS) -> TileCosts:
    """TileCosts (seconds) from calls over an empty cache (rows0: by rows; tile0) and over `depth`
    cached tokens (`rows` rows: rows_d; a tile: tile_d)."""
    return TileCosts(rows=tuple(sorted(rows0.items())), row_depth=max(rows_d - rows0[rows], 0.0) / (rows * depth),
                     tile=tile0, tile_depth=max(tile_d - tile0, 0.0) / depth)


def measure_tile_costs(engine, depth: int = CAL_DEPTH, reps: int = 2,
                       clock: Callable[[], float] = time.perf_counter) -> TileCosts:
    """Time the calls on a scratch sequence of `engine` (freed after)."""
    toks = [100 + (97 * i) % max(1, engine.vocab_size - 100) for i in range(depth + FA_TILE_ROWS)]
    seq = engine.new_sequence()

    def fastest(at: int, n: int) -> float:
        best = float("inf")
        for _ in range(reps):
            engine.truncate(seq, at)
            t = clock()
            engine.forward_last(seq, toks[at:at + n])
            best = min(best, clock() - t)
        return best
    try:
        engine.forward_last(seq, toks[:depth])
        rows_d, tile_d = fastest(depth, CAL_ROWS), fastest(depth, FA_TILE_ROWS)
        rows0 = {n: fastest(0, n) for n in CAL_SIZES}
        tile0 = fastest(0, FA_TILE_ROWS)
    finally:
        engine.free(seq)
    return costs_from(rows0, rows_d, tile0, tile_d, depth)


def calibrate_tiles(engine, path: Optional[Path] = None, clock: Callable[[], float] = time.perf_counter,
                    say: Callable[[str], None] = log.info) -> Optional[TileCosts]:
    """Give a CPU llama.cpp engine with flash attention its measured TileCosts (from the file, else
    measured and written there, `say` telling why the start takes longer); None, nothing changed,
    for any other engine (wrappers unwrapped)."""
    inner = engine
    while hasattr(inner, "inner"):
        inner = inner.inner
    if not hasattr(inner, "tile_costs") or inner.flash_attn is False or inner.gpu_layers:
        return None
    depth = min(CAL_DEPTH, inner.max_len - FA_TILE_ROWS)
    if depth < MIN_DEPTH:
        return None                  # a context this short: a refeed barely ever pays (the defaults decide)
    path = Path(path) if path else cache_file()
    known = _read(path)
    key = _key(inner)
    if key in known:
        costs = TileCosts(**{**known[key], "rows": tuple(tuple(p) for p in known[key]["rows"])})
    else:
        say(f"measuring when a next turn's short prefill pays a 64-row call (once for this model and CPU, "
            f"~10-20 s; kept in {path})")
        costs = measure_tile_costs(inner, depth, clock=clock)
        known[key] = asdict(costs)
        _write(path, known)
    inner.tile_costs = costs
    return costs


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "starsun" / "tile_costs.json"


def _key(engine) -> str:
    from edge.engines.cpu_threads import default_threads
    try:
        import llama_cpp
        version = getattr(llama_cpp, "__version__", "?")
    except ImportError:
        version = "?"
    return "|".join(str(x) for x in (engine.fingerprint, engine.threads or default_threads(), _cpu(), version,
                                      min(CAL_DEPTH, engine.max_len - FA_TILE_ROWS)))


def _cpu() -> str:
    """The CPU's model name (engines may not import edge.telemetry, whose cpu_info says the same)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)                              # a reader never sees half a file
    except OSError as e:
        log.warning("could not keep the tile costs in %s: %s", path, e)
