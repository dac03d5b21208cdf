"""Live HTTP endpoints on a memory bus for the API tests: a device's OpenAI endpoint in front of a
StarSD target, and the hub's SUN endpoint with a prefill worker per task (tiny float64 models:
answers compare exactly). Used by tests/system/test_openai_http.py, test_sun_http.py and
test_fuzz_http.py.
"""
from __future__ import annotations

import json
import urllib.request

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from edge.api.openai_http import OpenAIServer
from edge.engines.torch_engine import TorchEngine
from edge.model.sun_modules import weights_fingerprint
from edge.model.tokenizer import Tokenizer
from edge.model.transformer import Transformer, tiny_config
from edge.star.hub_client import HubClient
from edge.star.target import StarTarget
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.sun.prefill_node import PrefillNode
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.wire.protocol import sun_hello_topic
from harness.sun_star import KEY
from harness.tiny_models import random_model, specialist
from harness.waiting import wait_until
from server.hub import Hub
from server.sun_http import start_sun_http

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens, no merges: every string encodes, ids fit the tiny model."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf, chat_template=TEMPLATE, vocab_size=256)


def tiny_engine(seed=0):
    """A tiny float64 llama on the torch engine."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config("llama")).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return TorchEngine(model, fingerprint=f"tiny-{seed}")


def openai_endpoint(prompt_cache: int = 0, draft_engine=None, parallel: int = 1, queue: int = 16):
    """A StarSD target (tiny model) behind the OpenAI endpoint, its draft from a hub on a memory bus:
    yields (server, target, tokenizer) and stops both after. prompt_cache: the target's slots
    (edge/speculative/prefix_cache.py; 0: none); parallel, queue: requests at once and waiting
    (edge/api/admission.py; the engine shared through edge/engines/batched_calls.py)."""
    from edge.engines.batched_calls import shared_engine
    from edge.speculative.prefix_cache import PrefixCache
    bus = MemoryBus()
    tok = byte_tokenizer()
    fp = tok.fingerprint()
    hub = Hub(link=MemoryLink(bus, "hub"), draft_engine=draft_engine or tiny_engine(1), tokenizer_fp=fp).start()
    engine = shared_engine(tiny_engine(0), parallel)
    star = StarTarget(engine, HubClient(MemoryLink(bus, "dev"), "dev", fp, 256), gamma=3,
                      prefix_cache=PrefixCache(engine, prompt_cache) if prompt_cache else None)
    server = OpenAIServer(star.generate, tok, "tiny", port=0, context=512, parallel=parallel, queue=queue).start()
    yield server, star, tok
    server.stop()
    hub.stop()


def post(server, path, body, raw=False):
    """POST `body` as JSON to the server; its JSON answer (raw: the text)."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode() if raw else json.loads(r.read())


def sun_http_endpoint(tasks):
    """The hub's SUN endpoint on a memory bus, a prefill worker per task: yields (server, tokenizer,
    base model, specialists by task) and stops everything after."""
    base = random_model()
    fp = weights_fingerprint(base)
    specs = {t: specialist(base, 20 + i) for i, t in enumerate(tasks)}
    bus, tok = MemoryBus(), byte_tokenizer()
    hub = Hub(link=MemoryLink(bus), hub_id="hub", ctl_key=KEY,
              sun_decoder=SharedDecoder(TorchEngine(base, fingerprint=fp), name="hub-decoder")).start()
    nodes = []
    for t in tasks:
        link = MemoryLink(bus)
        node = PrefillNode(PrefillWorker(TorchEngine(specs[t], fingerprint=fp), t, kv_dtype="float64"), link,
                           f"prefill-{t}", KEY)
        link.set_will(sun_hello_topic(f"prefill-{t}"), node.will())
        link.connect()
        nodes.append(node.start())
    assert wait_until(lambda: hub.router.tasks() == sorted(tasks))
    server = start_sun_http(hub, tok, port=0)
    yield server, tok, base, specs
    server.stop()
    for n in nodes:
        n.stop()
        n.link.close()
    hub.stop()
