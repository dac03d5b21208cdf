"""The StarSD system model (planner)."""
import pytest

from server.planner import SystemInputs, expected_tokens, n_full, simulate, sweep


def inputs(**kw):
    base = dict(draft_step_ms={1: 10, 2: 11, 4: 13, 8: 18, 16: 28, 32: 50}, draft_feed_ms=2,
                target_step_ms=40, verify_cost={1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08},
                rtt_ms=2, alpha=0.8)
    base.update(kw)
    return SystemInputs(**base)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_under_loaded_draft_idles_and_scales_linearly():
    inp = inputs()
    one, two = simulate(inp, 1, 3), simulate(inp, 2, 3)
    assert one.busy_ratio < 0.6 and one.t_idle_ms > 0
    assert two.system_tps == pytest.approx(2 * one.system_tps, rel=0.05)
    # T_γ = N·S(d) + T_idle
    assert one.iteration_ms == pytest.approx(1 * one.s_d_ms + one.t_idle_ms, rel=0.02)


def test_fully_loaded_draft_is_busy_and_batches():
    p = simulate(inputs(), 32, 3)
    assert p.busy_ratio > 0.9 and p.mean_batch > 4
    assert p.per_target_tps < simulate(inputs(), 1, 3).per_target_tps


def test_n_full_is_where_throughput_stops_growing():
    preds = sweep(inputs(), [1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 4])
    nf = n_full(preds)
    assert 2 <= nf <= 32
    under = [p for p in preds if p.n < nf]
    assert all(p.busy_ratio < 0.9 for p in under)


def test_a_useless_draft_never_beats_standalone():
    p = simulate(inputs(alpha=0.0), 1, 2)
    assert p.per_target_tps < p.standalone_tps
