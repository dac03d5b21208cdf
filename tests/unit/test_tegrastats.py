"""The tegrastats parser on lines recorded on Orin Nano and AGX Orin boards (tests/fixtures,
sources named there), and the reader on a process that prints them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edge.telemetry.tegrastats import TegrastatsReader, parse_line

from harness.waiting import wait_until

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tegrastats_orin.txt"


def _lines():
    out = []
    for raw in FIXTURE.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            device, line = raw.split("|", 1)
            out.append((device, line))
    return out


LINES = _lines()


def test_the_fixture_has_both_boards():
    assert {d for d, _ in LINES} == {"orin-nano", "agx-orin"} and len(LINES) == 4


def test_orin_nano_idle_line():
    s = parse_line(LINES[0][1])
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb) == (3452.0, 7620.0, 1518.0)
    assert s.cpu_loads == [1.0, 2.0, 0.0, 2.0, 2.0, 1.0]
    assert s.gpu_pct == 0.0
    assert s.temps_c["tj"] == 50.25 and s.temp_c == 50.25           # the hottest: tj and soc1
    assert s.rails_mw == {"VDD_IN": 4824.0, "VDD_CPU_GPU_CV": 518.0, "VDD_SOC": 1475.0}
    assert s.power_w == pytest.approx(4.824)                       # the board's input rail, not the sum


def test_orin_nano_loaded_line_with_gpu_frequency_array():
    s = parse_line(LINES[1][1])
    assert s.gpu_pct == 63.0                                       # "GR3D_FREQ 63%@[621]"
    assert s.cpu_pct == pytest.approx((15 + 11 + 14 + 13 + 11 + 8) / 6)
    assert s.temp_c == pytest.approx(53.968)
    assert s.power_w == pytest.approx(12.479)


def test_agx_orin_jetpack7_line_sums_its_rails():
    s = parse_line(LINES[2][1])
    assert (s.ram_used_mb, s.ram_total_mb) == (20642.0, 62817.0)
    assert len(s.cpu_loads) == 12 and s.gpu_pct == 12.0
    assert s.temps_c == {"cpu": 52.968, "soc2": 48.406, "soc0": 49.531, "gpu": 47.625}   # "cur/max": cur
    assert s.rails_mw == {"VDD_GPU_SOC": 5139.0, "VDD_CPU_CV": 3268.0, "VIN_SYS_5V0": 5500.0}
    assert s.power_w == pytest.approx(5.139 + 3.268 + 5.5)        # no input rail on AGX Orin


def test_short_agx_line_and_unknown_fields_leave_the_rest_unset():
    s = parse_line(LINES[3][1])
    assert s.ram_total_mb == 30698.0 and s.gpu_pct == 45.0 and s.temp_c == pytest.approx(52.468)
    assert s.cpu_loads == [] and s.cpu_pct is None and s.swap_used_mb is None


@pytest.mark.parametrize("line", ["", "garbage 12 34", "RAM x/yMB CPU [off,off] CV0@-256C VDD_IN 12/34"])
def test_lines_it_half_understands_never_raise(line):
    s = parse_line(line)
    assert s.temp_c is None                                        # -256C: a powered-down sensor
    if "CPU" in line:
        assert s.cpu_loads == [None, None] and s.cpu_pct is None
        assert s.power_w == pytest.approx(0.012)                   # pre-JetPack 5 rails carry no unit


def test_reader_keeps_the_latest_line_of_the_process(tmp_path):
    # No Jetson here: a stand-in program prints the recorded lines the way tegrastats does
    # (one per interval, until it is stopped); the reader runs it exactly as it runs tegrastats.
    script = tmp_path / "replay.py"
    script.write_text("import sys, time\n"
                      f"lines = {[line for _, line in LINES[:2]]!r}\n"
                      "assert sys.argv[1:3] == ['--interval', '50'], sys.argv\n"
                      "for l in lines:\n    print(l, flush=True)\n    time.sleep(0.05)\n"
                      "time.sleep(60)\n")
    reader = TegrastatsReader(0.05, command=[sys.executable, str(script)]).start()
    try:
        wait_until(lambda: reader.lines >= 2)
        assert reader.lines == 2
        assert reader.latest().gpu_pct == 63.0                     # the second line's
    finally:
        reader.close()
    assert reader._proc.poll() is not None                         # close() ends the program
