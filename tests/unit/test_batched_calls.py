"""Engine.forward_batch and BatchedCalls (edge/engines/batched_calls.py): concurrent generations on one
engine, their forwards batched into one engine call per round; each output equals the one served alone
(tiny float64 torch model: exact)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edge.engines.base import EngineError
from edge.engines.batched_calls import BatchedCalls, served_round, sharing_of
from edge.speculative.generate import ModelDrafter, generate_plain, generate_speculative
from edge.speculative.prefix_cache import PrefixCache
from edge.speculative.sampling import SamplingParams
from harness.at_once import all_at_once
from harness.draft_services import make_engine

torch.set_num_threads(1)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], [5, 5, 5, 17, 33, 2]]
LENGTHS = [30, 12, 25, 40]


def test_forward_batch_equals_the_single_calls_and_is_all_or_nothing():
    eng, ref = make_engine(0), make_engine(0)
    a, b, c = eng.new_sequence(), eng.new_sequence(), eng.new_sequence()
    ra, rb = ref.new_sequence(), ref.new_sequence()
    out = eng.forward_batch([(a, [1, 2, 3]), (b, [4, 5], True), (c, [])])
    assert np.array_equal(out[0], ref.forward(ra, [1, 2, 3]))
    assert np.array_equal(out[1], ref.forward_last(rb, [4, 5])) and out[2].shape[0] == 0
    with pytest.raises(EngineError, match="context full"):
        eng.forward_batch([(a, [1]), (b, [1] * eng.max_len)])
    assert eng.tokens(a) == [1, 2, 3] and eng.length(b) == 2           # nothing changed
    with pytest.raises(EngineError, match="same sequence twice"):
        eng.forward_batch([(a, [1]), (a, [2])])
    # (seq, tokens, n): the last n rows (forward_tail), through BatchedCalls too
    shared, rc = BatchedCalls(make_engine(0)), ref.new_sequence()
    d = shared.new_sequence()
    assert np.array_equal(eng.forward_batch([(c, [7, 8, 9], 2)])[0], ref.forward(rc, [7, 8, 9])[-2:])
    assert np.array_equal(shared.forward_tail(d, [7, 8, 9], 2), eng.forward(eng.new_sequence(), [7, 8, 9])[-2:])


class _Rounds(BatchedCalls):
    """BatchedCalls that records each round: (forwards in it, generations joined at the time). Its
    rounds wait up to a minute for a joined generation: none is ever busy elsewhere here, so every
    round must hold one forward of each."""

    def __init__(self, inner):
        super().__init__(inner, linger_s=60.0)
        self.sizes = []
        batch = inner.forward_batch

        def recorded(calls):
            self.sizes.append((len(calls), sum(self._members.values())))
            return batch(calls)
        inner.forward_batch = recorded

    def whole(self) -> bool:
        return all(n == joined for n, joined in self.sizes) and self.stats["lingered"] == 0


def hold_first_round_until_all_joined(eng: BatchedCalls, n: int) -> None:
    """A member that joins now and forwards nothing, so no round goes (linger 60 s) until `n`
    generations joined too; it leaves then. Every generation is in the first round whatever order
    and pace their threads start at (an event, not a start-up time)."""
    leave = eng.join()

    def release():
        with eng._cv:
            eng._cv.wait_for(lambda: len(eng._members) == n + 1, 60)
        leave()                                   # leave() wakes the waiting round
    threading.Thread(target=release, daemon=True).start()


def test_four_plain_generations_at_once_equal_each_alone_and_share_every_round():
    alone = [generate_plain(make_engine(0), p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    eng = _Rounds(make_engine(0))
    hold_first_round_until_all_joined(eng, len(PROMPTS))
    got = all_at_once([lambda p=p, n=n: generate_plain(eng, p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [g.tokens for g in got] == alone
    # every round held each running generation's forward: not whatever happened to be queued
    assert eng.whole() and eng.stats["largest"] == 4
    assert eng.stats["rounds"] <= max(LENGTHS) + len(PROMPTS)        # + the prefills of late joiners
    assert eng.inner.active_sequences == 0 and not eng._members


def test_a_round_waits_for_a_joined_generation_until_it_leaves_or_linger_runs_out():
    eng = BatchedCalls(make_engine(0), linger_s=60.0)
    s = eng.new_sequence()
    leave, got = eng.join(), []                   # joined here, forwarding nothing
    t = threading.Thread(target=lambda: got.append(eng.forward(s, [1, 2])))
    t.start()
    with eng._cv:                                 # the forward waits for this thread's
        assert eng._cv.wait_for(lambda: eng._pending, 60)
    assert not got
    leave()
    t.join(60)
    assert got and got[0].shape[0] == 2 and eng.stats["lingered"] == 0
    quick = BatchedCalls(make_engine(0), linger_s=0.0)     # a generation busy elsewhere is not waited for
    other = threading.Thread(target=quick.join)
    other.start()
    other.join()
    assert quick.forward(quick.new_sequence(), [3]).shape[0] == 1 and quick.stats["lingered"] == 1


def test_each_thread_hears_its_round_rows_and_seconds_and_how_many_share_the_rounds():
    """What adaptive γ prices a shared round by (edge/speculative/remote_gamma.py): the whole round's
    rows (every generation's forward in it) and how many generations are joined."""
    eng = BatchedCalls(make_engine(0), linger_s=60.0)
    a, b = eng.new_sequence(), eng.new_sequence()
    assert served_round(eng) is None and eng.sharing() == 1 and served_round(make_engine(0)) is None
    eng.forward(a, [1, 2, 3])
    rows, seconds = served_round(eng)
    assert rows == 3 and seconds >= 0
    leaves, heard = [], {}
    ready = threading.Barrier(2)

    def gen(seq, toks):
        leaves.append(eng.join())
        ready.wait()                              # both joined: the round waits for both forwards
        eng.forward(seq, toks)
        heard[seq] = (served_round(eng)[0], eng.sharing())
    ts = [threading.Thread(target=gen, args=(s, t)) for s, t in ((a, [4]), (b, [5, 6, 7, 8]))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert heard == {a: (5, 2), b: (5, 2)}       # one round of 1 + 4 rows, two joined
    assert eng.sharing() == 3                     # a third generation, not joined yet, counts itself
    for leave in leaves:
        leave()
    assert eng.sharing() == 1 and sharing_of(eng)() == 1 and sharing_of(make_engine(0))() == 1


def test_four_speculative_generations_with_a_prompt_cache_equal_each_alone():
    alone = [generate_plain(make_engine(0), p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    eng, draft = _Rounds(make_engine(0)), BatchedCalls(make_engine(1))
    cache = PrefixCache(eng, 4)

    def one(p, n):
        d = ModelDrafter(draft)
        try:
            return generate_speculative(eng, d, p, n, 3, cache=cache)
        finally:
            d.close()
    hold_first_round_until_all_joined(eng, len(PROMPTS))
    got = all_at_once([lambda p=p, n=n: one(p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [g.tokens for g in got] == alone
    turns = [p + a + [7] for p, a in zip(PROMPTS, alone)]      # each conversation's next turn: cached
    alone = [generate_plain(make_engine(0), p, 10).tokens for p in turns]
    hold_first_round_until_all_joined(eng, len(PROMPTS))
    got = all_at_once([lambda p=p: one(p, 10) for p in turns])
    assert [g.tokens for g in got] == alone
    assert sum(g.cached_tokens for g in got) > 0 and len(cache) == 4
    assert eng.whole() and eng.stats["largest"] == 4


def test_a_seeded_sampled_request_replays_alone_and_concurrent():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    alone = generate_speculative(make_engine(0), ModelDrafter(make_engine(1), params), PROMPTS[1], 30, 3,
                                 params=params).tokens
    eng, draft = BatchedCalls(make_engine(0)), BatchedCalls(make_engine(1))
    fns = [lambda: generate_speculative(eng, ModelDrafter(draft, params), PROMPTS[1], 30, 3, params=params)]
    fns += [lambda p=p: generate_plain(eng, p, 20) for p in PROMPTS[2:]]
    assert all_at_once(fns)[0].tokens == alone


def test_a_truncate_during_a_round_waits_for_the_engine_but_reads_see_it():
    eng = BatchedCalls(make_engine(0))
    s = eng.new_sequence()
    eng.forward(s, [1, 2, 3, 4])
    eng._busy = True                         # as if another thread's round were running
    eng.truncate(s, 2)
    assert eng.inner.length(s) == 4 and eng.length(s) == 2 and eng.tokens(s) == [1, 2]
    with pytest.raises(EngineError, match="cannot truncate to 3"):
        eng.truncate(s, 3)
    eng._busy = False
    ref = make_engine(0)                     # the same calls, so that rows round alike on any CPU
    r = ref.new_sequence()
    ref.forward(r, [1, 2, 3, 4])
    ref.truncate(r, 2)
    assert np.array_equal(eng.forward(s, [7]), ref.forward(r, [7])) and eng.inner.tokens(s) == [1, 2, 7]


def test_an_error_reaches_only_the_failing_call():
    eng = _Rounds(make_engine(0))
    full = eng.new_sequence()
    eng.inner.forward(full, [1] * (eng.max_len - 1))
    ok = eng.new_sequence()
    errs = []

    def joined(fn):                               # so that the first round holds all three
        leave = eng.join()
        try:
            return fn()
        finally:
            leave()

    def bad():
        try:
            eng.forward(full, [1, 2])
        except EngineError as e:
            errs.append(e)
    got = all_at_once([lambda: joined(bad), lambda: joined(lambda: eng.forward(ok, [3])),
                         lambda: generate_plain(eng, [5, 6], 5)])
    assert len(errs) == 1 and "context full" in str(errs[0])
    assert got[1].shape[0] == 1 and eng.length(full) == eng.max_len - 1
