"""A decoder's queue of KV messages is bounded in bytes (edge/sun/decoder_node.py): a flood faster
than its loop is dropped and counted as it arrives (the real KV of an assigned request still
gets in), and the bound frees as the loop catches up.
(tests/system/test_hostile_clients.py floods a live decoder through Mosquitto.)"""
from __future__ import annotations

from edge.wire import protocol as P
from edge.engines.torch_engine import TorchEngine
from edge.wire.memory_link import MemoryBus, MemoryLink
from edge.sun.decoder import SharedDecoder
from edge.sun.decoder_node import DecoderNode

from harness.tiny_models import random_model
from harness.waiting import wait_until


def test_kv_queue_is_bounded_in_bytes_and_drains():
    bus = MemoryBus()
    node = DecoderNode(SharedDecoder(TorchEngine(random_model(), fingerprint="fp"), max_batch=2),
                       MemoryLink(bus, "dec").connect(), "dec", max_pending_mb=1.0)
    chunk = P.encode(P.KVChunk("r-x", 0, 1, 1, b"k" * (200 << 10)), b"f" * 32)    # ~200 KiB, forged
    for _ in range(20):                      # the loop is not running yet: everything queues
        node._on_kv(P.sun_kv_topic("dec", "evil"), chunk)
    fits = (1 << 20) // len(chunk)
    assert node.loop.backlog() == fits and node.dropped == {"kv_backlog": 20 - fits}
    # the real KV of an assigned request still gets in: the flood cannot crowd it out
    secret = b"s" * 32
    # (the assignment still waits in the queue too: the network thread knows it as it arrives)
    node.put("ctl", P.DecodeAssign("dec", "r-real", "client", secret, "maths", prefill="prefill-maths"))
    node._on_kv(P.sun_kv_topic("dec", "prefill-maths"), P.encode(P.KVChunk("r-real", 0, 2, 1, b"k" * (200 << 10)), secret))
    assert node.loop.backlog() == fits + 2 and node.dropped == {"kv_backlog": 20 - fits}
    node.start()
    try:
        def reached():                       # the real chunk is handled last (backlog() drops to 0 before)
            p = node._pending.get("r-real")
            return p is not None and len(p.chunks) == 1
        assert wait_until(reached, timeout=10) and node.loop.backlog() == 0 and node._queued == 0
        node._on_kv(P.sun_kv_topic("dec", "evil"), chunk)                # room again
        assert node.dropped["kv_backlog"] == 20 - fits
    finally:
        node.stop()
