"""edge/speculative/verify_costs.py: the target's cost curve is measured on a scratch sequence that leaves no trace."""
from __future__ import annotations

from edge.engines.torch_engine import TorchEngine
from edge.speculative.verify_costs import measure_verify_costs
from harness.tiny_models import random_model


def test_the_curve_covers_every_k_and_frees_its_sequence():
    eng = TorchEngine(random_model(), fingerprint="fp")
    seq = eng.new_sequence()
    eng.forward(seq, [1, 2, 3])
    before = (eng.active_sequences, eng.tokens(seq))
    curve = measure_verify_costs(eng, ks=(1, 2, 4), repeats=2)
    assert sorted(curve) == [1, 2, 4] and all(s > 0 for s in curve.values())
    assert (eng.active_sequences, eng.tokens(seq)) == before     # a live sequence is untouched
    nxt = eng.forward(seq, [4])                                     # and still decodes as before
    ref = TorchEngine(random_model(), fingerprint="fp")
    r = ref.new_sequence()
    ref.forward(r, [1, 2, 3])
    assert (nxt == ref.forward(r, [4])).all()
