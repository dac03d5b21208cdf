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
