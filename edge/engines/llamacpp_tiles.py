"""How a prefill is cut into llama_decode calls so that llama.cpp's CPU flash attention tiles it.

ggml-cpu's flash attention computes a ubatch of at least GGML_FA_TILE_Q (64) query rows per
sequence tile by tile, and a shorter one row by row, each row walking the whole cache on its
own (ops.cpp: ggml_compute_forward_flash_attn_ext_f16). Row by row is what keeps a verify of
γ+1 rows bit-equal to one-row decoding (docs/models.md), and it is cheap over a short cache; over
a long one it is the slow path: a chat's next turn (~25 new tokens after ~1,800 cached) cost
more than feeding 64 tokens. Measured here (Qwen2.5-Coder-0.5B Q4_K_M, one thread, Xeon
AVX-512, seconds at depth 1,800 / 1,000 / 500): 4 rows 0.50 / 0.23 / 0.16, 8 rows 0.74 / 0.38 /
0.30, 16 rows 1.19 / 0.69 / 0.43; 64 rows (tiled) 0.95 / 0.81 / 0.71.

So a prefill that would feed fewer than 64 tokens over a long cache feeds some cached tokens
again, 64 in all (`refeed`), when the cost model below (TileCosts) says it pays; and a prefill longer than
n_batch is cut so that its last call is not a short one (`chunk_sizes`). Only the prefill: a
verify call stays as the loop makes it. The re-fed tokens' KV is recomputed from the same tokens
at the same positions, as a cold prefill of them would (in tiles rather than rows: the last bits
of later rows may differ, as between any two ways of batching a prefill; docs/models.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

FA_TILE_ROWS = 64           # GGML_FA_TILE_Q in ggml-cpu/common.h


@dataclass(frozen=True)
class TileCosts:
    """Seconds (or any one unit) of a call over a cache of D tokens: `new` rows fed row by row
    rows_at(new) + new * row_depth * D, rows_at interpolated in `rows` ((n, cost over an empty
    cache) pairs: a call's matmuls grow less than in proportion to its rows); a 64-row tile
    tile + tile_depth * D. The defaults are fitted to the 0.5B's figures above (in units of one row
    over an empty cache); they are not every model's (Qwen2.5-Coder-1.5B Q4_K_M here: ~9 us a row
    per cached token against the 0.5B's ~29, so a tile pays only from ~48 rows at depth 1,800),
    so a target with a prompt cache measures its own at start (edge/engines/tile_calibration.py)."""
    rows: Tuple[Tuple[int, float], ...] = ((1, 1.0), (FA_TILE_ROWS, float(FA_TILE_ROWS)))
    row_depth: float = 1 / 470.0
    tile: float = 46.0
    tile_depth: float = 1 / 67.0

    def rows_at(self, n: int) -> float:
        pts = sorted(self.rows)
        if n <= pts[0][0]:
            return pts[0][1] * n / pts[0][0]
        for (n0, c0), (n1, c1) in zip(pts, pts[1:]):
            if n <= n1:
                return c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        (n0, c0), (n1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (n - n1) / (n1 - n0)


FITTED = TileCosts()


def tiles_pay(new: int, depth: int, costs: TileCosts = FITTED) -> bool:
    """Feeding 64 tokens (tiled) at `depth` costs less than `new` (< 64) tokens row by row."""
    return costs.rows_at(new) + new * costs.row_depth * depth > costs.tile + costs.tile_depth * depth


def refeed(held: int, new: int, costs: TileCosts = FITTED) -> int:
    """How many of the `held` cached tokens a prefill of `new` tokens after them should feed again
    (0: none), so that the call has FA_TILE_ROWS rows and is tiled."""
    if new <= 0 or new >= FA_TILE_ROWS or held + new < FA_TILE_ROWS:
        return 0
    back = FA_TILE_ROWS - new
    return back if tiles_pay(new, held, costs) else 0


def chunk_sizes(n: int, n_batch: int) -> List[int]:
    """n tokens as calls of at most n_batch, the last one no shorter than FA_TILE_ROWS where the
    one before can give it tokens (530 at 512: 466 + 64, not 512 + 18)."""
    sizes = [n_batch] * (n // n_batch) + ([n % n_batch] if n % n_batch else [])
    moved = FA_TILE_ROWS - sizes[-1] if sizes else 0
    if len(sizes) > 1 and moved > 0 and sizes[-2] - moved >= FA_TILE_ROWS:
        sizes[-2] -= moved
        sizes[-1] += moved
    return sizes
