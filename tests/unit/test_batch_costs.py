"""How many pending requests a draft batch takes, from the measured step cost by batch size."""
import pytest

from edge.roles.batch_costs import BatchCosts


def measured(costs: dict, times: int = 3, **kw) -> BatchCosts:
    bc = BatchCosts(**kw)
    for b, s in costs.items():
        for _ in range(times):
            bc.record(b, s)
    return bc


def test_a_flat_step_takes_everything():
    bc = measured({1: 0.010, 2: 0.011, 4: 0.012, 8: 0.015})        # a GPU: a batch costs ~one step
    assert [bc.chunk(n) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]


def test_one_cpu_core_serves_two_one_by_one_but_batches_four():
    bc = measured({1: 0.025, 2: 0.0614, 4: 0.0825})                # Q4_0 0.5B, one core (draft_formats.md)
    assert bc.chunk(2) == 1                    # 2 × 25 ms one after the other beat 61 ms together
    assert bc.chunk(4) == 4                    # 82.5 ms for four beat 4 × 25
    assert bc.chunk(3) == 3                    # never measured: take them all, which measures it


def test_only_all_or_one_at_a_time_are_compared():
    bc = measured({1: 0.025, 2: 0.040, 4: 0.120})
    assert bc.chunk(4) == 1                    # 25 ms a sequence at 1 against 30 at 4 (2 is not a choice)
    assert bc.chunk(2) == 2                    # 20 ms a sequence at 2


def test_too_few_samples_or_a_near_tie_do_not_split():
    assert measured({1: 0.010, 2: 0.040}, times=2).chunk(2) == 2     # under min_samples
    assert measured({1: 0.0095, 2: 0.020}).chunk(2) == 2            # 5% cheaper: inside the margin
    assert measured({1: 0.0085, 2: 0.020}).chunk(2) == 1            # 15% cheaper: split


def test_all_are_taken_again_every_refresh_decisions():
    bc = measured({1: 0.025, 2: 0.0614}, refresh=4)
    assert [bc.chunk(2) for _ in range(8)] == [1, 1, 1, 2, 1, 1, 1, 2]


def test_a_window_follows_the_machine():
    bc = measured({1: 0.025, 2: 0.0614}, window=4)
    for _ in range(4):
        bc.record(2, 0.030)                    # batching became cheap (the other core went quiet)
    assert bc.step_s(2) == pytest.approx(0.030) and bc.chunk(2) == 2


def test_bad_samples_are_refused():
    with pytest.raises(ValueError):
        BatchCosts().record(0, 0.01)
    with pytest.raises(ValueError):
        BatchCosts().record(2, -1.0)
