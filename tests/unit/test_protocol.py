"""The wire format: round trips, HMAC, replay, strict validation of hostile input."""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from edge.wire import protocol as P
from edge.wire.replay_guard import ReplayGuard

SECRET = bytes(range(32))


def _q(tokens, k=3, dtype=np.float32):
    out = []
    for t in tokens:
        idx = np.array([t] + [t + 1 + i for i in range(k - 1)], dtype=np.int64)
        pr = np.full(k, 1.0 / k, dtype=dtype)
        out.append((idx, pr))
    return out


MESSAGES = [
    P.Join(client="dev-1", model_fp="tok:abc123", vocab_size=49152, gamma=4,
           sampling=P.sampling(0.8, 40, 0.95, 7), nonce="n1"),
    P.Joined(client="dev-1", accepted=True, sid="s1", secret=SECRET, draft="hub",
             up=P.up_topic("dev-1", "s1", "hub"), down=P.down_topic("dev-1", "s1", "hub"), nonce="n1"),
    P.Joined(client="dev-1", accepted=False, reason="tokenizer fingerprint differs"),
    P.DraftRequest(sid="s1", seq=3, keep=10, append=[1, 2, 3], gamma=4),
    P.DraftRequest(sid="s1", seq=4, keep=10, append=[4], gamma=8, p_min=0.125),     # the target's own stop
    P.DraftResponse(sid="s1", seq=3, tokens=[5, 6], q=None, compute_us=1500),
    P.DraftResponse(sid="s1", seq=4, tokens=[5, 6, 9], q=_q([5, 6, 9])),
    P.DraftResponse(sid="s1", seq=5, tokens=[], q=[]),
    P.Bye(sid="s1"),
    P.Error(sid="s1", seq=3, code=P.E_BAD_KEEP, message="keep 12 > 10 held"),
    P.HubStatus(hub="hub", online=True, time=1.5e9, sessions=3, services=["hub", "jetson-1"]),
    P.DraftHello(service="jetson-1", model_fp="tok:abc123", vocab_size=49152, busy=0.5),
    P.SessionAssign(service="jetson-1", client="dev-1", sid="s1", secret=SECRET, gamma=4),
    P.SessionRelease(service="jetson-1", sid="s1", reason="bye"),
    P.Probe(target="jetson-1"),
]


def _same(a, b):
    assert type(a) is type(b)
    for k, v in vars(a).items():
        w = getattr(b, k)
        if k == "q" and v is not None:
            assert len(v) == len(w)
            for (i1, p1), (i2, p2) in zip(v, w):
                np.testing.assert_array_equal(i1, i2)
                np.testing.assert_array_equal(p1, p2)
                assert p1.dtype == p2.dtype
        else:
            assert v == w, k


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = P.encode(msg, SECRET)
    _same(msg, P.decode(data, SECRET))
    _same(msg, P.decode(data, lambda sid: SECRET))        # a per-sid key lookup works too


def test_control_messages_travel_unsigned():
    data = P.encode(MESSAGES[0])
    _same(MESSAGES[0], P.decode(data))


def test_session_messages_need_a_secret():
    with pytest.raises(P.ProtocolError) as e:
        P.encode(P.Bye(sid="s1"))
    assert e.value.code == "auth"
    data = P.encode(P.Bye(sid="s1"), SECRET)
    for key in (None, lambda sid: None):
        with pytest.raises(P.ProtocolError, match="no secret") as e:
            P.decode(data, key)
        assert e.value.code == "auth"


def _envelope(data):
    return msgpack.unpackb(data, raw=False)


def _pack(env):
    return msgpack.packb(env, use_bin_type=True)


def test_tampering_is_rejected():
    data = P.encode(P.DraftRequest(sid="s1", seq=1, keep=0, append=[7, 8], gamma=2), SECRET)
    env = _envelope(data)
    body = msgpack.unpackb(env["b"])
    body["append"] = [7, 9]
    for bad in (dict(env, b=_pack(body)),                    # altered body
                dict(env, h=bytes(32)),                       # forged mac
                dict(env, s="s2"),                            # moved to another session
                dict(env, t="bye")):                          # relabelled
        with pytest.raises(P.ProtocolError) as e:
            P.decode(_pack(bad), SECRET)
        assert e.value.code in ("auth", "invalid")
    with pytest.raises(P.ProtocolError, match="bad HMAC"):
        P.decode(data, bytes(32))                             # wrong key
    for i in range(len(data)):                                # any single flipped byte
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        with pytest.raises(P.ProtocolError):
            P.decode(bytes(flipped), SECRET)


def test_version_mismatch():
    env = _envelope(P.encode(MESSAGES[0]))
    with pytest.raises(P.ProtocolError, match="protocol version 99") as e:
        P.decode(_pack(dict(env, v=99)))
    assert e.value.code == "version"


def test_replay_guard_drops_and_counts():
    g = ReplayGuard()
    assert g.accept("s1", 1) and g.accept("s1", 2) and g.accept("s2", 1)
    assert not g.accept("s1", 2) and not g.accept("s1", 0)
    assert g.accept("s1", 5) and not g.accept("s1", 4)
    assert g.dropped == 3 and g.dropped_by_sid == {"s1": 3}
    g.forget("s1")
    assert g.accept("s1", 0) and g.last("s1") == 0


def _signed(tag, body, sid="s1"):
    raw = _pack(body)
    return _pack({"v": P.PROTOCOL_VERSION, "t": tag, "s": sid, "b": raw,
                  "h": P._mac(SECRET, P.PROTOCOL_VERSION, tag, sid, raw)})


def _req(**kw):
    body = {"sid": "s1", "seq": 1, "keep": 0, "append": [1], "gamma": 2, "sampling": dict(P.GREEDY_WIRE),
            "background": False, "p_min": None,   # every field: each bad case is refused for its own reason
            "grammar_id": "", "grammar": "", "grammar_from": 0}
    body.update(kw)
    return _signed("draft_req", body)


def _arr(dtype, shape, raw):
    return [dtype, list(shape), raw]


def _resp(tokens=(5,), idx=None, pr=None, lens=None):
    idx = P.encode_array(np.array([5, 6], np.int64)) if idx is None else idx
    pr = P.encode_array(np.array([0.5, 0.5], np.float32)) if pr is None else pr
    lens = P.encode_array(np.array([2], np.int64)) if lens is None else lens
    return _signed("draft_resp", {"sid": "s1", "seq": 1, "tokens": list(tokens), "q": [idx, pr, lens],
                                  "compute_us": 0})


BAD = {
    "not msgpack": b"\xc1\xc1\xc1",
    "not a map": _pack([1, 2, 3]),
    "unknown type": _signed("pickle", {}),
    "missing field": _signed("draft_req", {"sid": "s1"}),
    "extra field": _req(evil=1),
    "bool as int": _req(seq=True),
    "int as bool": _req(background=1),
    "p_min of 1": _req(p_min=1.0),
    "p_min negative": _req(p_min=-0.1),
    "p_min as text": _req(p_min="0.5"),
    "float as int": _req(keep=1.0),
    "negative keep": _req(keep=-1),
    "gamma too big": _req(gamma=P.MAX_GAMMA + 1),
    "append too long": _req(append=[1] * (P.MAX_APPEND + 1)),
    "token id too big": _req(append=[P.MAX_VOCAB]),
    "token not int": _req(append=["1"]),
    "nan temperature": _req(sampling=dict(P.GREEDY_WIRE, temperature=float("nan"))),
    "top_k too big": _req(sampling=dict(P.GREEDY_WIRE, top_k=P.MAX_TOP_K + 1)),
    "top_p zero": _req(sampling=dict(P.GREEDY_WIRE, top_p=0.0)),
    "sampling extra key": _req(sampling=dict(P.GREEDY_WIRE, min_p=0.1)),
    "grammar over its cap": _req(grammar_id="0" * 16, grammar="x" * (P.MAX_GRAMMAR_BYTES + 1)),
    "grammar without its id": _req(grammar="start: /a/"),
    "grammar id not hex": _req(grammar_id="Z" * 16),
    "grammar_from past the context": _req(grammar_id="0" * 16, grammar_from=5),
    "sid mismatch": _req(sid="s2"),
    "bad sid chars": _signed("bye", {"sid": "a/b"}, sid="a/b"),
    "object dtype": _resp(idx=_arr("|O", [2], b"\0" * 16)),
    "big-endian dtype": _resp(idx=_arr(">i8", [2], b"\0" * 16)),
    "uint8 dtype": _resp(pr=_arr("|u1", [2], b"\0\0")),
    "shape/bytes mismatch": _resp(idx=_arr("<i8", [3], b"\0" * 16)),
    "2-d indices": _resp(idx=_arr("<i8", [1, 2], b"\0" * 16)),
    "lengths do not add up": _resp(lens=P.encode_array(np.array([3], np.int64))),
    "negative prob": _resp(pr=P.encode_array(np.array([1.5, -0.5], np.float32))),
    "nan prob": _resp(pr=P.encode_array(np.array([np.nan, 0.5], np.float32))),
    "probs do not sum to 1": _resp(pr=P.encode_array(np.array([0.2, 0.2], np.float32))),
    "repeated index": _resp(idx=P.encode_array(np.array([5, 5], np.int64))),
    "token outside its q": _resp(tokens=(7,)),
    "token with zero q": _resp(pr=P.encode_array(np.array([0.0, 1.0], np.float32))),
    "q length mismatch": _resp(tokens=(5, 6)),
    "too many q entries": _resp(lens=P.encode_array(np.array([P.MAX_TOP_K + 1], np.int64))),
    "joined with foreign topics": _signed("joined", {
        "client": "alice", "accepted": True, "reason": "", "sid": "s1", "secret": SECRET, "draft": "hub",
        "up": "ss/s/bob/s1/hub/up", "down": "ss/s/bob/s1/hub/down", "nonce": ""}, sid=""),
    "joined naming another service's topics": _signed("joined", {
        "client": "alice", "accepted": True, "reason": "", "sid": "s1", "secret": SECRET, "draft": "hub",
        "up": "ss/s/alice/s1/j2/up", "down": "ss/s/alice/s1/j2/down", "nonce": ""}, sid=""),
    "ext type": _pack({"v": P.PROTOCOL_VERSION, "t": "bye", "s": "", "b": msgpack.ExtType(1, b"x"), "h": b""}),
    "oversized": b"\x00" * (P.MAX_MESSAGE_BYTES + 1),
    "deep nesting": b"\x91" * 100_000 + b"\x00",
}


def test_the_base_of_the_bad_requests_is_a_good_one():
    """Each bad `_req` differs from a valid request in one field only (a field added to the wire
    and missed here would make every case fail for that reason instead of its own)."""
    assert P.decode(_req(), SECRET) == P.DraftRequest("s1", 1, 0, [1], 2, dict(P.GREEDY_WIRE))


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_is_a_protocol_error(name):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(BAD[name], SECRET)
    assert e.value.reason                                     # always says why


def test_random_mutations_never_crash():
    rng = random.Random(0)
    seeds = [P.encode(m, SECRET) for m in MESSAGES]
    for _ in range(2000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            P.decode(bytes(data), SECRET)
        except P.ProtocolError:
            pass


def test_sender_validates_too():
    with pytest.raises(P.ProtocolError, match="gamma"):
        P.encode(P.DraftRequest(sid="s1", seq=1, keep=0, append=[], gamma=99), SECRET)
    with pytest.raises(P.ProtocolError, match="sum to 1"):
        P.encode(P.DraftResponse(sid="s1", seq=1, tokens=[5],
                                 q=[(np.array([5]), np.array([0.3], np.float32))]), SECRET)
    # numpy ids are fine at the sender and arrive as ints
    msg = P.decode(P.encode(P.DraftRequest(sid="s1", seq=1, keep=0, append=np.array([3, 4]), gamma=1),
                            SECRET), SECRET)
    assert msg.append == [3, 4] and all(type(t) is int for t in msg.append)


def test_float64_probs_and_int32_indices():
    q = [(np.array([9, 2], np.int32), np.array([0.25, 0.75], np.float64))]
    msg = P.decode(P.encode(P.DraftResponse(sid="s1", seq=1, tokens=[2], q=q), SECRET), SECRET)
    assert msg.q[0][0].dtype == np.int32 and msg.q[0][1].dtype == np.float64


def test_check_vocab():
    P.check_vocab(P.DraftRequest(sid="s1", seq=1, keep=0, append=[9], gamma=1), 10)
    with pytest.raises(P.ProtocolError, match="vocabulary"):
        P.check_vocab(P.DraftRequest(sid="s1", seq=1, keep=0, append=[10], gamma=1), 10)
    with pytest.raises(P.ProtocolError, match="vocabulary"):
        P.check_vocab(P.DraftResponse(sid="s1", seq=1, tokens=[5], q=_q([5])), 6)


def test_topics():
    assert P.join_topic("dev-1") == "ss/hub/join/dev-1"
    assert P.joined_topic("dev-1") == "ss/c/dev-1/joined"
    assert P.up_topic("dev-1", "s1", "j1") == "ss/s/dev-1/s1/j1/up"
    assert P.down_topic("dev-1", "s1", "j1") == "ss/s/dev-1/s1/j1/down"
    assert P.session_up_sub("j1") == "ss/s/+/+/j1/up"
    assert P.draft_hello_topic("j1") == "ss/hub/drafts/j1"
    assert P.draft_ctl_topic("j1") == "ss/d/j1/ctl"
    assert P.parse_topic("ss/s/dev-1/s1/j1/up") == ("up", {"client": "dev-1", "sid": "s1", "service": "j1"})
    assert P.parse_topic("ss/hub/join/dev-1") == ("join", {"client": "dev-1"})
    assert P.parse_topic(P.STATUS_TOPIC) == ("status", {})
    for bad in ("", "a/b", "+", "#", "$SYS", "x" * 65, "a b"):
        with pytest.raises(P.ProtocolError):
            P.join_topic(bad)
    for bad in ("ss/s/a/b", "ss/s/a/b/up", "ss/hub/join/+", "other/topic"):
        with pytest.raises(P.ProtocolError):
            P.parse_topic(bad)


def test_sun_hello_task_list_names_its_task_and_adapter_messages_check_their_fields():
    h = P.SunHello("w", "prefill", "code", "fp", 256, tasks=["code", "maths"])
    assert P.decode(P.encode(h, SECRET), SECRET).tasks == ["code", "maths"]
    with pytest.raises(P.ProtocolError, match="names one of them"):
        P.decode(P.encode(P.SunHello("w", "prefill", "tools", "fp", 256, tasks=["code"])))
    with pytest.raises(P.ProtocolError, match="a decoder names none"):
        P.decode(P.encode(P.SunHello("d", "decoder", "", "fp", 256, tasks=["code"])))
    add = P.AdapterAdd("w", "a1", "ops", "tools", "/srv/tools", "ab" * 32)
    assert P.decode(P.encode(add, SECRET), SECRET) == add
    for bad, why in ((dict(sha256="AB" * 32), "sha256"), (dict(sha256="ab" * 31), "sha256"),
                     (dict(path=""), "path")):
        fields = {**add.__dict__, **bad}
        with pytest.raises(P.ProtocolError, match=why):
            P.decode(P.encode(P.AdapterAdd(**fields)))
