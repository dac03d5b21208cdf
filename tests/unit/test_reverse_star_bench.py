"""benchmarks/star/reverse_star.py's bookkeeping: every N point generates every prompt (the same mix of
texts, so the same acceptance), and the planner's acceptance is read back from tokens a round."""
import pytest

from benchmarks.lib.reverse_star_parts import alpha_of
from benchmarks.star.reverse_star import args_of, jobs_of
from edge.speculative.verify import expected_tokens


def test_every_point_covers_every_prompt():
    prompts = [[1], [2], [3], [4]]
    for n in (1, 2, 4, 8):
        jobs = jobs_of(prompts, n)
        assert len(jobs) == n and all(jobs)
        done = [p[0] for js in jobs for p in js]
        assert sorted(set(done)) == [1, 2, 3, 4] and len(done) == max(n, 4)


def test_alpha_is_read_back_from_tokens_a_round():
    e = expected_tokens(0.7, 4)
    assert alpha_of([{"tokens_per_round": e}], 4) == pytest.approx(0.7, abs=1e-6)


def test_quick_is_small():
    a = args_of(["--quick"])
    assert (a.ns, a.rounds, a.new) == ("1,2", 1, 24) and a.reps == 3    # each hub call timed 3 times for the planner


def test_decode_windows_leave_every_prefill_out():
    """A group's windows start at its last first answer (every prompt of the group prefilled by then):
    device 0 answered at 1.0 s decodes through device 1's prefill until 3.0 s, which is not counted."""
    from types import SimpleNamespace as NS
    from benchmarks.lib.reverse_star_parts import summary

    def gen(job, stamps, end):
        r = NS(n_generated=len(stamps), n_verify_calls=2, n_drafted=4, n_accepted=2,
               timings=[NS(kind="verify", seconds=0.5), NS(kind="verify", seconds=0.4)])
        return {"result": r, "job": job, "stamps": stamps, "prompt": 3, "first_at": stamps[0],
                "first_done": stamps[0], "end_at": end, "first_round_s": 0.5}
    gens = [[gen(0, [1.0, 1.5, 2.0, 3.5, 4.0], 4.0)], [gen(0, [3.0, 3.5, 4.0], 4.0)]]
    out = summary(gens, 0.0, 4.0)
    # both windows from 3.0 s: 2 tokens in 1 s each (device 0's tokens at 1.5 and 2.0 s left out)
    assert out["hub_tps"] == pytest.approx(4.0) and out["per_device_tps"] == pytest.approx(2.0)
    assert [t["decode_from"] for t in out["timeline"]] == [3.0, 3.0]


def test_plain_baseline_decodes_the_devices_prompts_in_their_groups():
    import numpy as np
    from benchmarks.lib.reverse_baseline_worker import plain_batched

    class Fake:
        def __init__(self):
            self.n, self.calls = 0, []

        def new_sequence(self):
            self.n += 1
            return self.n

        def forward_last(self, s, toks):
            pass

        def forward_batch(self, calls):
            self.calls.append(len(calls))
            return [np.zeros((1, 4)) for _ in calls]

        def free(self, s):
            pass
    eng = Fake()
    out = plain_batched(eng, [[1, 2], [3, 4, 5]], 1, 3)        # one client, both prompts in turn
    assert eng.calls == [1] * 6 and out["tokens"] == 6
    eng.calls = []
    out = plain_batched(eng, [[1, 2], [3, 4, 5]], 4, 3)        # four clients at once, one prompt each
    assert eng.calls == [4] * 3 and out["tokens"] == 12
