"""Third-party MQTT clients for attacks: the real `mosquitto_pub` / `mosquitto_sub` binaries
(package mosquitto-clients), as one identity -- a TLS client certificate, only the CA (an
outsider), or plain MQTT -- optionally inside a network namespace (a netns host's `cmd`).
Shared by tests/system/test_hostile_clients.py and benchmarks/lib/faults_hostile.py.

    cli = MosquittoClients("10.0.0.1", 8883, workdir, tls=(ca, crt, key), wrap=host.cmd)
    cli.pub("ss/sun/req/dev2", payload, repeat=2000)      # QoS 1: the broker takes every copy
    with cli.capture("ss/s/dev2/+/+/down") as cap: ...; cap.messages   # [(topic, bytes)]
"""
from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import msgpack

from edge.wire import protocol as P
PUB, SUB = shutil.which("mosquitto_pub"), shutil.which("mosquitto_sub")


def signed(tag: str, sid: str, body: dict, secret: bytes) -> bytes:
    """An envelope with a correct HMAC around any body (what only a key holder can make)."""
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "t": tag, "s": sid, "b": raw,
                          "h": P._mac(secret, P.PROTOCOL_VERSION, tag, sid, raw)}, use_bin_type=True)


class Capture:
    """A `mosquitto_sub` on topic filters: every message as (topic, bytes), read as they come.
    count: exit after that many (`get()` waits for them); 0: run until `stop()`."""

    def __init__(self, argv: List[str], count: int = 0, settle: float = 0.3):
        self.messages: List[Tuple[str, bytes]] = []
        self._cv = threading.Condition()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        time.sleep(settle)                    # let it subscribe before traffic starts

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, _, h = line.rstrip("\n").partition(" ")
            if t:
                with self._cv:
                    self.messages.append((t, bytes.fromhex(h)))
                    self._cv.notify_all()

    def wait_for(self, pred: Callable[[str, bytes], bool], timeout: float = 10.0) -> Optional[Tuple[str, bytes]]:
        """The first message (so far or to come) for which pred(topic, payload) holds; None past timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            for i in itertools.count():
                while i >= len(self.messages):
                    left = end - time.monotonic()
                    if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                        return None
                    self._cv.wait(min(left, 0.1))
                if pred(*self.messages[i]):
                    return self.messages[i]

    def get(self, timeout: float = 30.0) -> List[Tuple[str, bytes]]:
        """Wait for the process to end (its count or -W reached), then every message."""
        self.proc.wait(timeout)
        self._reader.join(5)
        return list(self.messages)

    def stop(self) -> List[Tuple[str, bytes]]:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._reader.join(5)
        return list(self.messages)

    def error(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class MosquittoClients:
    """mosquitto_pub / mosquitto_sub for one identity against one broker.

    tls: (ca, cert, key) -- a device's certificate; (ca,) -- an outsider who trusts the CA but
    has no certificate; None -- plain MQTT. wrap: prefixes each command (a netns host's `cmd`)."""

    def __init__(self, host: str, port: int, workdir: Path, tls: Optional[Sequence[str]] = None,
                 wrap: Optional[Callable[..., List[str]]] = None):
        self.host, self.port, self.workdir, self.tls = host, port, Path(workdir), tls
        self.wrap = wrap or (lambda *a: [str(x) for x in a])
        self._files = itertools.count()

    def _conn(self) -> List[str]:
        out = ["-h", self.host, "-p", str(self.port)]
        if self.tls:
            out += ["--cafile", str(self.tls[0])]
            if len(self.tls) > 1:
                out += ["--cert", str(self.tls[1]), "--key", str(self.tls[2])]
        return out

    def pub(self, topic: str, payload: bytes, repeat: int = 1, qos: int = 1, check: bool = True,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Publish like any third-party client would; check=False: return the failure instead of raising."""
        f = self.workdir / f"payload-{next(self._files)}.bin"     # -f: binary-safe (-l splits at NULs)
        f.write_bytes(payload)
        cmd = [PUB, *self._conn(), "-q", str(qos), "-t", topic, "-f", str(f)]
        if repeat > 1:
            cmd += ["--repeat", str(repeat)]
        try:
            return subprocess.run(self.wrap(*cmd), check=check, timeout=timeout, capture_output=True, text=True)
        finally:
            f.unlink()

    def capture(self, *topics: str, count: int = 0, wait_s: Optional[int] = None, settle: float = 0.3) -> Capture:
        """mosquitto_sub on `topics`; count 0: until stopped; wait_s: it exits after that long."""
        cmd = [SUB, *self._conn(), *[x for t in topics for x in ("-t", t)], "-F", "%t %x"]
        if count:
            cmd += ["-C", str(count)]
        if wait_s:
            cmd += ["-W", str(wait_s)]
        return Capture(self.wrap(*cmd), count, settle)
