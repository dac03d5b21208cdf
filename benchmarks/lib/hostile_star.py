"""The attackers' side of benchmarks/lib/faults_hostile.py, against the namespace star.

* who attacks: `mosquitto_pub` / `mosquitto_sub` (harness/mosquitto_clients.py) run
  inside dev2's namespace with an enrolled identity's certificate (a compromised device or
  SUN worker), or with only the CA (an outsider);
* what the star counted: each service's dropped count, from the telemetry it publishes
  (`edge-agent run --telemetry-interval`; a total, the reasons stay in the process);
* what a hub-role observer (role hub may read everything) saw on the wire: whether a message
  the broker should refuse got through, and whether a forged one had any effect;
* the legit traffic meanwhile (dev1 and dev2 generate, the app sends SUN requests) and the
  star's memory (VmRSS of every process, Mosquitto included, sampled) during a flood.
"""
from __future__ import annotations

import json
import os
import secrets
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import msgpack

from benchmarks.lib.fault_bench import REQUEST_TIMEOUT, SUN_PROMPTS
from edge.wire import protocol as P
from harness.mosquitto_clients import MosquittoClients


def body(payload: bytes) -> dict:
    """A message's body, unchecked (an observer holds no session secret): {} if unreadable."""
    try:
        return msgpack.unpackb(msgpack.unpackb(payload)["b"])
    except Exception:
        return {}


def tag(payload: bytes) -> str:
    try:
        return msgpack.unpackb(payload).get("t", "")
    except Exception:
        return ""


class Hostile:
    """One row's attack kit: identities, the observer, the services' dropped counts, a session."""

    def __init__(self, star) -> None:
        from edge.wire.link import MqttLink
        from edge.model.tokenizer import Tokenizer
        from server.telemetry_board import TelemetryBoard
        self.star = star
        self.tmp = Path(tempfile.mkdtemp(dir=star.root, prefix="hostile-"))
        self.link = MqttLink(star.url, tls=star.tls("monitor"), keepalive=5).connect(20)
        self.board = TelemetryBoard(self.link, star.ctl_key).start()
        self.model_fp = Tokenizer.from_hf_dir(star.model).fingerprint()
        self.vocab = json.loads((Path(star.model) / "config.json").read_text())["vocab_size"]

    def as_(self, name: Optional[str]) -> MosquittoClients:
        """Clients with `name`'s certificate (None: only the CA), run from dev2's namespace."""
        s = self.star
        tls = s.tls(name) if name else (s.tls("monitor")[0],)
        return MosquittoClients(s.hosts["hub"].ip, s.tls_port, self.tmp, tls, wrap=s.hosts["t2"].cmd)

    def plain(self) -> MosquittoClients:
        """No TLS at all, to the TLS listener."""
        s = self.star
        return MosquittoClients(s.hosts["hub"].ip, s.tls_port, self.tmp, None, wrap=s.hosts["t2"].cmd)

    def observer(self) -> MosquittoClients:
        """The hub-role observer, off the switch (role hub reads every topic)."""
        return MosquittoClients(self.star.hosts["hub"].ip, self.star.tls_port, self.tmp, self.star.tls("monitor"))

    # ---- what the services counted ----
    def dropped(self, client: str, fresh_after: float = 0.0, timeout: float = 10.0) -> int:
        """`client`'s dropped count from its latest telemetry made after `fresh_after` (wall clock)."""
        end = time.monotonic() + timeout
        while True:
            got = {m.client: m for m in self.board.messages()}.get(client)
            if got is not None and got.time >= fresh_after:
                return got.dropped
            if time.monotonic() > end:
                raise RuntimeError(f"no telemetry from {client} (is --telemetry-interval on?)")
            time.sleep(0.05)

    def counted(self, client: str, before: int, n: int, timeout: float = 20.0) -> int:
        """How many more drops `client` reported than `before`, waiting until n more or timeout."""
        end = time.monotonic() + timeout
        while True:
            d = self.dropped(client, time.time() - 1.5) - before
            if d >= n or time.monotonic() > end:
                return d
            time.sleep(0.2)

    # ---- a session of the attacker's own ----
    def join(self, cli: MosquittoClients, client: str) -> P.Joined:
        """Join as `client` with mosquitto_pub / _sub, as its own software would: a session
        (sid, secret, topics) the attacker holds."""
        nonce = secrets.token_hex(6)
        with cli.capture(P.joined_topic(client)) as cap:
            cli.pub(P.join_topic(client), P.encode(P.Join(client, self.model_fp, self.vocab, 3, P.sampling(),
                                                          "target", nonce)))
            got = cap.wait_for(lambda t, p: body(p).get("nonce") == nonce, 20)
        if got is None:
            raise RuntimeError(f"no joined for {client}'s join")
        j = P.decode(got[1])
        if not j.accepted:
            raise RuntimeError(f"the hub refused {client}'s join: {j.reason}")
        return j

    def request(self, j: P.Joined, seq: int, append=(5, 6, 7), gamma: int = 3) -> bytes:
        """A genuine draft request of the attacker's session."""
        return P.encode(P.DraftRequest(j.sid, seq, 0, list(append), gamma), j.secret)

    def bye(self, cli: MosquittoClients, j: P.Joined) -> None:
        cli.pub(j.up, P.encode(P.Bye(j.sid), j.secret))

    def close(self) -> None:
        self.link.close()


def answers(cap, secret: bytes) -> List[object]:
    """The messages on a captured down / stream topic that verify with `secret`."""
    out = []
    for _, p in list(cap.messages):
        try:
            out.append(P.decode(p, secret))
        except P.ProtocolError:
            pass
    return out


class Load:
    """Legit traffic while an attack runs: dev1 and dev2 generate, and the app sends the SUN
    prompts, each in a loop until stop() (each at least once); scored against the no-fault run."""

    def __init__(self, b, sun: bool = True) -> None:
        self.b, self.rs, self.sun = b, [], []           # sun: (tokens asked, lost, error)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._starsd, daemon=True)]
        if sun and b.sun:
            self._threads.append(threading.Thread(target=self._sun, daemon=True))
        for t in self._threads:
            t.start()

    def _starsd(self) -> None:
        while True:
            self.rs += self.b.generate(("t1", "t2"), n=1)
            if self._stop.is_set():
                return

    def _sun(self) -> None:
        client, refs = self.b.sun
        while True:
            hs = [client.submit("maths", p, max_new=24) for p in SUN_PROMPTS]
            for h, ref in zip(hs, refs):
                try:
                    r = h.wait(REQUEST_TIMEOUT)
                    self.sun.append((len(ref), 0 if r.tokens == ref else len(ref), None))
                except Exception as e:  # a failed or lost request: all its tokens lost
                    self.sun.append((len(ref), len(ref), repr(e)))
            if self._stop.is_set():
                return

    def stop(self, happened: str, **kw):
        """Stop, then the row's Outcome: what the attack did, and the legit traffic's score."""
        self._stop.set()
        for t in self._threads:
            t.join(3 * REQUEST_TIMEOUT)
        o = self.b.score(self.rs, happened, **kw)
        if self.sun:
            lost = sum(x[1] for x in self.sun)
            errors = [x[2] for x in self.sun if x[2]]
            o.tokens += sum(x[0] for x in self.sun)
            o.tokens_lost += lost
            o.happened += (f"; {len(self.sun)} SUN requests meanwhile, "
                           + (f"{sum(1 for x in self.sun if x[1])} differ or failed: {errors}" if lost else
                              "all identical to the no-fault run"))
        return o


class PeakRss:
    """The largest VmRSS growth of each star process (Mosquitto included) while in the block, MiB."""

    def __init__(self, star, every: float = 0.02) -> None:
        self.star, self.every = star, every
        self.start: Dict[str, float] = {}
        self.peak: Dict[str, float] = {}
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for n, mb in self.star.status_mb("VmRSS").items():
                self.peak[n] = max(self.peak.get(n, 0.0), mb)

    def __enter__(self) -> "PeakRss":
        self.start = self.star.status_mb("VmRSS")
        self.peak = dict(self.start)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def grown(self) -> Dict[str, float]:
        return {n: round(self.peak[n] - self.start.get(n, self.peak[n]), 1) for n in self.peak}


def new_rid() -> str:
    return f"x{os.getpid()}-{secrets.token_hex(4)}"


def reheader(blob: bytes, **changes) -> bytes:
    """A KV blob (edge/model/kv_blob.py) with header fields changed and the raw KV bytes kept: what a
    sender that lies about dtype, shape or the decoder it was made for would send."""
    from edge.model import kv_blob
    head = kv_blob.read_header(blob)
    raw = blob[head.pop("_offset"):]
    hb = json.dumps({**head, **changes}, sort_keys=True).encode()
    return kv_blob.MAGIC + struct.pack("<HI", kv_blob.VERSION, len(hb)) + hb + raw
