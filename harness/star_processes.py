"""The console scripts as real processes that a test can pause and kill.

harness/console_scripts.py's `Procs` (output in files, SIGTERM stop) plus what process faults need:
`pause` (SIGSTOP: a process that holds work and answers nothing) and `kill9` (SIGKILL: no
goodbye; the broker sends the last will when the kernel closes the socket). Each child also
gets SIGTERM when the test process dies (PR_SET_PDEATHSIG), so a crashed pytest leaves no
agent behind. The tiny saved models come from console_scripts too (`hf_model`, `sun_dirs`).
"""
from __future__ import annotations

import ctypes
import signal
import subprocess

from harness.console_scripts import BIN, ROOT, hf_model, sun_dirs  # noqa: F401  (re-exported for the fault tests)
from harness.console_scripts import Procs as _Procs
from harness.waiting import wait_until  # noqa: F401  (re-exported for the fault tests)


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when our thread dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)    # 1 = PR_SET_PDEATHSIG


class Procs(_Procs):
    """Processes by name; a name started again replaces the dead one."""

    def start(self, name: str, *args) -> subprocess.Popen:
        out, err = open(self.root / f"{name}.out", "wb"), open(self.root / f"{name}.err", "wb")
        p = subprocess.Popen([str(a) for a in args], cwd=ROOT, env=self.env, stdout=out, stderr=err,
                             preexec_fn=_die_with_parent)
        out.close()
        err.close()
        self.procs[name] = p
        return p

    def pause(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGSTOP)

    def kill9(self, name: str) -> None:
        """SIGKILL, as `kill -9` does; returns once the process is gone."""
        p = self.procs[name]
        p.kill()
        p.wait(10)
