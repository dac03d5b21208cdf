"""A torch engine that records its batched calls: how many sequences each forward_batch served
(tests of the verify service's joining: tests/unit/test_verify_join.py, tests/roles/test_reverse_star.py)."""
from __future__ import annotations

from edge.engines.torch_engine import TorchEngine


class CountingEngine(TorchEngine):
    """Counts forward_batch calls and the sequences each served."""
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches = []

    def forward_batch(self, calls):
        self.batches.append(len(calls))
        return super().forward_batch(calls)
