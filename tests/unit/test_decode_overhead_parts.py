"""benchmarks/serving/decode_overhead.py: the exclusive parts of a decode phase, from its inclusive
timers, add up to the phase (nothing counted twice, nothing lost)."""
import collections

import pytest

from benchmarks.serving.decode_overhead import PARTS, parts_of


def test_the_parts_add_up_to_the_decode_phase():
    acc = collections.Counter({"decode phase": 100.0, "engine call": 80.0, "_decode": 78.0, "llama_decode": 75.0,
                               "adjust": 1.0, "pick": 2.0, "commit": 10.0, "send": 6.0})
    parts = parts_of(acc)
    assert list(parts) == list(PARTS)
    assert parts == {"llama_decode": 75.0, "logits rows": 3.0, "engine calls": 2.0, "sampling": 3.0,
                     "commit: SSE chunk": 6.0, "commit: detok + stop": 4.0, "loop rest": 7.0}
    assert sum(parts.values()) == pytest.approx(acc["decode phase"])
