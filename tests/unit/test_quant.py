"""The int4 grid (export/quant.py) is bit-identical to GGUF Q4_0 and to ONNX MatMulNBits."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from export.quant import (
    GROUP,
    Q4Packed,
    QuantError,
    dequantize_q4,
    fake_quant_q4,
    fake_quant_state_dict,
    from_gguf_q4_0_bytes,
    is_quantised_linear,
    quantize_model_linears,
    quantize_q4,
    to_gguf_q4_0_bytes,
    to_matmulnbits,
)

Q4_0 = GGMLQuantizationType.Q4_0


def _weights():
    """Random weights at several shapes/scales plus the awkward blocks."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for shape, scale in [((8, 576), 0.02), ((3, 1536), 1.0), ((4, 96), 1e-6), ((2, 64), 1e-9), ((5, 32), 3e3)]:
        cases.append(torch.randn(shape, generator=g) * scale)
    w = torch.randn(6, 128, generator=g)
    w[0] = 0.0  # all-zero groups
    w[1, :32] = torch.tensor([1.0, -1.0] * 16)  # +max and -max tie: the first one wins
    w[2, :32] = torch.arange(-16, 16) / 2.0  # exact half-way points x/d + 8 = n + 0.5
    w[3, 32:64] = -0.0
    w[4, :32] = 7.0  # constant group
    w[5, 64:96] = torch.tensor([8.0] + [-8.0] * 31)  # the opposite extreme clips 16 -> 15
    cases.append(w)
    cases.append((torch.randn(4, 64, generator=g) * 0.05).to(torch.bfloat16))
    return cases


@pytest.mark.parametrize("w", _weights(), ids=lambda w: f"{tuple(w.shape)}-{w.dtype}")
def test_bit_identical_to_gguf_q4_0(w):
    ref = quants.quantize(w.float().numpy(), Q4_0)
    packed = quantize_q4(w)
    ours = to_gguf_q4_0_bytes(packed)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours, ref)
    deq = torch.from_numpy(quants.dequantize(ref, Q4_0))
    assert torch.equal(dequantize_q4(packed), deq)
    # the bytes read back land on the same grid
    back = from_gguf_q4_0_bytes(ref, tuple(w.shape))
    assert torch.equal(back.codes, packed.codes)
    assert torch.equal(back.scales.view(torch.int16), packed.scales.view(torch.int16))


@pytest.mark.parametrize("w", _weights(), ids=lambda w: f"{tuple(w.shape)}-{w.dtype}")
def test_fake_quant_is_dequantize_of_quantize(w):
    fq = fake_quant_q4(w)
    assert fq.dtype == w.dtype and fq.shape == w.shape
    assert torch.equal(fq.float(), dequantize_q4(quantize_q4(w)).to(w.dtype).float())


def test_pack_layout_and_round_trip():
    w = torch.randn(3, 64)
    p = quantize_q4(w)
    assert p.codes.dtype == torch.uint8 and p.codes.shape == (3, 32)
    assert p.scales.dtype == torch.float16 and p.scales.shape == (3, 2)
    codes = torch.stack([p.codes & 15, p.codes >> 4], -1).reshape(3, 64)
    assert int(codes.max()) <= 15
    # codes and scales reproduce dequantize exactly
    deq = (codes.float() - 8) * p.scales.float().repeat_interleave(GROUP, 1)
    assert torch.equal(deq, dequantize_q4(p))
    # quantising the grid's own values is a fixed point
    again = quantize_q4(dequantize_q4(p))
    assert torch.equal(dequantize_q4(again), dequantize_q4(p))


def test_error_is_what_q4_allows():
    w = torch.randn(16, 256)
    deq = dequantize_q4(quantize_q4(w))
    blocks = w.reshape(16, 8, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 8
    err = (deq.reshape(16, 8, 32) - blocks).abs()
    # half a step, except -max (code 16 clipped to 15): one step; plus fp16 rounding of d
    assert (err <= d * 1.01).all()
    assert (err <= d * 0.51).float().mean() > 0.95


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(QuantError, match="32 input values"):
        quantize_q4(torch.randn(4, 48))
    with pytest.raises(QuantError, match="2-D"):
        quantize_q4(torch.randn(64))
    with pytest.raises(QuantError, match="NaN"):
        quantize_q4(torch.full((2, 32), float("nan")))
    with pytest.raises(QuantError, match="NaN or inf"):
        quantize_q4(torch.tensor([[1.0] * 31 + [float("-inf")]]))
    with pytest.raises(QuantError, match="fp16"):
        quantize_q4(torch.full((2, 32), 1e6))


def test_our_model_dims_are_multiples_of_32():
    # in-dims of every projection: hidden and intermediate sizes
    for dim in (576, 1536, 896, 4864, 8960):  # SmolLM2-135M, Qwen2.5 0.5B, 1.5B
        assert dim % GROUP == 0


def test_which_weights_are_quantised():
    sd = {
        "model.embed_tokens.weight": torch.randn(100, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(32, 64),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(128, 64),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128),
        "model.layers.0.input_layernorm.weight": torch.randn(64),
        "model.layers.0.post_attention_layernorm.weight": torch.randn(64),
        "model.norm.weight": torch.randn(64),
        "lm_head.weight": torch.randn(100, 64),
    }
    q = quantize_model_linears(sd)
    packed = {n for n, t in q.items() if isinstance(t, Q4Packed)}
    assert packed == {n for n in sd if n.endswith("_proj.weight")}
    assert all(is_quantised_linear(n) for n in packed)
    assert q["lm_head.weight"] is sd["lm_head.weight"]
    fq = fake_quant_state_dict(sd)
    for n in sd:
        expect = dequantize_q4(q[n]) if n in packed else sd[n]
        assert torch.equal(fq[n], expect)
    with pytest.raises(KeyError):
        quantize_model_linears(sd, names=["nope.weight"])


@pytest.mark.parametrize("with_zp", [True, False])
def test_matmulnbits_computes_x_times_grid(with_zp):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    K, N = 96, 40
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g) * 0.1
    w[3] = 0.0
    p = quantize_q4(w)
    b, scales, zp = to_matmulnbits(p)
    assert b.dtype == np.uint8 and b.shape == (N, K // 32, 16)
    assert scales.dtype == np.float32 and np.array_equal(scales, p.scales.float().numpy().reshape(-1))
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["A", "B", "scales"]
    if with_zp:
        inits.append(numpy_helper.from_array(zp, "zp"))
        inputs.append("zp")
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=32
    )
    graph = helper.make_graph(
        [node], "q4", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = torch.randn(5, K, generator=g)
    y = sess.run(None, {"A": x.numpy()})[0]
    ref = (x.double() @ dequantize_q4(p).double().T).numpy()
    # float32 accumulation over K=96 terms: a few ulps of the magnitudes summed
    bound = (x.abs().double() @ dequantize_q4(p).abs().double().T).numpy() * 1e-6 + 1e-7
    assert np.all(np.abs(y - ref) <= bound)
    # a weight off the grid by one step in one place would be far outside that bound
    assert np.abs(ref - (x.double() @ w.double().T).numpy()).max() > bound.max()
