"""A llama.cpp sequence saved to host memory and restored into any free slot (Engine.save_sequence).

llama.cpp writes a sequence's cells through `llama_state_seq_get_data` in its own cache types (f16,
q8_0, ...), so a copy restored with `llama_state_seq_set_data` is the same cells bit for bit: the
next token's logits equal those of the sequence that was saved. A context with a stream per
sequence (ours: not unified) writes every stream's cell count, all 0 but the sequence's own; the copy
is kept as one stream (llamacpp_kv.to_one_stream, in place) and rewritten for the slot it goes back
to (from_one_stream), as the prefill twin moves KV between contexts (llamacpp_twin.py). This is what
llama-server's `--cache-ram` does with a slot's prompt.
"""
from __future__ import annotations

from edge.engines.base import EngineError, SavedSequence
from edge.engines.llamacpp_kv import StateError, from_one_stream, to_one_stream
from edge.engines.llamacpp_twin import buffer_at


def save_state(engine, seq: int) -> SavedSequence:
    """`seq` of a LlamaCppEngine copied out: its tokens and its one-stream state, kept in a buffer with
    room on both sides so that restore_state rewrites the frame for its slot in place (no second copy)."""
    slot, tokens = engine._get(seq), tuple(engine._tokens[seq])
    if tokens and min(tokens) < 0:
        raise EngineError("a sequence imported without its tokens cannot be saved")
    engine._apply_queued_copies(slot, len(tokens))
    lc = engine._lc
    n = lc.llama_state_seq_get_size(engine._ctx, slot)
    room = 4 * (engine.n_seq_max - 1)
    buf = bytearray(room + n + room)
    if lc.llama_state_seq_get_data(engine._ctx, buffer_at(buf, room), n, slot) != n:
        raise EngineError(f"llama.cpp wrote less than the {n} bytes of a sequence's state")
    at, length = (0, n) if engine.n_seq_max == 1 else _one_stream(memoryview(buf)[room:], n, slot)
    return SavedSequence(tokens, (buf, room + at), length, engine.fingerprint)


def restore_state(engine, saved: SavedSequence) -> int:
    """A new sequence of `engine` holding `saved` (an EngineError when no slot is free or llama.cpp
    refuses it; nothing is left behind, and `saved` is as it was: it may be restored again)."""
    if saved.engine != engine.fingerprint:
        raise EngineError("a saved sequence goes back only to the model that computed it")
    sid = engine.new_sequence()
    slot = engine._slot[sid]
    try:
        engine._apply_queued_copies(slot, 0)    # this slot may be a queued copy's source
        if saved.tokens:
            _set(engine, saved, slot)
    except StateError as e:
        engine.free(sid)
        raise EngineError(f"cannot restore a saved sequence: {e}") from None
    except BaseException:
        engine.free(sid)
        raise
    engine._tokens[sid] = list(saved.tokens)
    return sid


def _set(engine, saved: SavedSequence, slot: int) -> None:
    """llama_state_seq_set_data of the saved frame into `slot`: rewritten for the slot in its buffer,
    then back to its one-stream form."""
    (buf, at), m, streams = saved.data, saved.nbytes, engine.n_seq_max
    start = at - 4 * slot if streams > 1 else at
    view = memoryview(buf)[start:]
    length = from_one_stream(view, m, slot, streams) if streams > 1 else m
    try:
        if engine._lc.llama_state_seq_set_data(engine._ctx, buffer_at(buf, start), length, slot) != length:
            raise EngineError("llama.cpp refused a saved sequence's state (no room in its cache)")
    finally:
        if streams > 1:
            to_one_stream(view, length, slot)


def _one_stream(view, n: int, slot: int):
    try:
        return to_one_stream(view, n, slot)
    except StateError as e:
        raise EngineError(f"cannot save a sequence: {e}") from None
