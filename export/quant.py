"""The ONE int4 grid of StarSun, shared by QSUN training and both exporters.

Group-wise symmetric 4-bit weight-only quantisation of a linear weight
``w[out, in]``, groups of 32 consecutive ``in`` values. It is llama.cpp's Q4_0
reference quantiser, reproduced bit for bit (``gguf.quants.Q4_0``,
``quantize_row_q4_0_ref``), so that

* training (``fake_quant_q4``) sees exactly the numbers a GGUF Q4_0 file and an
  ONNX MatMulNBits node dequantise to, and
* both export layouts (``to_gguf_q4_0_bytes``, ``to_matmulnbits``) are mere
  re-arrangements of the same codes and scales.

Per block of 32 values x (all arithmetic in float32, like the reference):

    m  = the x of largest magnitude (signed; the first one on a tie)
    d  = m / -8                  # so m itself maps to code 0
    id = 0 if d == 0 else 1 / d
    q  = min(15, trunc(x * id + 8.5))    # round half up on x/d + 8
    scale = fp16(d)              # the codes use the UNROUNDED d, as llama.cpp does
    w' = float32(scale) * (q - 8)        # exact in float32 (11 bit x 4 bit)

Storing ``scale`` as float32 for MatMulNBits (whose scales must have the
activation dtype) keeps the fp16-rounded value, so both formats dequantise
to the same float32 numbers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

GROUP = 32  # values per block along the input dimension
ZERO_POINT = 8  # symmetric: code 8 is zero

# Which state-dict entries are quantised: every projection inside a block
# (q/k/v/o, gate/up/down), i.e. the weights that dominate a decode step's
# memory traffic. Embeddings, norms, biases and lm_head stay in float: the
# embedding is a gather (not bandwidth-bound per token), lm_head is the most
# accuracy-sensitive matrix, and tied models share it with the embedding.
QUANTISED_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$"
)


class QuantError(ValueError):
    """A tensor that the int4 grid cannot represent (shape or values)."""


@dataclass(frozen=True)
class Q4Packed:
    """A quantised [out, in] weight.

    codes:  uint8 [out, in // 2]; value 2j in the low nibble, 2j+1 in the high
            nibble (the MatMulNBits order); each code is 0..15, zero at 8.
    scales: float16 [out, in // 32], one per group.
    shape:  (out, in) of the original weight.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]

    @property
    def n_blocks(self) -> int:
        return self.shape[1] // GROUP


def _check(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise QuantError(f"int4 quantisation takes a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if w.shape[1] % GROUP:
        raise QuantError(
            f"int4 groups are {GROUP} input values wide, but this weight has in={w.shape[1]} "
            f"(shape {tuple(w.shape)}); keep this tensor in float or pad the model's dimension"
        )


def _codes_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked codes uint8 [out, in] and fp16 scales [out, in // 32]."""
    _check(w)
    out, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(out, k // GROUP, GROUP)
    imax = blocks.abs().argmax(dim=-1, keepdim=True)  # first index on ties, like numpy
    m = blocks.gather(-1, imax)
    if not torch.isfinite(m).all():  # argmax picks NaN/inf first, so checking m covers the block
        raise QuantError("weight contains NaN or inf; it cannot be quantised (check the checkpoint)")
    d = m / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    # two separate float32 roundings (multiply, then add), as in the reference
    q = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    scales = d.squeeze(-1).to(torch.float16)
    if torch.isinf(scales).any():
        raise QuantError("a weight group has |w| above 8 * 65504, beyond Q4_0's fp16 scale; keep it in float")
    return q.reshape(out, k), scales


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, half * 2)


def quantize_q4(w: torch.Tensor) -> Q4Packed:
    """Quantise a float [out, in] weight (in % 32 == 0) to the int4 grid."""
    codes, scales = _codes_scales(w)
    return Q4Packed(codes=_pack(codes), scales=scales, shape=(int(w.shape[0]), int(w.shape[1])))


def dequantize_q4(packed: Q4Packed) -> torch.Tensor:
    """The float32 weight the grid represents (what every backend computes with)."""
    out, k = packed.shape
    q = _unpack(packed.codes).to(torch.float32) - ZERO_POINT
    s = packed.scales.to(torch.float32).repeat_interleave(GROUP, dim=1)
    return (q * s).reshape(out, k)


def fake_quant_q4(w: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype and device; for the frozen QSUN decoder.

    No gradient flows through it (the decoder is frozen). Returned in w's dtype:
    float32 keeps it exact; bf16/fp16 would round the grid, so train in float32.
    """
    codes, scales = _codes_scales(w)
    out, k = w.shape
    q = codes.to(torch.float32).reshape(out, k // GROUP, GROUP) - ZERO_POINT
    return (q * scales.to(torch.float32).unsqueeze(-1)).reshape(out, k).to(w.dtype)


# --- which weights -------------------------------------------------------------------------------


def is_quantised_linear(name: str) -> bool:
    """True for the state-dict names the int4 decoder stores as int4 (see QUANTISED_LINEAR)."""
    return QUANTISED_LINEAR.match(name) is not None


def quantize_model_linears(
    state_dict: Mapping[str, torch.Tensor], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor | Q4Packed]:
    """A copy of ``state_dict`` with the decoder's projections as ``Q4Packed``.

    ``names`` overrides the default choice (``is_quantised_linear``); every
    other entry (embeddings, norms, biases, lm_head) is passed through unchanged.
    """
    chosen = set(names) if names is not None else {n for n in state_dict if is_quantised_linear(n)}
    missing = chosen - set(state_dict)
    if missing:
        raise KeyError(f"asked to quantise tensors that are not in the state dict: {sorted(missing)[:5]}")
    return {n: (quantize_q4(t) if n in chosen else t) for n, t in state_dict.items()}


def fake_quant_state_dict(
    state_dict: Mapping[str, torch.Tensor], names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """The QSUN decoder's weights: projections replaced by their int4 values, the rest as is."""
    chosen = set(names) if names is not None else {n for n in state_dict if is_quantised_linear(n)}
    return {n: (fake_quant_q4(t) if n in chosen else t) for n, t in state_dict.items()}


# --- export layouts ------------------------------------------------------------------------------


def to_gguf_q4_0_bytes(packed: Q4Packed) -> np.ndarray:
    """GGUF Q4_0 blocks as uint8 [out, n_blocks * 18] (GGUFWriter's raw byte shape).

    Each block: fp16 scale (little-endian), then 16 bytes where byte j holds
    value j in the low nibble and value j + 16 in the high nibble.
    """
    out, k = packed.shape
    nb = k // GROUP
    codes = _unpack(packed.codes.cpu()).reshape(out, nb, GROUP)
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [out, nb, 16]
    d = packed.scales.cpu().contiguous().numpy().astype("<f2").view(np.uint8).reshape(out, nb, 2)
    return np.ascontiguousarray(np.concatenate([d, qs.numpy()], axis=-1).reshape(out, nb * 18))


def from_gguf_q4_0_bytes(data: np.ndarray, shape: tuple[int, int]) -> Q4Packed:
    """Inverse of ``to_gguf_q4_0_bytes`` (reads a Q4_0 tensor back onto the grid)."""
    out, k = shape
    nb = k // GROUP
    blocks = np.asarray(data, dtype=np.uint8).reshape(out, nb, 18)
    scales = torch.from_numpy(blocks[..., :2].copy().view("<f2").reshape(out, nb).astype(np.float16))
    qs = torch.from_numpy(blocks[..., 2:].copy())
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, k)
    return Q4Packed(codes=_pack(codes), scales=scales, shape=(out, k))


def to_matmulnbits(packed: Q4Packed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs B, scales, zero_points of com.microsoft MatMulNBits (bits=4, block_size=32).

    The node computes ``A @ W.T`` for W [N=out, K=in], with
    B: uint8 [N, n_blocks, 16] (value 2j low nibble, 2j+1 high nibble),
    scales: float32 [N * n_blocks] (the fp16 scales, exactly, in the activation dtype),
    zero_points: uint8 [N * ceil(n_blocks / 2)], every nibble 8.
    """
    out, k = packed.shape
    nb = k // GROUP
    b = packed.codes.cpu().numpy().reshape(out, nb, GROUP // 2).copy()
    scales = packed.scales.cpu().numpy().astype(np.float32).reshape(out * nb)
    zp = np.full(out * ((nb + 1) // 2), ZERO_POINT | (ZERO_POINT << 4), dtype=np.uint8)
    return b, scales, zp
