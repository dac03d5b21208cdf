"""The SUN wire's grammar and logprobs fields (protocol 10, edge/wire/sun_messages.py): they round
trip, and what a receiver must not take is refused at decode with the field's name."""
import math

import msgpack
import pytest

from edge.wire import protocol as P

SECRET = b"s" * 32
GRAMMAR = '{"grammars": [{"lark_grammar": "start: \\"x\\""}]}'


def test_grammar_and_logprobs_travel_with_a_request():
    req = P.SunRequest("c1", "r1", "maths", [1, 2, 3], grammar=GRAMMAR, logprobs=5)
    back = P.decode(P.encode(req))
    assert (back.grammar, back.logprobs) == (GRAMMAR, 5)
    for msg in (P.PrefillJob("p", "r1", "c1", SECRET, "maths", [1], decoder="d", grammar=GRAMMAR, logprobs=0),
                P.DecodeAssign("d", "r1", "c1", SECRET, "maths", prefill="p", grammar=GRAMMAR, logprobs=0)):
        assert (P.decode(P.encode(msg)).grammar, P.decode(P.encode(msg)).logprobs) == (GRAMMAR, 0)
    assert P.decode(P.encode(P.SunRequest("c1", "r2", "maths", [1]))).logprobs is None
    assert P.decode(P.encode(P.SunHello("w", "decoder", "", "fp", 10, grammars=True))).grammars is True


def test_token_entries_round_trip():
    msg = P.SunTokens("r1", 1, 3, [7, 8], logprobs=[(-0.25, [(7, -0.25), (2, -1.5)]), (0.0, [(8, 0.0)])])
    back = P.decode(P.encode(msg, SECRET), SECRET)
    assert back.logprobs == [[-0.25, [7, 2], [-0.25, -1.5]], [0.0, [8], [0.0]]]


def _body(msg) -> dict:
    env = msgpack.unpackb(P.encode(msg, SECRET), raw=False)
    return msgpack.unpackb(env["b"], raw=False)


def _forged(body: dict) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "sun_tokens", "s": body["rid"], "b": raw,
                          "h": P._mac(SECRET, P.PROTOCOL_VERSION, "sun_tokens", body["rid"], raw)}, use_bin_type=True)


@pytest.mark.parametrize("entries, why", [
    ([[-0.1, [1], [-0.1]], [-0.2, [2], [-0.2]]], "one entry per token"),
    ([[0.5, [1], [0.5]]], "log-probability"),
    ([[math.nan, [1], [-0.1]]], "log-probability"),
    ([[-0.1, list(range(21)), [-1.0] * 21]], "at most 20 alternatives"),
    ([[-0.1, [1, 2], [-0.1]]], "at most 20 alternatives"),
    ([[-0.1, [1 << 20], [-0.1]]], "integer in"),
    ([-0.1], "must be"),
])
def test_bad_entries_are_refused_at_decode(entries, why):
    body = _body(P.SunTokens("r1", 1, 0, [1]))
    body["logprobs"] = entries
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(_forged(body), SECRET)


def test_a_grammar_over_the_cap_and_logprobs_over_20_are_refused():
    with pytest.raises(P.ProtocolError, match="over the limit"):
        P.encode(P.SunRequest("c1", "r1", "t", [1], grammar="x" * (P.MAX_GRAMMAR_BYTES + 1)))
    with pytest.raises(P.ProtocolError, match="logprobs"):
        P.encode(P.SunRequest("c1", "r1", "t", [1], logprobs=21))
