"""Property-based fuzzing of the KV blob readers (edge/model/kv_blob.py, edge/model/kv.py) and of the shared
decoder's admission, which reads blobs from the network.

Arbitrary bytes, valid blobs with one header field replaced by any JSON value, and blobs cut
or flipped anywhere: each reader returns the KV (and then the same values as the original) or
raises KVError -- never a KeyError / TypeError / numpy error from a field it trusted. The
decoder refuses with AdmissionError and keeps no state of a refused blob.
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from edge.model import kv_blob
from edge.engines.torch_engine import TorchEngine
from edge.model.kv import SequenceKV
from edge.model.kv_blob import KVError
from edge.sun.decoder import AdmissionError, SharedDecoder

from harness.fuzz import JSON_VALUES, fuzz
from harness.tiny_models import random_model

SHAPE = dict(layers=2, kv_heads=1, head_dim=4)
DATA = np.arange(2 * 2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 2, 1, 3, 4) / 7
BLOB = kv_blob.encode(DATA, "fp", dtype="float32", tokens=[1, 2, 3], meta={"first_token": 5})


def _with_header(head: dict, raw: bytes) -> bytes:
    hb = json.dumps(head).encode()
    return kv_blob.MAGIC + struct.pack("<HI", kv_blob.VERSION, len(hb)) + hb + raw


def _header_and_raw(blob=BLOB):
    h = kv_blob.read_header(blob)
    raw = blob[h.pop("_offset"):]
    return h, raw


def _read_or_refuse(blob: bytes):
    """Every reader: a value, or KVError. Returns the numpy decode when it succeeded."""
    for read in (kv_blob.read_header,
                 lambda b: kv_blob.unpack(b),
                 lambda b: kv_blob.unpack(b, fingerprint="fp", max_len=16, **SHAPE),
                 lambda b: SequenceKV.from_bytes(b, max_len=16),
                 lambda b: SequenceKV.from_bytes(b, fingerprint="fp", max_len=16, **SHAPE)):
        try:
            read(blob)
        except KVError as e:
            assert str(e)
    try:
        return kv_blob.decode(blob, max_len=16)
    except KVError:
        return None


def test_valid_blob_reads_back():
    back, head = _read_or_refuse(BLOB)
    np.testing.assert_array_equal(back, DATA)
    assert head["tokens"] == [1, 2, 3]


@fuzz(300)
@given(st.binary(max_size=200))
@example(b"SSKV\x01\x00\xff\xff\xff\xff")                       # header length 4 GiB, blob 10 bytes
@example(_with_header([], b""))                                  # a header that is not an object
@example(_with_header({"layers": 1}, b""))                       # fields missing (was a KeyError)
@example(kv_blob.MAGIC + struct.pack("<HI", 1, 4000) + b"[" * 4000)   # nested past the recursion limit
def test_arbitrary_bytes(data):
    _read_or_refuse(data)
    _read_or_refuse(kv_blob.MAGIC + struct.pack("<HI", kv_blob.VERSION, len(data)) + data)


HEADER_FIELDS = sorted(_header_and_raw()[0])


@fuzz(250)
@given(st.sampled_from(HEADER_FIELDS), st.one_of(JSON_VALUES, st.sampled_from([-1, 0, 2**24 + 1, 2**62, 2**64])))
@example("layers", 2**62)             # np.prod of the shape wrapped around in int64
@example("length", "3")               # a string compared with max_len (was a TypeError)
@example("dtype", ["float32"])        # unhashable dtype looked up in a dict (was a TypeError)
@example("fingerprint", 7)
@example("tokens", {"a": 1})
@example("meta", [1])
@example("crc32", None)
def test_one_header_field_replaced(name, value):
    h, raw = _header_and_raw()
    h[name] = value
    got = _read_or_refuse(_with_header(h, raw))
    if got is not None:                     # accepted: it must still be exactly the data that was sent
        np.testing.assert_array_equal(got[0], DATA)


@fuzz(200)
@given(st.integers(0, len(BLOB) - 1), st.integers(0, 255))
def test_flipped_and_cut_blobs(pos, value):
    b = bytearray(BLOB)
    b[pos] = value
    got = _read_or_refuse(bytes(b))
    if got is not None:                     # the checksum covers the payload; only the header can change
        np.testing.assert_array_equal(got[0], DATA)
    assert _read_or_refuse(BLOB[:pos]) is None


@fuzz(60)
@given(st.dictionaries(st.sampled_from(HEADER_FIELDS + ["extra"]), JSON_VALUES, max_size=9),
       st.binary(max_size=64))
def test_consistent_checksum_any_header(head, raw):
    """A hostile sender can always make the checksum match: the shape checks alone must hold."""
    head = {**head, "crc32": zlib.crc32(raw)}
    _read_or_refuse(_with_header(head, raw))


@pytest.fixture(scope="module")
def decoder():
    base = random_model()
    eng = TorchEngine(base, fingerprint="fp-dec")
    seq = eng.new_sequence()
    eng.forward_last(seq, [3, 4, 5])
    blob = eng.export_kv(seq, dtype="float32")
    eng.free(seq)
    return SharedDecoder(eng, max_batch=4, name="dec"), blob


@fuzz(150)
@given(st.data())
def test_decoder_admission_refuses_hostile_blobs(decoder, data):
    dec, good = decoder
    h, raw = _header_and_raw(good)
    how = data.draw(st.sampled_from(["field", "bytes", "meta"]), label="how")
    if how == "field":
        h[data.draw(st.sampled_from(sorted(h)), label="field")] = data.draw(JSON_VALUES, label="value")
        blob = _with_header(h, raw)
    elif how == "meta":
        h["meta"] = data.draw(st.dictionaries(st.sampled_from(["first_token", "request_id", "task"]),
                                              JSON_VALUES), label="meta")
        blob = _with_header(h, raw)
    else:
        blob = data.draw(st.binary(max_size=300), label="blob")
    before = (dec.load, dict(dec.results))
    try:
        rid = dec.admit(blob, max_new=2, first_token=data.draw(st.sampled_from([None, 7]), label="first"))
    except AdmissionError as e:
        assert str(e) and (dec.load, dict(dec.results)) == before
        return
    while dec.load:                          # admitted: it was a good blob; decode it out
        dec.step()
    assert rid in dec.results
    dec.results.pop(rid)
