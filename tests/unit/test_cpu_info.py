"""/proc/cpuinfo read once for the whole kit: the CPU's name and its feature flags."""
from edge.telemetry.cpu_info import cpu_flags, cpu_name


def test_name_and_flags_of_an_x86_and_an_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                   "processor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert cpu_name(str(x86)) == "AMD EPYC 9B14" and cpu_flags(str(x86)) == ["fpu", "avx2", "avx512_bf16"]
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(str(arm)) == ["fp", "asimd", "bf16"] and cpu_name(str(arm))    # no model name: platform's


def test_a_missing_file_is_no_error(tmp_path):
    assert cpu_flags(str(tmp_path / "none")) == [] and isinstance(cpu_name(str(tmp_path / "none")), str)
