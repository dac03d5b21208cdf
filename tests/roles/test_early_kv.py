"""The decoder's early-KV hold, per sender (edge/sun/early_kv.py): quotas, strangers, claims."""
from __future__ import annotations

from edge.sun.early_kv import MAX_STRANGERS, EarlyKV


def test_each_sender_fills_only_its_own_quota():
    hold = EarlyKV(quota_bytes=100, total_bytes=1000)
    assert all(hold.hold("evil", f"r{i}", b"x" * 10, 0.0) for i in range(10))
    assert not hold.hold("evil", "r-more", b"x", 0.0)               # its quota is full
    assert hold.hold("prefill-a", "r-real", b"k" * 100, 0.0)          # another sender's is not
    assert hold.get("r-real") == [b"k" * 100] and len(hold) == 11


def test_strangers_are_limited_in_number_but_a_vouched_sender_always_gets_a_quota():
    hold = EarlyKV(quota_bytes=10, total_bytes=1000)
    for i in range(MAX_STRANGERS):
        assert hold.hold(f"evil{i}", "r", b"x", 0.0)
    assert not hold.hold("another", "r", b"x", 0.0)                   # too many strangers hold KV
    hold.vouch("prefill-a")                                           # the router named it
    assert hold.hold("prefill-a", "r-real", b"k", 0.0)


def test_the_total_bounds_every_sender_together():
    hold = EarlyKV(quota_bytes=10, total_bytes=25)
    assert hold.hold("a", "r1", b"x" * 10, 0.0) and hold.hold("b", "r2", b"x" * 10, 0.0)
    assert not hold.hold("c", "r3", b"x" * 10, 0.0) and hold.nbytes == 20


def test_an_assignment_claims_only_its_prefill_workers_kv():
    hold = EarlyKV(quota_bytes=100, total_bytes=1000)
    hold.hold("evil", "r-real", b"forged", 0.0)
    hold.hold("prefill-a", "r-real", b"k0", 0.0)
    hold.hold("prefill-a", "r-real", b"k1", 0.0)
    hold.hold("prefill-a", "r-other", b"o", 0.0)
    assert hold.claim("r-real", "prefill-a") == ([b"k0", b"k1"], 1)
    assert "r-real" not in hold and hold.get("r-other") == [b"o"] and hold.nbytes == 1


def test_unclaimed_kv_expires_and_frees_its_quota():
    hold = EarlyKV(quota_bytes=10, total_bytes=100)
    assert hold.hold("evil", "r1", b"x" * 10, 0.0)
    assert hold.hold("prefill-a", "r2", b"k", 5.0)
    assert hold.expire(now=8.0, timeout=5.0) == 1 and "r1" not in hold and "r2" in hold
    assert hold.hold("evil", "r3", b"x" * 10, 8.0) and hold.nbytes == 11
