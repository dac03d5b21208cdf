"""The reverse star through a real Mosquitto (#46): one hub runs BOTH directions -- a draft service
for a StarSD target and a verify service for drafting devices -- and a drafting device's OpenAI
endpoint serves the target's output (tiny float64 models: greedy answers compare exactly). Its
drafts and the hub's verdicts travel signed on the session's topics; a forged verdict is dropped;
when the hub is gone the endpoint answers 503 with the reason, never draft-only text.
"""
from __future__ import annotations

import json
import threading
import urllib.error

import pytest
import torch

from edge.cli.drafter_role import DRAFTER, endpoint_generate
from edge.api.openai_http import OpenAIServer
from edge.speculative.generate import generate_plain
from edge.speculative.sampling import SamplingParams
from edge.star.drafting_device import DraftingDevice
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.wire.link import MqttLink
from edge.wire.protocol import VerifyResponse, down_topic, encode
from server.hub import Hub
from server.mosquitto import MosquittoBroker

from edge.engines.torch_engine import TorchEngine
from harness.http_endpoints import byte_tokenizer, post, tiny_engine
from harness.tiny_models import tiny_model
from harness.waiting import wait_until

torch.set_num_threads(1)


def near_draft():
    """A draft close to tiny_engine(0)'s model (acceptance well above zero)."""
    return TorchEngine(tiny_model(1, noise=0.05, base=tiny_model(0)), fingerprint="draft")


@pytest.fixture
def star():
    """A Mosquitto of its own, a hub with both services, a drafting device behind its endpoint."""
    broker = MosquittoBroker().start()
    tok = byte_tokenizer()
    fp = tok.fingerprint()
    hub = Hub(broker_url=broker.url, draft_engine=near_draft(), verify_engine=tiny_engine(0),
              tokenizer_fp=fp, status_every=0.5).start()
    link = MqttLink(broker.url, client_id="pi").connect(5)
    device = DraftingDevice(near_draft(), HubClient(link, "pi", fp, 256, role="drafter"), gamma=3,
                            join_timeout=3.0, answer_timeout=3.0, resend_after=0.5)
    server = OpenAIServer(endpoint_generate(device), tok, "tiny", port=0, context=512, profile=DRAFTER).start()
    yield broker, hub, device, server, tok
    server.stop()
    device.close()
    link.close()
    hub.stop()
    broker.close()


def test_both_directions_on_one_hub_serve_the_targets_text(star):
    broker, hub, device, server, tok = star
    target = StarTarget(tiny_engine(0), HubClient(MqttLink(broker.url, client_id="jetson").connect(5), "jetson",
                                                   tok.fingerprint(), 256), gamma=3)
    ids = tok.encode("hello", add_special=True)
    want = generate_plain(tiny_engine(0), ids, 16, SamplingParams(), tuple(tok.eos_ids)).tokens
    out, errors = {}, []

    def starsd():
        try:
            out["starsd"] = target.generate(ids, 16, stop_ids=tuple(tok.eos_ids)).tokens
        except Exception as e:  # surfaced below
            errors.append(e)
    t = threading.Thread(target=starsd)
    t.start()
    got = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 16, "temperature": 0})
    t.join(60)
    try:
        assert not errors, errors
        stream = tok.decode_stream(skip_special=True)                 # the text as the endpoint streams it
        assert got["choices"][0]["text"] == "".join(stream.put(t) for t in want)   # the target's text
        assert out["starsd"] == want                                  # the StarSD target beside it: its own
        snap = hub.snapshot()
        assert snap["verify"]["requests"] > 0 and snap["verify"]["acceptance"] > 0
        assert snap["draft"]["requests"] > 0                          # the draft service drafted for the target
        assert snap["verify"]["registry"]["sessions"] == 1          # the drafter keeps its session for the next
    finally:
        target.hub.close()
        target.hub.link.close()


def test_a_forged_verdict_is_dropped(star):
    """A verdict signed with the wrong key never reaches the generation: the text is still the target's."""
    broker, hub, device, server, tok = star
    ids = tok.encode("hi", add_special=True)
    spy = MqttLink(broker.url, client_id="mallory").connect(5)
    forged = []

    def forge(t):
        s = next(iter(device.hub.sessions.values()))
        if not forged:
            spy.publish(down_topic("pi", s.sid, s.draft), encode(VerifyResponse(s.sid, 10**6, 0, 7, 10**5), b"x" * 32),
                        kind="draft")
            forged.append(s.sid)
    try:
        r = device.generate(ids, 12, on_token=forge)
        assert r.tokens == generate_plain(tiny_engine(0), ids, 12).tokens
        assert wait_until(lambda: device.hub.keys.dropped.get("auth", 0) >= 1), device.hub.keys.dropped
    finally:
        spy.close()


def test_no_hub_is_a_503_with_the_reason_and_no_text(star):
    broker, hub, device, server, tok = star
    hub.kill()
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 8, "temperature": 0})
    body = json.loads(e.value.read())
    assert e.value.code == 503 and e.value.headers["Retry-After"]
    assert "hub cannot serve the target's output" in body["error"]["message"]
    assert "choices" not in body


def test_fields_the_hub_cannot_honour_are_400s(star):
    _, _, _, server, _ = star
    for body, param in (({"prompt": "x", "logit_bias": {"5": 3}}, "logit_bias"),
                        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty")):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, "/v1/completions", body)
        assert e.value.code == 400 and "drafting device" in json.loads(e.value.read())["error"]["message"]
