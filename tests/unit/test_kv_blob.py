"""The numpy KV blob codec (edge/model/kv_blob.py) writes the same bytes torch's SequenceKV does,
reads them back to the same values, and refuses what it must."""
import numpy as np
import pytest
import torch

from edge.model import kv_blob
from edge.model.kv import SequenceKV
from edge.model.kv_blob import KVError


def _data(seed=0, length=7):
    rng = np.random.default_rng(seed)
    d = rng.normal(size=(3, 2, 2, length, 8)).astype(np.float32)
    d.flat[:6] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 65504.0, 1e-8, np.inf]  # bf16 ties, fp16 edge, inf
    return d


def _torch_blob(data, dtype):
    kv = SequenceKV(3, 2, 8, torch.float32, max_len=64, capacity=data.shape[3])
    kv.append(torch.from_numpy(data))
    return kv.to_bytes("fp", dtype=dtype, tokens=list(range(data.shape[3])), meta={"a": 1})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numpy_blob_is_byte_identical_to_torchs(dtype):
    d = _data()
    ours = kv_blob.encode(d, "fp", dtype=dtype, tokens=list(range(7)), meta={"a": 1})
    assert ours == _torch_blob(d, dtype)
    back, head = kv_blob.decode(ours, fingerprint="fp", layers=3, kv_heads=2, head_dim=8, max_len=64)
    ref, _ = SequenceKV.from_bytes(ours, fingerprint="fp", max_len=64)
    np.testing.assert_array_equal(back, ref.data[:, :, :, :7].numpy())
    assert head["tokens"] == list(range(7)) and head["meta"] == {"a": 1}


def test_bfloat16_keeps_nan():
    d = _data()
    d.flat[0] = np.nan
    back, _ = kv_blob.decode(kv_blob.encode(d, "fp", dtype="bfloat16"))
    assert np.isnan(back.flat[0]) and not np.isnan(back.flat[1])


def test_bad_blobs_are_refused():
    blob = kv_blob.encode(_data(), "fp")
    with pytest.raises(KVError, match="made for model"):
        kv_blob.unpack(blob, fingerprint="other")
    with pytest.raises(KVError, match="truncated or oversized"):
        kv_blob.unpack(blob[:-3])
    with pytest.raises(KVError, match="checksum"):
        kv_blob.unpack(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(KVError, match="more than the context"):
        kv_blob.unpack(blob, max_len=3)
    with pytest.raises(KVError, match="unsupported KV dtype"):
        kv_blob.encode(_data(), "fp", dtype="int8")
