"""What the SUN grammar / logprobs tests share (tests/unit/test_sun_row_grammars.py,
tests/system/test_sun_agent_api.py): a tiny float64 SUN base over the 262-token byte-level BPE
(it has an end token, so a grammar can end), bounded JSON schemas, and the reference a
constrained split generation must equal, computed here row by row on the engines themselves."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from edge.engines.torch_engine import TorchEngine
from edge.model.sun_modules import weights_fingerprint
from edge.speculative.constrained import mask_logits
from edge.speculative.sampling import top_logprobs
from harness.tiny_models import random_model, specialist

# bounded: every answer ends well within 96 byte-level tokens
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"enum": [1, 22, 333]}}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 99},
                        "y": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}


def sun_base(vocab: int, seed: int = 0):
    """(base, its fingerprint, a specialist of it): float64, so greedy comparisons are exact."""
    base = random_model(seed, vocab_size=vocab, max_position=1024)
    return base, weights_fingerprint(base), specialist(base, seed + 7)


def reference(spec, base, prompt: List[int], grammar, max_new: int, stops, logprobs: Optional[int] = None
              ) -> Tuple[List[int], list]:
    """Greedy split generation under `grammar` (None: none), one row at a time on bare engines: the
    specialist's last row masked -> token 0, its KV into the base, then each base row masked ->
    the next token. -> (tokens, the stop token included if drawn; entries when logprobs)."""
    fp = weights_fingerprint(base)
    pre, dec = TorchEngine(spec, fingerprint=fp), TorchEngine(base, fingerprint=fp)
    matcher = grammar.matcher() if grammar is not None else None
    stops = set(stops) | (set(grammar.stop_ids) if grammar is not None else set())
    seq = pre.new_sequence()
    row = pre.forward_last(seq, prompt)[-1]
    blob = pre.export_kv(seq, dtype="float64")
    pre.free(seq)
    seq = dec.import_kv(blob)
    tokens, entries = [], []
    while True:
        if matcher is not None:
            row = mask_logits(row, matcher.allowed())
        t = int(np.argmax(row))
        tokens.append(t)
        if logprobs is not None:
            entries.append(top_logprobs(row, t, logprobs))
        if t in stops or len(tokens) >= max_new:
            return tokens, entries
        if matcher is not None:
            assert matcher.consume(t)
        row = dec.forward(seq, [t])[-1]


# Qwen2.5's way of rendering tools, small (tests/system/test_tools.py renders the same way)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


class AgentSunStar:
    """The hub (its SUN router and endpoint) and SUN workers, each on its own MQTT link to `url`:
    "json" and "tools" served by prefill workers that follow grammars, "plain" by one without a
    tokenizer; decoder "dec-g" follows grammars, "dec-n" does not (grammar requests go to dec-g)."""

    def __init__(self, url: str, tok, key: bytes):
        import os

        from edge.sun.decoder import SharedDecoder
        from edge.sun.decoder_node import DecoderNode
        from edge.sun.prefill import PrefillWorker
        from edge.sun.prefill_node import PrefillNode
        from edge.sun.token_rules import SunGrammars
        from edge.wire.link import MqttLink
        from edge.wire.protocol import sun_hello_topic
        from harness.waiting import wait_until
        from server.hub import Hub
        from server.sun_http import start_sun_http
        self.tok, pid = tok, os.getpid()
        self.base, fp, self.spec = sun_base(tok.vocab_size)
        self.grammars = SunGrammars(tok)
        self.hub = Hub(broker_url=url, hub_id=f"h45-{pid}", ctl_key=key, status_every=0.5).start()
        self.nodes, self.links = {}, []
        makers = {f"prefill-{t}": (lambda ln, n, t=t, g=g: PrefillNode(
            PrefillWorker(TorchEngine(self.spec, fingerprint=fp), t, kv_dtype="float64", grammars=g), ln, n, key))
            for t, g in (("json", self.grammars), ("tools", self.grammars), ("plain", None))}
        for name, g in (("dec-g", self.grammars), ("dec-n", None)):
            makers[name] = lambda ln, n, g=g: DecoderNode(SharedDecoder(
                TorchEngine(self.base, fingerprint=fp), max_batch=16, stop_ids=tok.eos_ids, name=n, grammars=g), ln, n, key)
        for name, make in makers.items():           # one link at a time (harness/sun_star.py says why)
            link = MqttLink(url, client_id=f"{name}-{pid}")
            node = make(link, name)
            link.set_will(sun_hello_topic(name), node.will())
            link.connect(5)
            self.links.append(link)
            self.nodes[name] = node.start()
            assert wait_until(lambda: name in self.hub.router.workers and self.hub.router.workers[name].online), name
        self.server = start_sun_http(self.hub, tok, port=0, context=1024)

    def close(self) -> None:
        self.server.stop()
        for node in self.nodes.values():
            node.stop()
        for link in self.links:
            link.close()
        self.hub.stop()
