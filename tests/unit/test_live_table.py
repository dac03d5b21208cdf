"""The demos' live table (server/demos/live_table.py): in place on a terminal, every 5 s elsewhere."""
import io

from server.demos.live_table import LiveTable


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_sees_the_table_redrawn_in_place():
    out = Tty()
    t = LiveTable(out)
    t.update(0.1, lambda: ["a", "b"])
    t.update(0.2, lambda: ["c", "d"])
    t.final(["e"])
    assert out.getvalue() == "a\nb\n\x1b[2F\x1b[Jc\nd\n\x1b[2F\x1b[Je\n"


def test_a_log_gets_a_table_every_five_seconds_and_none_when_not_live():
    out = io.StringIO()
    t = LiveTable(out)
    for now in (0.5, 1.0, 5.4, 6.0, 10.5):
        t.update(now, lambda: [f"t={now}"])
    t.final(["end"])
    assert out.getvalue() == "t=5.4\nt=10.5\nend\n"
    quiet = io.StringIO()
    t = LiveTable(quiet, live=False)
    t.update(9.0, lambda: ["x"])
    t.final(["end"])
    assert quiet.getvalue() == "end\n"
