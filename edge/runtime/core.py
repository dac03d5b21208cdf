"""What the engine loop (edge/runtime/loop.py) drives: a *core*.

A core is a plain object with no thread and no I/O: the draft services (edge/star: DraftService,
SuffixDraftService, HybridDraftService), the shared decoder (edge/sun/decoder.py: SharedDecoder)
and the prefill worker (edge/sun/prefill.py: PrefillWorker). Inputs reach it through the node's
`handle` (submit, open, close: each core's own methods), in the loop's thread; the loop asks
`has_work()` and calls `step()`. tests/unit/test_engine_core.py checks that every core fits.
"""
from __future__ import annotations

from typing import Iterable, Optional, Protocol, runtime_checkable


@runtime_checkable
class EngineCore(Protocol):
    def has_work(self) -> bool:
        """Whether step() would make progress now."""

    def step(self) -> Iterable[object]:
        """One unit of work (a batch of drafts or one draft-ahead step, one batched decode step,
        one prefill); its outputs, each handed to the loop's `publish`."""


@runtime_checkable
class HeldBatchCore(EngineCore, Protocol):
    """A core that may hold a batch for more input: the loop sleeps no longer than `wake_in()`."""

    def wake_in(self) -> Optional[float]:
        """Seconds until it wants a step with no new input (a held batch falls due); None: none."""
