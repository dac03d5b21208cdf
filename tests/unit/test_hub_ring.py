"""The assignment of clients to hubs (edge/star/hub_ring.py): rendezvous hashing over the live
hubs must be deterministic across processes, balanced, and move only the clients it must when a
hub leaves or returns; HubView must follow wills, silence and restarts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from edge.star.hub_ring import HubView, owner, parse_hub_list

HUBS = ["hub-a", "hub-b", "hub-c"]
CLIENTS = [f"dev-{i:04d}" for i in range(1000)]


def owners(hubs):
    return {c: owner(c, hubs) for c in CLIENTS}


def test_the_owner_is_the_same_in_another_process_with_another_hash_seed():
    """Every device and hub computes the owner itself: it must not depend on Python's hash()."""
    code = ("import json; from edge.star.hub_ring import owner; "
            f"print(json.dumps([owner(c, {HUBS!r}) for c in {CLIENTS[:200]!r}]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [owner(c, HUBS) for c in CLIENTS[:200]]
    assert owner("x", ["hub-a", "hub-b"]) == owner("x", ["hub-b", "hub-a"])     # order of the list is no input


def test_1000_clients_are_balanced_over_three_hubs():
    counts = Counter(owners(HUBS).values())
    assert set(counts) == set(HUBS)
    # a fair split is 333 each, binomial sd ~15: within 5 sd of it
    assert all(abs(n - 1000 / 3) <= 75 for n in counts.values()), counts


def test_a_hub_leaving_moves_only_its_own_clients_spread_over_the_others():
    before = owners(HUBS)
    after = owners(["hub-a", "hub-c"])
    moved = {c for c in CLIENTS if before[c] != after[c]}
    assert moved == {c for c in CLIENTS if before[c] == "hub-b"}
    # its clients spread over both survivors, not all onto one
    spread = Counter(after[c] for c in moved)
    assert set(spread) == {"hub-a", "hub-c"} and min(spread.values()) >= len(moved) / 4, spread


def test_a_returning_hub_takes_back_exactly_the_clients_it_had():
    with_b = owners(HUBS)
    without_b = owners(["hub-a", "hub-c"])
    back = owners(HUBS)
    assert back == with_b
    moved = {c for c in CLIENTS if without_b[c] != back[c]}
    assert moved and all(back[c] == "hub-b" for c in moved)       # nobody else moves on its return


def test_no_live_hub_owns_nobody():
    assert owner("dev-1", []) is None


def test_parse_hub_list_checks_every_id():
    assert parse_hub_list("hub-a, hub-b,") == ["hub-a", "hub-b"]
    assert parse_hub_list(["x"]) == ["x"]
    with pytest.raises(ValueError, match="hub ids separated by commas"):
        parse_hub_list("hub-a,hub/b")
    with pytest.raises(ValueError, match="named twice"):
        parse_hub_list("a,b,a")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_hub_view_follows_announcements_wills_silence_and_restarts():
    clock = Clock()
    view = HubView(["hub-a", "hub-b"], silent_after=5.0, clock=clock)
    assert view.live() == [] and view.owner("dev-1") is None
    assert view.heard("hub-a", True, 1.0) and view.heard("hub-b", True, 2.0)
    assert not view.heard("hub-a", True, 1.0)                      # the periodic one changes nothing
    assert not view.heard("hub-z", True, 3.0) and view.live() == ["hub-a", "hub-b"]   # not on the list
    client = next(c for c in CLIENTS if owner(c, ["hub-a", "hub-b"]) == "hub-a")
    assert view.owner(client) == "hub-a" and view.epoch("hub-a") == 1.0
    assert view.heard("hub-a", False, 1.0)                          # its will
    assert view.owner(client) == "hub-b" and view.epoch("hub-a") is None
    assert view.heard("hub-a", True, 9.0) and view.owner(client) == "hub-a"    # back, a new epoch
    assert view.heard("hub-a", True, 10.0) and view.deaths["restart"] == 1     # restarted unseen
    clock.t += 4.0
    view.heard("hub-b", True, 2.0)
    clock.t += 2.0                                                   # hub-a silent 6 s, hub-b 2 s
    assert view.live() == ["hub-b"] and view.sweep() == ["hub-a"] and view.sweep() == []
    assert view.owner(client) == "hub-b"
    assert view.deaths == {"will": 1, "silent": 1, "restart": 1}


def test_a_hub_without_a_draft_service_owns_nobody_while_another_can_draft():
    """A hub just back has not proven its draft services yet: its clients stay where they are
    until it has, unless no live hub can draft (then the plain owner, as if all could)."""
    view = HubView(["hub-a", "hub-b"], clock=Clock())
    client = next(c for c in CLIENTS if owner(c, ["hub-a", "hub-b"]) == "hub-a")
    view.heard("hub-a", True, 1.0, serves=False)
    view.heard("hub-b", True, 2.0, serves=True)
    assert view.owner(client) == "hub-b"
    view.heard("hub-a", True, 1.0, serves=True)
    assert view.owner(client) == "hub-a"
    view.heard("hub-a", True, 1.0, serves=False)
    view.heard("hub-b", True, 2.0, serves=False)
    assert view.owner(client) == "hub-a"
