"""BatchHold: when a draft service waits for sessions about to come back (pure, fed with times)."""
import pytest

from edge.star.batch_hold import BatchHold


def ping_pong(share=0.8, back=0.035, batch_s=0.150):
    """A served at t=1.0 (its target comes back `back` later); B waits; batches of one take batch_s."""
    h = BatchHold(share=share)
    h.batch(1, batch_s, 0.5)
    h.answered("A", 0.8)
    h.arrived("A", 0.8 + back)                # one round: A's return time is known
    h.answered("A", 1.0)
    return h


def test_nothing_pending_or_nothing_known_is_served_now():
    assert BatchHold().until(1.0, {"B"}) is None          # no batch seen: no fixed cost known
    assert ping_pong().until(1.0, set()) is None


def test_holds_for_a_session_due_within_the_fixed_cost_then_serves_when_it_is_in():
    h = ping_pong()
    t = h.until(1.0, {"B"})
    # a = 0.150 / 2 (one size seen); A due at 1.035, waited for up to a quarter of its return time more
    assert t == pytest.approx(1.035 + 0.25 * 0.035)
    assert h.holds == 1
    assert h.until(1.02, {"B"}) == pytest.approx(t)        # the same hold, not a new one
    h.arrived("A", 1.036)
    assert h.until(1.036, {"A", "B"}) is None               # everyone due is in: serve
    assert h.held_s == pytest.approx(0.036)


def test_a_session_due_too_late_or_overdue_is_not_waited_for():
    assert ping_pong(back=0.2).until(1.0, {"B"}) is None    # 0.2 s > 0.8 x 0.075 s
    h = ping_pong()
    assert h.until(1.05, {"B"}) is None                     # due at 1.035: past its slack
    assert ping_pong(share=0.0).until(1.0, {"B"}) is None   # share 0: work-conserving


def test_the_hold_is_bounded_from_when_it_began():
    h = ping_pong(back=0.05)
    first = h.until(1.0, {"B"})
    assert first <= 1.0 + 0.8 * 0.075 + 1e-12
    assert h.until(first + 1e-3, {"B"}) is None             # A never came: B is served


def test_fixed_cost_is_the_intercept_of_the_batch_times():
    h = BatchHold()
    for b, t in ((1, 0.150), (2, 0.232), (4, 0.334)):      # a 0.5B Q4_0 draft on one core (measured)
        h.batch(b, t, 0.0)
    assert h.fixed_cost() == pytest.approx(0.099, abs=0.005)
    lin = BatchHold()
    for b in (1, 2, 4):
        lin.batch(b, 0.1 * b, 0.0)                          # no fixed part: merging saves nothing
    assert lin.fixed_cost() == pytest.approx(0.0, abs=1e-12)
    lin.answered("A", 1.0)
    lin.arrived("A", 1.01)
    lin.answered("A", 2.0)
    assert lin.until(2.0, {"B"}) is None


def test_a_pause_is_no_return_sample_and_a_closed_session_is_forgotten():
    h = ping_pong()
    h.arrived("A", 5.0)                                     # 4 s after its answer: a new prompt
    h.answered("A", 5.2)
    assert h.until(5.2, {"B"}) == pytest.approx(5.235 + 0.25 * 0.035)
    h.forget("A")
    assert h.until(5.21, {"B"}) is None


def test_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="share"):
        BatchHold(share=1.5)


def test_a_merged_service_remembers_what_a_smaller_batch_cost():
    """Held batches of two (a CPU draft: D(2) = 1.8 D(1)) must not make the fit forget D(1)."""
    h = BatchHold()
    h.batch(1, 0.131, 0.0)
    for _ in range(200):
        h.batch(2, 0.237, 0.0)
    assert h.fixed_cost() == pytest.approx(0.025, abs=1e-9)
    h.answered("A", 0.8)
    h.arrived("A", 0.835)
    h.answered("A", 1.0)
    assert h.until(1.0, {"B"}) is None                      # 35 ms back > 0.5 x 25 ms saved
