"""TorchEngine's device-agnostic path (device=, dtype=) run on the CPU: the same greedy output and
KV blobs as the reference paths, blobs that cross engines, and the fp32 <-> bf16 conversion a
blob goes through (values rounded to nearest even on the way to bf16, exact on the way back)."""
import copy

import numpy as np
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.kv import SequenceKV
from edge.model.transformer import Transformer, tiny_config

PROMPT = [3, 17, 42, 99, 7, 250, 11]


def tiny(seed=0):
    torch.manual_seed(seed)
    m = Transformer(tiny_config("qwen2")).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


def greedy(engine, n=12):
    s = engine.new_sequence()
    out = [int(engine.forward(s, PROMPT)[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(engine.step([s], [out[-1]])[0].argmax()))
    return s, out


@torch.inference_mode()
def greedy_by_recompute(model, n=12):
    """The reference: the whole sequence through Transformer.forward for every token (no cache)."""
    ids = list(PROMPT)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_cpu_device_path_gives_the_reference_greedy_output_and_blobs():
    m = tiny()
    placed = TorchEngine(copy.deepcopy(m), fingerprint="fp", device="cpu", dtype="float32")
    unplaced = TorchEngine(copy.deepcopy(m), fingerprint="fp")                 # as engines were made before
    functional = TorchEngine(copy.deepcopy(m), fingerprint="fp", fast=False)   # the reference path
    s1, out1 = greedy(placed)
    s0, out0 = greedy(unplaced)
    s2, out2 = greedy(functional)
    assert out1 == out0 == out2 == greedy_by_recompute(m)
    for dtype in ("float16", "float32", "bfloat16"):
        assert placed.export_kv(s1, dtype=dtype) == unplaced.export_kv(s0, dtype=dtype)
    # the functional path rounds differently in fp32, not by more
    torch.testing.assert_close(_kv(placed, s1), _kv(functional, s2), rtol=1e-5, atol=1e-5)
    assert placed.device == torch.device("cpu") and placed._seqs[s1].data.device == placed.device


def test_a_blob_crosses_engines_and_decodes_on():
    m = tiny(1)
    a = TorchEngine(copy.deepcopy(m), fingerprint="fp", device="cpu")
    b = TorchEngine(copy.deepcopy(m), fingerprint="fp")
    s, _ = greedy(a, 4)
    t = b.import_kv(a.export_kv(s, dtype="float32"))
    np.testing.assert_array_equal(a.step([s], [5]), b.step([t], [5]))
    assert b.tokens(t) == a.tokens(s)


def _kv(engine, seq):
    kv = engine._seqs[seq]
    return kv.data[:, :, :, :kv.length]


def test_fp32_bf16_round_trip_follows_the_documented_conversion():
    m = tiny(2)
    e32 = TorchEngine(copy.deepcopy(m), fingerprint="fp")
    e16 = TorchEngine(copy.deepcopy(m), fingerprint="fp", dtype="bf16")
    assert (e32.dtype, e16.dtype, e16.kv_itemsize) == (torch.float32, torch.bfloat16, 2)
    assert e16.model.inv_freq.dtype == torch.float32 and torch.equal(e16.model.inv_freq, m.inv_freq)
    s, _ = greedy(e32, 3)
    exact = _kv(e32, s).clone()
    # fp32 -> bf16: the importing engine rounds the blob's values to nearest even
    t = e16.import_kv(e32.export_kv(s, dtype="float32"))
    assert torch.equal(_kv(e16, t), exact.to(torch.bfloat16))
    assert not torch.equal(_kv(e16, t).float(), exact)          # it did round: bf16 keeps 8 bits
    # ... the same bytes as a bf16 blob made by the fp32 engine itself
    assert e16.export_kv(t, dtype="bfloat16") == e32.export_kv(s, dtype="bfloat16")
    # bf16 -> fp32: exact (every bf16 value is an fp32 value)
    back = e32.import_kv(e16.export_kv(t, dtype="bfloat16"))
    assert torch.equal(_kv(e32, back), exact.to(torch.bfloat16).float())
    assert e32.tokens(back) == e32.tokens(s)


def test_blob_import_lands_on_the_asked_device_and_dtype():
    m = tiny(3)
    e = TorchEngine(copy.deepcopy(m), fingerprint="fp")
    s, _ = greedy(e, 2)
    kv, head = SequenceKV.from_bytes(e.export_kv(s), dtype=torch.bfloat16, device="cpu")
    assert kv.data.dtype == torch.bfloat16 and kv.data.device.type == "cpu" and kv.length == head["length"]
