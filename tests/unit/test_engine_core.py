"""Every core the engine loop drives fits edge/runtime/core.py's protocol, so the loop's contract
cannot drift from the cores unnoticed: the methods are there, callable as the loop calls them."""
import inspect

import pytest
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer, tiny_config
from edge.runtime.core import EngineCore, HeldBatchCore
from edge.star.draft_service import DraftService
from edge.star.hybrid_service import HybridDraftService
from edge.star.suffix_service import SuffixDraftService
from edge.sun.decoder import SharedDecoder
from edge.sun.prefill import PrefillWorker
from edge.star.verify_service import VerifyService

HELD = {DraftService, HybridDraftService}                     # they may hold a batch: wake_in()
CORES = [DraftService, SuffixDraftService, HybridDraftService, SharedDecoder, PrefillWorker, VerifyService]


def _protocol_methods(proto) -> list:
    return [n for n in ("has_work", "step", "wake_in") if callable(getattr(proto, n, None))]


def _binds_like(proto_fn, core_fn) -> bool:
    """The core's method accepts every call the protocol's signature allows (self, no arguments)."""
    want = inspect.signature(proto_fn)
    got = inspect.signature(core_fn)
    try:
        got.bind(*([None] * len(want.parameters)))
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.__name__)
def test_each_core_has_the_protocols_methods_with_compatible_signatures(core):
    proto = HeldBatchCore if core in HELD else EngineCore
    for name in _protocol_methods(proto):
        fn = getattr(core, name, None)
        assert callable(fn), f"{core.__name__} lacks {name}()"
        assert _binds_like(getattr(proto, name), fn), f"{core.__name__}.{name}{inspect.signature(fn)}"
    ret = inspect.signature(core.has_work).return_annotation
    assert ret in (inspect.Signature.empty, bool, "bool"), f"{core.__name__}.has_work -> {ret}"


def test_a_class_that_drifts_from_the_protocol_is_caught():
    class Drifted:
        def has_work(self, now):            # the loop calls has_work()
            return False

        def step(self):
            return []

    class Missing:
        def has_work(self):
            return False

    assert not _binds_like(EngineCore.has_work, Drifted.has_work)
    assert not isinstance(Missing(), EngineCore)


def _engine(fingerprint: str = "tiny") -> TorchEngine:
    torch.manual_seed(0)
    return TorchEngine(Transformer(tiny_config("llama")).double(), fingerprint=fingerprint)


def test_cores_built_cheaply_are_engine_cores():
    model = DraftService(_engine())
    cores = [model, SuffixDraftService(model.vocab_size), HybridDraftService(model),
             SharedDecoder(_engine()), PrefillWorker(_engine(), "task")]
    for core in cores:
        assert isinstance(core, EngineCore), type(core).__name__
        assert isinstance(core, HeldBatchCore) == (type(core) in HELD), type(core).__name__
        assert core.has_work() is False and (not isinstance(core, HeldBatchCore) or core.wake_in() is None)
