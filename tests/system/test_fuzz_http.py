"""Property-based fuzzing of the HTTP APIs: a device's OpenAI endpoint (edge/api/openai_http.py, in
front of a real StarSD target) and the hub's SUN endpoint (server/sun_http.py), each live on a
port. Hypothesis writes the bodies (any JSON, plausible requests with hostile values, raw
bytes, lying Content-Length headers). Every answer is a 200 or a 4xx whose JSON names what
is wrong -- never a 500, never a dropped connection, never a hang -- and the server still
answers afterwards.
"""
from __future__ import annotations

import http.client
import json
import socket

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from harness.fuzz import JSON_VALUES, fuzz
from harness.http_endpoints import openai_endpoint, sun_http_endpoint

TIMEOUT = 20.0
CAP = 6                                      # max_tokens cap: a valid request stays a short generation

_edges = st.sampled_from([None, True, False, 0, 1, -1, 2, 2**31, 2**63, 2**64, -2**63, 1e308, -1e-9, 0.5,
                          "", "0", "1", [], {}, [0], [-1], [2**40], [256], [255], ["a"], [True], [[1]]])
VALUES = st.one_of(JSON_VALUES, _edges)
MESSAGES = st.one_of(VALUES, st.lists(st.one_of(VALUES, st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), VALUES),
     "content": st.one_of(st.text(max_size=30), VALUES)})), max_size=3))
KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
        "stop", "stream", "n", "model"]


@st.composite
def bodies(draw, chat: bool, models):
    """A valid request with 0-2 of its fields (or new ones) replaced by hostile values -- or, now
    and then, any JSON value at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON_VALUES)
    body = {"model": draw(models), "max_tokens": draw(st.integers(1, CAP)),
            "temperature": draw(st.sampled_from([0, 0.0, 0.7])), "stream": draw(st.booleans())}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=12))}]
    else:
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 255), min_size=1,
                                                                                   max_size=5)))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(KEYS))
        body[key] = draw(MESSAGES if key == "messages" else VALUES)
    return body


def request(port, method, path, body: bytes = b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace"), r.getheader("Content-Type", "")
    finally:
        conn.close()


def check_answer(port, path, raw: bytes, headers=None):
    status, text, ctype = request(port, "POST", path, raw, headers)
    assert status == 200 or 400 <= status < 500, (status, text[:300])
    if status != 200:
        err = json.loads(text)["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
    elif "event-stream" in ctype:
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and all('"error"' not in e for e in events), text[-300:]
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
    return status


def still_serving(port):
    assert request(port, "GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def endpoint():
    """A StarSD target behind the OpenAI endpoint."""
    yield from openai_endpoint()


@pytest.fixture(scope="module")
def sun_endpoint():
    """The hub's SUN endpoint (tasks maths and code, as tests/system/test_sun_http.py's)."""
    yield from sun_http_endpoint(("maths", "code"))


@pytest.fixture(scope="module")
def star_port(endpoint):
    server = endpoint[0]
    server.max_tokens_cap = CAP
    return server.port


@pytest.fixture(scope="module")
def sun_port(sun_endpoint):
    server = sun_endpoint[0]
    server.max_tokens_cap = CAP
    server.context = 64
    return server.port


@fuzz(80)
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.data())
@example("/v1/completions", {"prompt": [300], "max_tokens": 2})      # a token id past the vocabulary (was 500)
@example("/v1/completions", {"prompt": [-1], "max_tokens": 2})       # a negative token id (was 500)
@example("/v1/completions", {"prompt": "a", "seed": 2**64, "temperature": 1})   # a seed no RNG takes (was 500)
@example("/v1/completions", {"prompt": "a", "seed": True})
def test_star_endpoint_bodies(star_port, path, data):
    body = data if isinstance(data, dict) else data.draw(bodies(path.endswith("chat/completions"), st.just("tiny")))
    check_answer(star_port, path, json.dumps(body).encode())


@fuzz(60)
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.data())
@example("/v1/completions", {"model": "maths", "prompt": [300], "max_tokens": 2})
@example("/v1/completions", {"model": "maths", "prompt": "a", "seed": 2**64, "temperature": 1})
@example("/v1/completions", {"model": ["maths"], "prompt": "a"})      # an unhashable model name
def test_sun_endpoint_bodies(sun_port, path, data):
    tasks = st.sampled_from(["maths", "code"])
    body = data if isinstance(data, dict) else data.draw(bodies(path.endswith("chat/completions"), tasks))
    check_answer(sun_port, path, json.dumps(body).encode())
    still_serving(sun_port)


@fuzz(60)
@given(st.binary(max_size=120))
@example(b"[" * 100_000)                     # nested past the recursion limit (connection dropped: no answer)
@example(b"\xff\xfe{}")                      # not UTF-8
@example(b'{"prompt": NaN}')
def test_raw_bodies(star_port, raw):
    check_answer(star_port, "/v1/completions", raw)


@pytest.mark.parametrize("length", ["-1", "-100", "abc", "1e3", str(1 << 40), "99"])
def test_lying_content_length(star_port, length):
    """A negative length read the socket until the client gave up (a hung handler per request);
    a length past the body waits for bytes that never come: the client's timeout ends it."""
    with socket.create_connection(("127.0.0.1", star_port), timeout=TIMEOUT) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n{{}}".encode())
        if length == "99":
            s.shutdown(socket.SHUT_WR)       # the client ends the body early: a clear refusal, not a hang
        head = s.recv(65536).decode("latin-1")
    status = int(head.split()[1])
    assert 400 <= status < 500, head[:200]
    still_serving(star_port)
