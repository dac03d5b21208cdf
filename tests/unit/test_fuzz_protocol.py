"""Property-based fuzzing of the wire decoder (edge/wire/protocol.py + edge/wire/field_types.py).

Whatever arrives -- arbitrary bytes, an arbitrary msgpack envelope, a valid message with one
field replaced by any msgpack value, correctly signed -- `decode` either returns a message
that encodes again to the same wire value, or raises ProtocolError. Never another exception,
never a hang, never an allocation far beyond the payload (tracemalloc peak).
"""
from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from edge.wire import protocol as P
from harness.fuzz import MSGPACK_VALUES, fuzz

SECRET = bytes(range(32))
# integers at and just past every limit a field is checked against
_EDGES = sorted({d + v for v in (0, 1, P.MAX_GAMMA, P.MAX_VOCAB, P.MAX_TOP_K, P.MAX_APPEND, P.MAX_KEEP,
                                 P.MAX_KV_CHUNKS, P.MAX_NEW_TOKENS, 1 << 31, 1 << 40, P.MAX_SEQ)
                 for d in (-1, 0, 1)})
FIELD_VALUES = st.one_of(MSGPACK_VALUES, st.sampled_from(_EDGES), st.lists(st.sampled_from(_EDGES), max_size=4))
PEAK_LIMIT = 32 << 20          # a decode may copy a payload a few times, never allocate from a claim


def _q(tokens, k=3):
    return [(np.array([t] + [t + 1 + i for i in range(k - 1)], dtype=np.int64), np.full(k, 1.0 / k, np.float32))
            for t in tokens]


# one valid message of every type
_ALL = [
    P.Join(client="dev-1", model_fp="tok:abc", vocab_size=49152, sampling=P.sampling(0.8, 40, 0.95, 7), nonce="n"),
    P.Joined(client="dev-1", accepted=True, sid="s1", secret=SECRET, draft="hub",
             up=P.up_topic("dev-1", "s1", "hub"), down=P.down_topic("dev-1", "s1", "hub")),
    P.DraftRequest(sid="s1", seq=3, keep=10, append=[1, 2, 3], gamma=4),
    P.DraftResponse(sid="s1", seq=4, tokens=[5, 6, 9], q=_q([5, 6, 9])),
    P.Bye(sid="s1"),
    P.Error(sid="s1", seq=3, code=P.E_BAD_KEEP, message="keep 12 > 10"),
    P.HubStatus(hub="hub", online=True, time=1.5e9, sessions=3, services=["hub", "j1"]),
    P.DraftHello(service="j1", model_fp="tok:abc", vocab_size=49152, busy=0.5),
    P.SessionAssign(service="j1", client="dev-1", sid="s1", secret=SECRET, gamma=4),
    P.SessionRelease(service="j1", sid="s1", reason="bye"),
    P.Telemetry(client="dev-1", role="target", time=1.7e9, rss_mb=512.0, kv_used_mb=1.5, temp_c=-5.0),
    P.Probe(target="j1"),
    P.Discover(asker="hub-1"),
    P.SunRequest(client="c", rid="r1", task="maths", prompt=[1, 2], stop=[0], secret=SECRET),
    P.SunHello(worker="w", role="prefill", task="maths", fingerprint="fp", vocab_size=256, tasks=["maths", "code"]),
    P.PrefillJob(worker="w", rid="r1", client="c", secret=SECRET, task="maths", prompt=[1, 2], decoder="d"),
    P.DecodeAssign(worker="d", rid="r1", client="c", secret=SECRET, task="maths", stop=[0], prefill="w"),
    P.KVChunk(rid="r1", index=0, total=2, first_token=7, data=b"kv"),
    P.SunTokens(rid="r1", seq=1, index=0, tokens=[3], done=True, finish_reason="stop", worker="d"),
    P.AdapterAdd(worker="w", rid="a1", client="ops", task="tools", path="/srv/bundle", sha256="0" * 64, bundle=True),
    P.AdapterResult(worker="w", rid="a1", task="tools", ok=False, message="sha256 mismatch", tasks=["maths"]),
    P.VerifyRequest(sid="s1", seq=5, keep=10, append=[1], drafts=[5, 6], q=_q([5, 6]),
                    sampling=P.sampling(0.8, 40, 0.95, 7), start=True),
    P.VerifyResponse(sid="s1", seq=5, n_accepted=1, token=9, held=13, compute_us=120, batch=4),
]
SAMPLES = {m.TAG: m for m in _ALL}
TAGS = sorted(SAMPLES)


def test_every_message_type_has_a_fuzz_sample():
    """A new message type must be fuzzed too: add a valid instance of it to _ALL above."""
    assert set(P._BY_TAG) == set(SAMPLES), sorted(set(P._BY_TAG) ^ set(SAMPLES))


def _wire(msg) -> bytes:
    return P.encode(msg, SECRET)               # control messages signed too: with the ctl key


def _envelope(tag: str, sid: str, body, mac_key=SECRET, version=P.PROTOCOL_VERSION) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    mac = P._mac(mac_key, version, tag, sid, raw) if mac_key else b""
    return msgpack.packb({"v": version, "t": tag, "s": sid, "b": raw, "h": mac}, use_bin_type=True)


def _decode_or_refuse(data: bytes, secret=SECRET):
    """The property: a message that round-trips, or a ProtocolError (whose code is a known group)."""
    tracemalloc.start()
    try:
        msg = P.decode(data, secret)
    except P.ProtocolError as e:
        assert e.code in ("size", "format", "version", "auth", "invalid"), e.code
        assert str(e)
        return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK_LIMIT + 4 * len(data), f"decoding {len(data)} bytes peaked at {peak} bytes"
    key = SECRET if callable(secret) else secret
    wire = P.encode(msg, key)
    assert P.encode(P.decode(wire, secret), key) == wire
    return msg


@pytest.mark.parametrize("tag", TAGS)
def test_samples_round_trip(tag):
    msg = SAMPLES[tag]
    assert _decode_or_refuse(_wire(msg)) is not None


@fuzz(400)
@given(st.binary(max_size=256))
@example(b"\xdd\xff\xff\xff\xff")              # array32 claiming 4 G elements in 5 bytes
@example(b"\xdf\xff\xff\xff\xff")              # map32 claiming 4 G entries
@example(b"\xc6\xff\xff\xff\xff")              # bin32 claiming 4 GiB
@example(b"\x91" * 5000)                       # nesting deeper than any unpacker stack
def test_arbitrary_bytes_are_refused_or_decoded(data):
    _decode_or_refuse(data)
    _decode_or_refuse(data, secret=lambda sid: SECRET)
    _decode_or_refuse(data, secret=None)


@fuzz(150)
@given(st.dictionaries(st.sampled_from(["v", "t", "s", "b", "h", "x"]),
                       st.one_of(MSGPACK_VALUES, st.sampled_from(TAGS)), max_size=6))
@example({"v": P.PROTOCOL_VERSION, "t": "bye", "s": "s1", "b": b"\x81\xa3sid\xa2s1", "h": b""})   # unsigned session message
def test_arbitrary_envelopes_are_refused_or_decoded(env):
    _decode_or_refuse(msgpack.packb(env, use_bin_type=True))


@fuzz(300)
@given(st.sampled_from(TAGS), st.data())
def test_one_mutated_field_signed_correctly(tag, data):
    msg = SAMPLES[tag]
    body = msgpack.unpackb(msgpack.unpackb(_wire(msg))["b"], raw=False)
    name = data.draw(st.sampled_from(sorted(body)), label="field")
    body[name] = data.draw(FIELD_VALUES, label="value")
    sid = msg.session_id()
    if P._BY_TAG[tag].SESSION and isinstance(body.get(P._BY_TAG[tag].ID_FIELD), str):
        sid = body[P._BY_TAG[tag].ID_FIELD]    # keep the envelope consistent so the field checks run
    try:
        wire = _envelope(tag, sid if isinstance(sid, str) else "s1", body)
    except (TypeError, ValueError, OverflowError):
        return                                 # not representable in msgpack: cannot arrive
    _decode_or_refuse(wire)


@fuzz(120)
@given(st.sampled_from(TAGS), st.dictionaries(st.one_of(st.text(max_size=10), st.binary(max_size=6)),
                                              MSGPACK_VALUES, max_size=4))
@example("bye", {b"sid": "s1"})                # bytes keys
@example("bye", {"sid": "s1", b"x": 1})        # str and bytes keys mixed (sorting them failed: TypeError)
def test_extra_or_missing_fields_signed_correctly(tag, extra):
    body = msgpack.unpackb(msgpack.unpackb(_wire(SAMPLES[tag]))["b"], raw=False)
    for k in list(body)[: len(extra) % (len(body) + 1)]:
        del body[k]
    body.update(extra)
    sid = SAMPLES[tag].session_id() or ""
    _decode_or_refuse(_envelope(tag, sid, body))


@fuzz(200)
@given(st.sampled_from(TAGS), st.integers(0, 10_000), st.integers(0, 255))
def test_flipped_bytes_of_valid_messages(tag, pos, value):
    wire = bytearray(_wire(SAMPLES[tag]))
    wire[pos % len(wire)] = value
    _decode_or_refuse(bytes(wire))
    _decode_or_refuse(bytes(wire[: pos % len(wire)]))      # and cut short


@fuzz(200)
@given(st.lists(st.tuples(st.integers(-2, P.MAX_VOCAB + 2), st.floats(allow_nan=True, allow_infinity=True)),
                min_size=0, max_size=8), st.sampled_from(["<i4", "<i8", "<u8", ">i8"]),
       st.sampled_from(["<f4", "<f8", "<f2"]), st.lists(st.integers(-1, 5), max_size=4))
def test_draft_response_q_arrays(entries, idt, pdt, lens):
    """q's three arrays with any dtypes, values and lengths: checked, never trusted."""
    idx = np.array([e[0] for e in entries], dtype=np.int64).astype(np.dtype(idt), copy=False) \
        if idt != "<u8" else np.array([max(0, e[0]) for e in entries], dtype="<u8")
    with np.errstate(over="ignore"):           # float64 -> float16 overflows to inf: fine, it is refused
        pr = np.array([e[1] for e in entries], dtype=np.float64).astype(np.dtype(pdt))
    ln = np.array(lens, dtype=np.int64)
    body = {"sid": "s1", "seq": 1, "tokens": [max(0, e[0]) % P.MAX_VOCAB for e in entries][: len(lens)],
            "q": [[idx.dtype.str, [idx.size], idx.tobytes()], [pr.dtype.str, [pr.size], pr.tobytes()],
                  ["<i8", [ln.size], ln.tobytes()]], "compute_us": 0}
    _decode_or_refuse(_envelope("draft_resp", "s1", body))
