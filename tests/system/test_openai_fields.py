"""Every request field has a rule (edge/api/request_fields.py), checked with the official `openai` client
against a StarSD target's endpoint (tiny float64 models, drafts from a hub on a memory bus).

Honoured fields do what they say (logprobs from the target's own rows, identical to target-only
decoding; penalties identical to plain decoding with them; include_usage; max_completion_tokens);
refused and unknown fields are 400s that name the field; the docs list every field.
"""
from __future__ import annotations

import math
import pathlib

import openai
import pytest
import torch

from edge.api.request_fields import FIELDS, IGNORED, REFUSED
from edge.speculative.generate import generate_plain
from edge.speculative.sampling import SamplingParams, top_logprobs
from harness.http_endpoints import openai_endpoint

torch.set_num_threads(1)
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
HI = [{"role": "user", "content": "hi"}]
# a value that asks for something, for each refused field
ASKS = {"functions": [{"name": "f"}],
        "function_call": "auto", "echo": True, "suffix": "x",
        "best_of": 2, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
        "web_search_options": {}}


@pytest.fixture(scope="module")
def endpoint():
    yield from openai_endpoint()


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{endpoint[0].port}/v1", api_key="none", max_retries=0)


def refused(call, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value.body


def test_docs_list_every_field_and_its_rule():
    text = DOCS.read_text()
    for name, f in FIELDS.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"docs/api.md has no row (or several) for {name!r}"
        assert f.rule in rows[0], (name, f.rule, rows[0])
    assert set(ASKS) == {n for n, f in FIELDS.items() if f.rule == REFUSED}


def test_refused_and_unknown_fields_are_400s_naming_them(client):
    for name, value in ASKS.items():
        chat = "chat" in FIELDS[name].apis
        call = client.chat.completions.create if chat else client.completions.create
        base = {"messages": HI} if chat else {"prompt": "hi"}
        body = refused(call, model="tiny", max_tokens=2, extra_body={name: value}, **base)
        assert body["param"] == name and "not supported yet" in body["message"], body
    body = refused(client.chat.completions.create, model="tiny", messages=HI, extra_body={"max_token": 3})
    assert body["param"] == "max_token" and "unknown field" in body["message"]
    # a chat-only field on completions is unknown there
    body = refused(client.completions.create, model="tiny", prompt="hi", extra_body={"messages": HI})
    assert body["param"] == "messages"
    assert refused(client.completions.create, model="tiny", prompt="hi", n=2)["param"] == "n"


def test_neutral_and_ignored_values_change_nothing(client):
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0)
    same = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0, n=1, tools=[], tool_choice="none",
        response_format={"type": "text"}, frequency_penalty=0, logprobs=False, user="u1", store=False,
        metadata={"k": "v"}, extra_body={"repetition_penalty": 1.0})
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert all(FIELDS[n].rule == IGNORED for n in ("user", "store", "metadata"))


def target_only(endpoint, ids, max_new, params, top_n):
    """What the target alone gives: its tokens and, per token, its logprob and top alternatives."""
    _, star, tok = endpoint
    rows = []
    res = generate_plain(star.engine, ids, max_new, params, tuple(tok.eos_ids),
                         on_logits=lambda t, r: rows.append(top_logprobs(r, t, top_n)))
    return res.tokens, rows


def test_chat_logprobs_are_the_target_onlys(client, endpoint):
    server, star, tok = endpoint
    out = client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=5)
    assert star.last_drafter.stats.answered > 0          # tokens came through drafts
    ids = tok.encode(tok.apply_chat_template(HI))
    tokens, rows = target_only(endpoint, ids, 12, SamplingParams(), 5)
    got = out.choices[0].logprobs.content
    assert len(got) == len(tokens) == out.usage.completion_tokens == 12
    assert b"".join(bytes(e.bytes) for e in got).decode(errors="replace") == tok.decode(tokens)
    for entry, (lp, alts) in zip(got, rows):
        assert math.isclose(entry.logprob, lp, abs_tol=1e-9)
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([a for _, a in alts], abs=1e-9)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-12)   # greedy: the top one
    assert sum(math.exp(a.logprob) for a in got[0].top_logprobs) < 1.0


def test_streamed_logprobs_and_usage_equal_the_whole_answer(client):
    kw = dict(model="tiny", messages=HI, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    entries = [e for c in chunks[:-1] if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens; the logprobs to rounding: the second request may reuse the first's prompt KV
    # (prefix cache, stored once the first answer is out), a different sum order in the last digit
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content],
                                                         rel=1e-6, abs=1e-9)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    no_usage = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in no_usage)


def test_completion_logprobs_n(client, endpoint):
    _, _, tok = endpoint
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    tokens, rows = target_only(endpoint, tok.encode("hello", add_special=True), 8, SamplingParams(), 3)
    assert lp.token_logprobs == pytest.approx([r[0] for r in rows], abs=1e-9)
    assert all(1 <= len(alts) <= 3 for alts in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert refused(client.completions.create, model="tiny", prompt="x", logprobs=21)["param"] == "logprobs"
    body = refused(client.chat.completions.create, model="tiny", messages=HI, top_logprobs=3)
    assert body["param"] == "top_logprobs"


def test_sampled_logprobs_are_the_models_not_the_filtered_ones(client):
    out = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0.5, seed=3,
                                         logprobs=True, top_logprobs=4, extra_body={"top_k": 2})
    for e in out.choices[0].logprobs.content:       # top-k 2 keeps two tokens; the report shows four
        assert len(e.top_logprobs) == 4 and all(a.logprob > -math.inf for a in e.top_logprobs)


def test_penalties_and_logit_bias_are_the_plain_targets(client, endpoint):
    _, _, tok = endpoint
    ids = tok.encode("hello", add_special=True)
    base = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0).choices[0].text
    for kw, params in (({"frequency_penalty": 2.0, "presence_penalty": 0.5},
                        SamplingParams(frequency_penalty=2.0, presence_penalty=0.5)),
                       ({"extra_body": {"repetition_penalty": 3.0}}, SamplingParams(repetition_penalty=3.0))):
        got = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0, **kw)
        want = generate_plain(endpoint[1].engine, ids, 16, params, tuple(tok.eos_ids)).tokens
        assert got.choices[0].text == tok.decode(want) and got.choices[0].text != base
    biased = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                       logit_bias={"65": 100})
    assert biased.choices[0].text == tok.decode([65] * 5)
    assert refused(client.completions.create, model="tiny", prompt="x", logit_bias={"999": 1})["param"] == "logit_bias"
    assert refused(client.completions.create, model="tiny", prompt="x",
                   frequency_penalty=2.5)["param"] == "frequency_penalty"


def test_max_completion_tokens_and_stream_options_rules(client):
    out = client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    body = refused(client.chat.completions.create, model="tiny", messages=HI, max_tokens=3, max_completion_tokens=4)
    assert body["param"] == "max_completion_tokens"
    body = refused(client.chat.completions.create, model="tiny", messages=HI, stream_options={"include_usage": True})
    assert body["param"] == "stream_options"


def test_text_parts_in_messages(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert refused(client.chat.completions.create, model="tiny", messages=image)["param"] == "messages"

