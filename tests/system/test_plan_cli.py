"""`edge-hub plan` prints the system model's table from flags."""
from click.testing import CliRunner

from server.hub_cli import main


def test_plan_from_flags_prints_table_and_n_full():
    r = CliRunner().invoke(main, ["plan", "--profile", "jetson-orin-nano-8gb", "--draft-step", "1=5,4=7,16=15",
                                  "--alpha", "0.7", "--ns", "1,2,4,8", "--gammas", "2,4"])
    assert r.exit_code == 0, r.output
    assert "N_full" in r.output and "| 8 |" in r.output


def test_plan_without_inputs_is_a_clear_error():
    r = CliRunner().invoke(main, ["plan", "--alpha", "1.5"])
    assert r.exit_code != 0 and "Traceback" not in r.output
