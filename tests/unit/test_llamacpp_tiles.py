"""edge/engines/llamacpp_tiles.py: a short prefill over a long cache feeds held tokens again to fill
one 64-row tile where the cost model says it pays, never over a short cache or for a call that
is tiled already; a long prefill's last call is not a short one."""
from edge.engines.llamacpp_tiles import FA_TILE_ROWS, chunk_sizes, refeed, tiles_pay


def test_a_next_turn_over_a_long_cache_fills_a_tile():
    assert refeed(1799, 25) == FA_TILE_ROWS - 25          # the agent_workload turn: 64 rows in one call
    assert refeed(2150, 23) == FA_TILE_ROWS - 23


def test_no_refeed_where_rows_are_cheap_or_a_tile_is_there_already():
    assert refeed(1800, 4) == 0                            # a few rows cost less than a tile
    assert refeed(100, 25) == 0                            # a short cache: rows are cheap
    assert refeed(5000, 64) == refeed(5000, 200) == 0      # tiled as it is
    assert refeed(30, 20) == 0                             # not enough held to fill a tile
    assert refeed(1000, 0) == 0


def test_the_cost_model_crosses_over_where_it_was_measured():
    # 16 rows cost more than a tile at depth 1,800 and less at 500 (llamacpp_tiles.py's figures)
    assert tiles_pay(16, 1800) and not tiles_pay(16, 500)
    assert not any(tiles_pay(n, 0) for n in range(1, 40))


def test_a_long_prefill_ends_with_a_full_tile():
    assert chunk_sizes(530, 512) == [466, 64]
    assert chunk_sizes(1752, 512) == [512, 512, 512, 216]
    assert chunk_sizes(1024, 512) == [512, 512]
    assert chunk_sizes(20, 512) == [20]
    assert chunk_sizes(0, 512) == []
    assert chunk_sizes(100, 64) == [64, 36]                # too small a batch to move tokens
    assert sum(chunk_sizes(1000, 100)) == 1000
