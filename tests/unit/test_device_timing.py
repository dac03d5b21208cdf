"""The emulated device's timing travels to the target processes as a dict: a target step given
on the command line (a target measured on this machine) must survive the trip, and the
device's own draft step and the network must keep the profile's figures."""
from harness.emulated_target import DeviceTiming


def test_a_given_target_step_survives_the_round_trip_and_prices_verifies():
    t = DeviceTiming.from_profile("cpu-2core", net_rtt_ms=2.0, verify_override={2: 0.95, 5: 1.2},
                                  target_step_ms=340.0)
    back = DeviceTiming.from_dict(t.to_dict())
    assert back == t
    assert back.target_step_ms == 340.0
    assert back.call_ms(5) == 340.0 * 1.2
    assert back.net_rtt_ms == 2.0
    plain = DeviceTiming.from_profile("cpu-2core", net_rtt_ms=2.0)
    assert back.draft_step_ms == plain.draft_step_ms
    assert plain.target_step_ms != 340.0


def test_without_a_given_step_the_profile_and_time_scale_decide():
    t = DeviceTiming.from_profile("jetson-orin-nano-8gb", time_scale=2.0)
    one = DeviceTiming.from_profile("jetson-orin-nano-8gb")
    assert DeviceTiming.from_dict(t.to_dict()) == t
    assert abs(t.target_step_ms - 2 * one.target_step_ms) < 1e-9
