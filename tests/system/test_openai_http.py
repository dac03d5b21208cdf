"""The OpenAI-compatible endpoint of a StarSD target (tiny model, byte-level tokenizer)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from edge.engines.torch_engine import TorchEngine
from edge.spec.generate import generate_plain
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.model.transformer import Transformer, tiny_config
from edge.api.openai_http import OpenAIServer, StopText
from edge.star.session import HubClient
from edge.star.target import StarTarget
from edge.spec.sampling import SamplingParams
from edge.model.tokenizer import Tokenizer
from server.hub import Hub

torch.set_num_threads(1)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens, no merges: every string encodes, ids fit the tiny model."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf, chat_template=TEMPLATE, vocab_size=256)


def tiny_engine(seed=0):
    torch.manual_seed(seed)
    model = Transformer(tiny_config("llama")).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return TorchEngine(model, fingerprint=f"tiny-{seed}")


@pytest.fixture(scope="module")
def endpoint():
    bus = MemoryBus()
    tok = byte_tokenizer()
    fp = tok.fingerprint()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=tiny_engine(1), tokenizer_fp=fp).start()
    star = StarTarget(tiny_engine(0), HubClient(MemoryLink(bus, "dev"), "dev", fp, 256), gamma=3)
    server = OpenAIServer(star.generate, tok, "tiny", port=0, context=512).start()
    yield server, star, tok
    server.stop()
    hub.stop()


def post(server, path, body, raw=False):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode() if raw else json.loads(r.read())


def test_completion_is_the_targets_greedy_text(endpoint):
    server, star, tok = endpoint
    out = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0})
    ids = tok.encode("hello", add_special=True)
    want = generate_plain(star.engine, ids, 12, SamplingParams(), tuple(tok.eos_ids)).tokens
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == tok.decode(want)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    assert star.last_drafter.stats["answered"] > 0


def test_chat_stream_equals_the_non_streamed_answer(endpoint):
    server, _, _ = endpoint
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}
    whole = post(server, "/v1/chat/completions", body)
    text = whole["choices"][0]["message"]["content"]
    events = post(server, "/v1/chat/completions", {**body, "stream": True}, raw=True).split("\n\n")
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_bad_requests_get_clear_400s(endpoint):
    server, _, _ = endpoint
    for path, body, msg in (("/v1/completions", {"prompt": 5}, "prompt"),
                            ("/v1/chat/completions", {"messages": []}, "messages"),
                            ("/v1/completions", {"prompt": "x", "temperature": 9}, "temperature"),
                            ("/v1/completions", {"prompt": "x", "n": 2}, "n=1")):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(server, path, body)
        assert e.value.code == 400 and msg in json.loads(e.value.read())["error"]["message"]
    models_ = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models").read())
    assert models_["data"][0]["id"] == "tiny"


def test_stop_text_cuts_and_holds_back_partial_matches():
    cut = StopText(["END"])
    assert cut.feed("abc E") == "abc "          # "E" may start END: held back
    assert cut.feed("N") == ""
    assert cut.feed("D tail") == "" and cut.hit and cut.text == "abc E"[:4]
    plain = StopText(["xyz"])
    assert plain.feed("hello x") + plain.feed("q") + plain.flush() == "hello xq"
