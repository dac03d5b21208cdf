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
    base = random_model(seed, vocab_size=vocab)
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
