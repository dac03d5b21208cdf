"""A draft service core on a tiny exact model, and the steps its tests take.

`make_engine` is a tiny float64 llama (greedy texts compare token for token); `service` a
DraftService core on it (no node, no broker); `step` runs one core step and files its replies
by session as the node would send them; `contexts` random prompts; `reference` what a fresh
model draft proposes for a context. Shared by tests/roles/test_draft_service.py and the
draft tests beside it (confidence, joining, batch coalescing, node order).
"""
import numpy as np
import torch

from edge.engines.torch_engine import TorchEngine
from edge.model.transformer import Transformer, tiny_config
from edge.speculative.generate import ModelDrafter
from edge.star.draft_service import DraftLimits, DraftService


def make_engine(seed=0, cls=TorchEngine):
    """A tiny float64 model: outputs are exact, so greedy texts compare token for token."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config("llama")).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return cls(model, fingerprint=f"tiny-{seed}")


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def service(limits=None, seed=0, clock=None, engine=None):
    svc = DraftService(engine or make_engine(seed=seed), limits or DraftLimits(ahead=False),
                       **({"clock": clock} if clock else {}))
    return svc, {}


def step(svc, out):
    """One step of the core, its replies filed by session as the node would send them; how many."""
    replies = svc.step()
    for sid, m in replies:
        out.setdefault(sid, []).append(m)
    return len(replies)


def contexts(n, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


def reference(ctx, gamma, seed=0):
    return ModelDrafter(make_engine(seed=seed)).draft(ctx, gamma, np.random.default_rng(0))[0]
