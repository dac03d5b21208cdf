"""One client cannot take every draft slot: a greedy client that joins until it is refused
still leaves room for another client (Registry.client_share of the fitting services' slots)."""
from __future__ import annotations

import pytest

from edge.wire.protocol import DraftHello, Join
from server.liveness import Liveness
from server.registry import Refusal, Registry

TOK = "tok:abc"


def _registry(share=None, slots=(8,)) -> Registry:
    reg = Registry(liveness=Liveness(), **({} if share is None else {"client_share": share}))
    for i, n in enumerate(slots):                 # local services: alive without a probe
        reg.update_service(DraftHello(f"svc{i}", TOK, 256, max_sessions=n), local=object())
    return reg


def _greedy(reg: Registry, client: str) -> tuple[int, str]:
    """Join until refused: (sessions got, the refusal's reason)."""
    got = 0
    while True:
        try:
            reg.admit(Join(client, TOK, 256))
        except Refusal as r:
            return got, r.reason
        got += 1
        assert got <= 1000


def test_a_greedy_client_leaves_room_for_another():
    reg = _registry()
    got, reason = _greedy(reg, "greedy")
    assert got == 4                                            # half the 8 slots by default
    assert "the most one client may hold" in reason and "50%" in reason and "8 draft slots" in reason
    svc, _, _ = reg.admit(Join("victim", TOK, 256))            # the victim still gets a draft
    assert svc.name == "svc0"


def test_the_share_counts_every_fitting_service_and_is_configurable():
    reg = _registry(share=0.25, slots=(8, 8))
    assert _greedy(reg, "greedy")[0] == 4                      # 25% of 16
    assert _greedy(reg, "other")[0] == 4
    assert _greedy(_registry(share=1.0), "all")[0] == 8       # share 1: one client may take all
    assert _greedy(_registry(slots=(1,)), "one")[0] == 1       # never below one session
    with pytest.raises(ValueError):
        Registry(client_share=0.0)


def test_the_hub_passes_its_share_to_the_registry():
    from server.hub import Hub
    assert Hub(client_share=0.3).registry.client_share == 0.3
    assert Hub().registry.client_share == 0.5
