"""pad_call (edge/engines/llamacpp_rows.py): every slot padded to the same rows, at least 8 in all
and a multiple of 4, as many logits rows asked with the wanted ones first; padding repeats a slot's
last token at the next positions; a call too ragged for the room is left to one slot at a time."""
import pytest

from edge.engines.llamacpp_rows import MIN_ROWS, ROW_GROUP, pad_call, padded_rows, wanted_rows


def _call(counts, start=100):
    """Entries of len(counts) slots (slot k: counts[k] tokens from `start`), all wanted."""
    entries = [(1000 + k * 10 + j, start + j, k) for k, n in enumerate(counts) for j in range(n)]
    return entries, list(range(len(entries)))


@pytest.mark.parametrize("counts", [[1], [3], [5], [8], [13], [1, 1], [5, 5, 5], [5, 3, 5, 4], [2] * 7, [60]])
def test_every_slot_gets_the_same_rows_at_least_8_a_multiple_of_4(counts):
    entries, want = _call(counts)
    call = pad_call(entries, want)
    per_slot = {}
    for tok, pos, slot in call.entries:
        per_slot.setdefault(slot, []).append((tok, pos))
    rows = {len(v) for v in per_slot.values()}
    assert len(rows) == 1 and rows.pop() == padded_rows(len(counts), max(counts))
    assert len(call.entries) >= MIN_ROWS and len(call.entries) % ROW_GROUP == 0
    assert len(call.want) == wanted_rows(len(want)) and len(set(call.want)) == len(call.want)
    assert [call.entries[i] for i in call.want[:call.n_wanted]] == entries       # the wanted rows first, in order
    for slot, n in enumerate(counts):
        mine = per_slot[slot]
        assert [p for _, p in mine] == list(range(100, 100 + len(mine)))       # consecutive positions
        assert all(t == mine[n - 1][0] for t, _ in mine[n:])                   # the last token repeated
        assert call.pads.get(slot) == (100 + n if len(mine) > n else None)


def test_a_call_already_exact_is_unchanged():
    entries, want = _call([4, 4])
    call = pad_call(entries, want)
    assert call.entries == entries and call.want == want and call.pads == {}


def test_fewer_wanted_rows_ask_for_padding_rows_first():
    entries, _ = _call([5])
    call = pad_call(entries, [4])                       # a verify's last row only
    assert call.want[0] == 4 and call.n_wanted == 1 and len(call.want) == 8
    assert set(call.want[1:4]) == {5, 6, 7}             # the padding's rows, then the unwanted real ones


def test_too_ragged_for_the_room_is_none():
    entries, want = _call([20, 1])
    assert pad_call(entries, want, room=8) is None      # slot 1 would need 19 cells of padding
    assert pad_call(entries, want, room=32) is not None


@pytest.mark.parametrize("n_slots,longest,rows", [(1, 1, 8), (1, 9, 12), (2, 1, 4), (3, 1, 4), (3, 5, 8),
                                                  (4, 1, 2), (4, 5, 5), (5, 2, 4), (8, 1, 1)])
def test_padded_rows(n_slots, longest, rows):
    assert padded_rows(n_slots, longest) == rows


class _Engine:
    """What decode_exact touches of a LlamaCppEngine: the raw decodes are recorded, each row's logits
    are its (token, position) so the test can see which rows came back; removed cells recorded."""
    vocab_size = 2

    def __init__(self, n_batch=512):
        self._n_batch, self.calls, self.removed = n_batch, [], []
        self._mem = object()
        self._lc = self

    def llama_memory_seq_rm(self, mem, slot, first, last):
        self.removed.append((slot, first))

    def _decode_raw(self, entries, want):
        import numpy as np
        self.calls.append((list(entries), list(want)))
        return np.array([[entries[i][0], entries[i][1]] for i in want], dtype=float)


def test_decode_exact_pads_a_call_and_removes_the_padding_after():
    from edge.engines.llamacpp_rows import decode_exact
    eng = _Engine()
    entries, want = _call([5, 2])
    rows = decode_exact(eng, entries, want)
    assert rows.tolist() == [[t, p] for t, p, _ in entries]                    # the wanted rows, in order
    (sent, asked), = eng.calls
    assert len(sent) == 12 and len(asked) == 8 and sorted(eng.removed) == [(0, 105), (1, 102)]


def test_decode_exact_leaves_a_prefill_alone_and_splits_what_it_cannot_pad():
    from edge.engines.llamacpp_rows import decode_exact
    eng = _Engine()
    entries, _ = _call([70])
    decode_exact(eng, entries, [69])
    assert eng.calls == [(entries, [69])] and eng.removed == []               # >= 64 rows: as it is
    eng = _Engine()
    entries, want = _call([30, 1])                                             # slot 1 would need 29 cells
    rows = decode_exact(eng, entries, want)
    assert rows.tolist() == [[t, p] for t, p, _ in entries]
    assert [len(c[0]) for c in eng.calls] == [32, 8]                           # one slot at a time, each padded
    eng = _Engine(n_batch=4)                                                   # a batch smaller than the padding
    entries, want = _call([3])
    assert decode_exact(eng, entries, want).tolist() == [[t, p] for t, p, _ in entries]
    assert eng.calls == [(entries, want)]
