"""edge/engines/tile_calibration.py: an engine's own TileCosts, measured on a scratch sequence and kept
in a file; refeed follows them (the fitted 0.5B costs tile a 25-token turn at depth 1,800, costs like
the 1.5B's measured here do not)."""
from __future__ import annotations

import json
from dataclasses import astuple

import pytest

from edge.engines.llamacpp_tiles import FITTED, FA_TILE_ROWS, TileCosts, refeed
from edge.engines.tile_calibration import CAL_DEPTH, CAL_ROWS, CAL_SIZES, calibrate_tiles, costs_from, measure_tile_costs

# Qwen2.5-Coder-1.5B Q4_K_M, one thread, here (seconds): rows over an empty cache, ~9 us a row per cached
# token, a tile 1.04 s + 175 us per cached token
LIKE_15B = TileCosts(rows=((8, 0.45), (16, 0.46), (32, 0.66), (48, 0.83)), row_depth=9.2e-6,
                     tile=1.04, tile_depth=1.75e-4)


def same(a: TileCosts, b: TileCosts) -> bool:
    flat = [x for pair in a.rows for x in pair] + list(astuple(a)[1:])
    return flat == pytest.approx([x for pair in b.rows for x in pair] + list(astuple(b)[1:]))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class ModelledEngine:
    """An engine whose calls take the time a TileCosts says."""

    def __init__(self, costs: TileCosts, clock: Clock, fingerprint="f"):
        self.costs, self.clock, self.fingerprint = costs, clock, fingerprint
        self.vocab_size, self.threads, self.flash_attn, self.gpu_layers, self.max_len = 1000, 1, None, 0, 4096
        self.tile_costs = FITTED
        self.lengths, self.calls, self.freed = {}, [], []

    def new_sequence(self):
        self.lengths[len(self.lengths) + 1] = 0
        return len(self.lengths)

    def truncate(self, seq, n):
        assert 0 <= n <= self.lengths[seq]
        self.lengths[seq] = n

    def forward_last(self, seq, toks):
        d, n, c = self.lengths[seq], len(toks), self.costs
        self.clock.now += c.tile + c.tile_depth * d if n == FA_TILE_ROWS else c.rows_at(n) + n * c.row_depth * d
        self.calls.append((d, n))
        self.lengths[seq] += n

    def free(self, seq):
        self.freed.append(seq)


def test_costs_from_recovers_the_model_that_made_the_timings():
    d = CAL_DEPTH
    rows0 = {8: 0.2, 16: 0.3, 48: 0.8}
    got = costs_from(rows0, 0.3 + 16 * 2e-5 * d, 0.9, 0.9 + 3e-4 * d)
    assert same(got, TileCosts(rows=((8, 0.2), (16, 0.3), (48, 0.8)), row_depth=2e-5, tile=0.9, tile_depth=3e-4))
    assert got.rows_at(12) == pytest.approx(0.25) and got.rows_at(2) == pytest.approx(0.05)


LIKE_05B = TileCosts(rows=tuple((n, FITTED.rows_at(n)) for n in CAL_SIZES), row_depth=FITTED.row_depth,
                     tile=FITTED.tile, tile_depth=FITTED.tile_depth)


@pytest.mark.parametrize("costs", [LIKE_05B, LIKE_15B])
def test_measured_on_a_scratch_sequence_freed_after(costs):
    clock = Clock()
    eng = ModelledEngine(costs, clock)
    got = measure_tile_costs(eng, clock=clock)
    assert same(got, costs)
    assert eng.calls[0] == (0, CAL_DEPTH) and eng.freed == [1]
    assert {(CAL_DEPTH, CAL_ROWS), (CAL_DEPTH, FA_TILE_ROWS), (0, FA_TILE_ROWS)} | {(0, n) for n in CAL_SIZES} \
        <= set(eng.calls)


def test_refeed_follows_the_engines_costs():
    assert refeed(1800, 25) == FA_TILE_ROWS - 25                # the 0.5B's: a tile pays
    assert refeed(1800, 25, LIKE_15B) == 0                      # the 1.5B's: 25 rows cost less
    assert refeed(1800, 50, LIKE_15B) == FA_TILE_ROWS - 50      # ... and 50 more
    assert refeed(1800, 25, LIKE_05B) == FA_TILE_ROWS - 25


def test_calibrated_once_then_read_from_the_file(tmp_path):
    path = tmp_path / "tile_costs.json"
    clock = Clock()
    first = ModelledEngine(LIKE_15B, clock)
    assert first.tile_costs is FITTED
    assert same(calibrate_tiles(first, path, clock), LIKE_15B)
    assert same(first.tile_costs, LIKE_15B) and first.calls
    assert len(json.loads(path.read_text())) == 1

    class Wrapper:                                              # BatchedCalls: the engine inside
        def __init__(self, inner):
            self.inner = inner
    again = ModelledEngine(FITTED, clock)
    assert same(calibrate_tiles(Wrapper(again), path, clock), LIKE_15B)
    assert again.calls == [] and same(again.tile_costs, LIKE_15B)   # nothing measured again
    other = ModelledEngine(FITTED, clock, fingerprint="another model")
    calibrate_tiles(other, path, clock)
    assert other.calls and len(json.loads(path.read_text())) == 2


def test_engines_without_tiles_are_left_alone(tmp_path):
    class TorchLike:
        flash_attn, gpu_layers = None, 0
    assert calibrate_tiles(TorchLike(), tmp_path / "t.json") is None
    off = ModelledEngine(FITTED, Clock())
    off.flash_attn = False
    assert calibrate_tiles(off, tmp_path / "t.json") is None and off.calls == []
    short = ModelledEngine(FITTED, Clock())
    short.max_len = 200                                         # no room to measure at depth: defaults
    assert calibrate_tiles(short, tmp_path / "t.json") is None and short.calls == []
    assert not (tmp_path / "t.json").exists()
