"""The emulated target's acceptance: the count of drafts accepted a round follows the i.i.d.
model (P(n >= j) = alpha^j), and its mean over a short run is close to the expected one."""
import numpy as np

from harness.emulated_target import DeviceTiming, EmulatedEngine, accepted_drafts


def expected(alpha, gamma):
    return sum(alpha ** j for j in range(1, gamma + 1))


def test_inverse_cdf_matches_the_iid_model():
    u = (np.arange(200_000) + 0.5) / 200_000
    n = np.array([accepted_drafts(x, 0.7, 4) for x in u])
    for j in range(1, 5):
        assert abs((n >= j).mean() - 0.7 ** j) < 1e-3
    assert accepted_drafts(0.3, 1.0, 4) == 4 and accepted_drafts(0.3, 0.0, 4) == 0


def test_forty_rounds_see_the_expected_mean_acceptance():
    """What a 30 s point of the sweep sees: ~40 rounds of gamma=4 at alpha 0.68."""
    timing = DeviceTiming("cpu-2core", target_step_ms=0.0, draft_step_ms=0.0, net_rtt_ms=0.0)
    errs = []
    for seed in range(20):
        eng = EmulatedEngine(timing, 0.68, 64, seed=seed)
        seq = eng.new_sequence()
        eng.forward(seq, [1, 2])                      # the prefill: no round
        for _ in range(40):
            eng.forward(seq, [3, 4, 5, 6, 7])
        errs.append(abs(eng.accepted / eng.calls - expected(0.68, 4)) / expected(0.68, 4))
    # plain random draws: median 12%, worst 36% off over 20 seeds; this sequence: ~3%, < 10%
    assert np.median(errs) < 0.04 and max(errs) < 0.1, errs
