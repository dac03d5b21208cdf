"""Moving one sequence's llama.cpp state between contexts of different stream counts
(edge/engines/llamacpp_kv.py: to_one_stream / from_one_stream, in place), on synthetic frames."""
from __future__ import annotations

import struct

import pytest

from edge.engines.llamacpp_kv import HEAD, StateError, from_one_stream, to_one_stream

TAG = struct.pack("<I", 0xAF143CD8)


def frame(n_stream: int, slot: int, block: bytes, seq: int = 0) -> bytes:
    parts = [TAG, struct.pack("<II", seq, n_stream)]
    parts += [block if s == slot else struct.pack("<I", 0) for s in range(n_stream)]
    return b"".join(parts)


BLOCK = struct.pack("<I", 3) + bytes(range(1, 41))       # a stream's cells and data (opaque here)


@pytest.mark.parametrize("n_stream,slot", [(1, 0), (4, 0), (4, 2), (4, 3), (9, 5)])
def test_a_state_moves_to_one_stream_and_back_unchanged(n_stream, slot):
    raw = frame(n_stream, slot, BLOCK, seq=slot)
    buf = bytearray(raw) + bytearray(8)
    at, n = to_one_stream(buf, len(raw), slot)
    assert bytes(buf[at:at + n]) == frame(1, 0, BLOCK)
    back = bytearray(4 * slot) + bytearray(frame(1, 0, BLOCK)) + bytearray(4 * n_stream)
    m = from_one_stream(back, len(frame(1, 0, BLOCK)), slot, n_stream)
    assert bytes(back[:m]) == raw


def test_cells_in_another_stream_are_refused():
    raw = bytearray(TAG + struct.pack("<II", 1, 3) + struct.pack("<I", 2) + BLOCK + struct.pack("<I", 0))
    with pytest.raises(StateError, match="outside its own stream"):
        to_one_stream(raw, len(raw), 1)          # stream 0 is not empty
    raw = bytearray(frame(3, 0, BLOCK))
    raw[-4:] = struct.pack("<I", 1)              # a cell count after the sequence's stream
    with pytest.raises(StateError, match="outside its own stream"):
        to_one_stream(raw, len(raw), 0)


def test_from_one_stream_wants_a_one_stream_state_and_room():
    with pytest.raises(StateError, match="one-stream state"):
        from_one_stream(bytearray(frame(2, 0, BLOCK)) + bytearray(8), len(frame(2, 0, BLOCK)), 0, 2)
    one = frame(1, 0, BLOCK)
    with pytest.raises(StateError, match="one-stream state"):
        from_one_stream(bytearray(one), len(one), 0, 4)   # no room for the three empty streams
    assert HEAD == 12
