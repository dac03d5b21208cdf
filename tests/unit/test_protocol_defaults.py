"""Every wire message built with its defaults is a valid message: only the fields without a
default are given (a value per field name below), the rest are left as declared, and it must
encode, decode and come back equal. A default that fails the field's own check (say "" for an
id) would make a message that its sender cannot send."""
from __future__ import annotations

from dataclasses import MISSING, fields

import pytest

import edge.wire.protocol as P

SECRET = bytes(range(32))

# a valid value for every field that has no default (role-dependent fields pick the simplest case)
REQUIRED = {
    "client": "dev-1", "model_fp": "tok:abc", "vocab_size": 256, "accepted": False, "sid": "s1",
    "seq": 1, "keep": 0, "append": [1, 2], "gamma": 2, "tokens": [3], "code": P.E_BAD_REQUEST,
    "hub": "hub", "online": True, "service": "svc", "secret": SECRET, "target": "svc", "asker": "hub", "time": 1.0,
    "rid": "r1", "task": "maths", "prompt": [1, 2], "worker": "w1", "fingerprint": "fp:1",
    "decoder": "dec-1", "prefill": "prefill-maths", "index": 0, "total": 1, "first_token": 0,
    "data": b"kv", "ok": True, "path": "/srv/adapters/tools", "sha256": "ab" * 32,
    "n_accepted": 0, "token": 3, "held": 3,
}
ROLE = {"telemetry": "target", "sun_hello": "decoder"}      # a decoder names no task
TASK = {"sun_hello": ""}


def _required(cls) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


def _build(cls):
    kw = {}
    for name in _required(cls):
        if name == "role":
            kw[name] = ROLE[cls.TAG]
        elif name == "task" and cls.TAG in TASK:
            kw[name] = TASK[cls.TAG]
        else:
            assert name in REQUIRED, f"{cls.__name__}.{name} has no default: add a valid value to REQUIRED"
            kw[name] = REQUIRED[name]
    return cls(**kw)


@pytest.mark.parametrize("tag", sorted(P._BY_TAG))
def test_a_message_built_with_its_defaults_round_trips(tag):
    cls = P._BY_TAG[tag]
    msg = _build(cls)
    key = SECRET if cls.SESSION else None
    back = P.decode(P.encode(msg, key), key)
    assert back == msg


def test_the_routing_fields_have_no_default():
    """Where the KV goes (PrefillJob.decoder) and who sends it (DecodeAssign.prefill) have no
    sensible default: a message without them is refused when built, not when sent."""
    for cls, name in ((P.PrefillJob, "decoder"), (P.DecodeAssign, "prefill")):
        assert name in _required(cls)
        kw = {n: REQUIRED[n] for n in _required(cls) if n != name}
        with pytest.raises(TypeError, match=name):
            cls(**kw)


def test_a_sun_request_draws_its_own_secret():
    a = P.SunRequest(client="c", rid="r1", task="maths", prompt=[1])
    b = P.SunRequest(client="c", rid="r1", task="maths", prompt=[1])
    assert len(a.secret) == 32 and a.secret != b.secret
    assert P.decode(P.encode(a)) == a
