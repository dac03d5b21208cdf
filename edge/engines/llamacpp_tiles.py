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
again, 64 in all (`refeed`), when the cost model below says it pays; and a prefill longer than
n_batch is cut so that its last call is not a short one (`chunk_sizes`). Only the prefill: a
verify call stays as the loop makes it. The re-fed tokens' KV is recomputed from the same tokens
at the same positions, as a cold prefill of them would (in tiles rather than rows: the last bits
of later rows may differ, as between any two ways of batching a prefill; docs/models.md).
"""
from __future__ import annotations

from typing import List

FA_TILE_ROWS = 64           # GGML_FA_TILE_Q in ggml-cpu/common.h
# The cost model, in units of one row over an empty cache, fitted to the figures above: a row
# fed row by row at depth D costs 1 + D / ROW_DEPTH; a 64-row tile TILE_BASE + D / TILE_DEPTH.
ROW_DEPTH = 470.0
TILE_BASE = 46.0
TILE_DEPTH = 67.0


def tiles_pay(new: int, depth: int) -> bool:
    """Feeding 64 tokens (tiled) at `depth` costs less than `new` (< 64) tokens row by row."""
    return new * (1.0 + depth / ROW_DEPTH) > TILE_BASE + depth / TILE_DEPTH


def refeed(held: int, new: int) -> int:
    """How many of the `held` cached tokens a prefill of `new` tokens after them should feed again
    (0: none), so that the call has FA_TILE_ROWS rows and is tiled."""
    if new <= 0 or new >= FA_TILE_ROWS or held + new < FA_TILE_ROWS:
        return 0
    back = FA_TILE_ROWS - new
    return back if tiles_pay(new, held) else 0


def chunk_sizes(n: int, n_batch: int) -> List[int]:
    """n tokens as calls of at most n_batch, the last one no shorter than FA_TILE_ROWS where the
    one before can give it tokens (530 at 512: 466 + 64, not 512 + 18)."""
    sizes = [n_batch] * (n // n_batch) + ([n % n_batch] if n % n_batch else [])
    moved = FA_TILE_ROWS - sizes[-1] if sizes else 0
    if len(sizes) > 1 and moved > 0 and sizes[-2] - moved >= FA_TILE_ROWS:
        sizes[-2] -= moved
        sizes[-1] += moved
    return sizes
