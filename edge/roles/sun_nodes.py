"""SUN roles on the MQTT star: the node base, the prefill worker node, `open_node` (the shared
decoder node is edge/roles/decoder_node.py; the client is sun_client.py).

Flow of one request (topics in edge/protocol.py; the router is server/sun_router.py):

    client --SunRequest--> router --DecodeAssign--> decoder      (reserve, with the secret)
                                  --PrefillJob----> prefill      (then: prompt -> KV + token 0)
    prefill --SunTokens(token 0)--> client          (time to first token without a decoder hop)
    prefill --KVChunk x n---------> decoder         (signed with the request's secret)
    decoder --SunTokens(1..)------> client          (continuous batching across all tasks)

Every node hands network callbacks to one worker thread through a queue, so
the engine is only touched from that thread. A node announces itself with a
retained SunHello (its will says online=False) and re-announces whenever its
load changes, which is what the router's least-loaded choice reads.
KV chunks and tokens go at QoS 1: a lost chunk would cost the request, a lost
token would leave a hole in the answer. A request's stop ids are added to the
decoder's own (its end-of-sequence ids).
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Dict, Optional, Sequence

from edge.link import Link
from edge.protocol import (E_INTERNAL, SUN_CHUNK_BYTES, DecodeAssign,
                           Error, KVChunk, PrefillJob, ProtocolError, SunHello, SunTokens, decode, encode,
                           sun_ctl_topic, sun_hello_topic, sun_kv_topic, sun_stream_topic)
from edge.roles.decoder import SharedDecoder
from edge.roles.prefill import PrefillWorker
from edge.sampling import SamplingParams

log = logging.getLogger(__name__)


def _params(d: dict) -> SamplingParams:
    return SamplingParams(d["temperature"], d["top_k"], d["top_p"], d["seed"])


class _Node:
    """Hello, drop counters, a replay guard on request ids, the worker thread."""
    role = ""

    def __init__(self, link: Link, worker_id: str, ctl_key: Optional[bytes], hello_every: float):
        self.link, self.id, self.ctl_key, self.hello_every = link, worker_id, ctl_key, hello_every
        self.dropped: Dict[str, int] = {}
        self.served = 0                                   # jobs / assignments taken (SunHello.served)
        self._seen: deque = deque(maxlen=65536)           # recent request ids: a replayed job is dropped
        self._seen_set: set = set()
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._said: Optional[tuple] = None
        self._said_at = 0.0

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _fresh(self, rid: str) -> bool:
        if rid in self._seen_set:
            self.drop("replay")
            return False
        if len(self._seen) == self._seen.maxlen:
            self._seen_set.discard(self._seen[0])
        self._seen.append(rid)
        self._seen_set.add(rid)
        return True

    def _hello(self, online: bool = True) -> SunHello:
        raise NotImplementedError

    def will(self) -> bytes:
        """The SunHello(online=False) to set as the link's will (before connect)."""
        return encode(self._hello(online=False), self.ctl_key)

    def hello(self, force: bool = True) -> None:
        h = self._hello()
        key = (h.load, h.served)
        now = time.monotonic()
        if force or key != self._said or now - self._said_at >= self.hello_every:
            self._said, self._said_at = key, now
            self.link.publish(sun_hello_topic(self.id), encode(h, self.ctl_key), kind="status")

    def start(self):
        self.link.subscribe(sun_ctl_topic(self.id), self._on_ctl)
        self._subscribe_more()
        self.link.on_connection(lambda up: up and self.hello())
        self._thread = threading.Thread(target=self._run, name=f"sun-{self.role}-{self.id}", daemon=True)
        self._thread.start()
        self.hello()
        return self

    def _subscribe_more(self) -> None:
        pass

    def stop(self, announce: bool = True) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread is not None:
            self._thread.join(10)
        if announce:
            try:
                self.link.publish(sun_hello_topic(self.id), self.will(), kind="status")
            except Exception:
                pass

    def _on_ctl(self, topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, self.ctl_key)
        except ProtocolError as e:
            self.drop(f"ctl_{e.code}")
            return
        self._q.put(("ctl", msg))

    def _send(self, topic: str, msg, secret: bytes) -> None:
        self.link.publish(topic, encode(msg, secret), kind="control")

    def _run(self) -> None:
        raise NotImplementedError


class PrefillNode(_Node):
    """One task's prefill worker: PrefillJob -> token 0 to the client, KV chunks to the decoder."""
    role = "prefill"

    def __init__(self, worker: PrefillWorker, link: Link, worker_id: str, ctl_key: Optional[bytes] = None,
                 hello_every: float = 2.0, chunk_bytes: int = SUN_CHUNK_BYTES):
        super().__init__(link, worker_id, ctl_key, hello_every)
        if not 0 < chunk_bytes <= SUN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{SUN_CHUNK_BYTES}")
        self.worker, self.chunk_bytes = worker, chunk_bytes
        self.stats = {"jobs": 0, "failed": 0, "kv_bytes": 0, "chunks": 0, "prefill_s": 0.0}
        self._busy = 0

    def _hello(self, online: bool = True) -> SunHello:
        w = self.worker
        return SunHello(self.id, "prefill", w.task, w.decoder_fingerprint, w.engine.vocab_size, online,
                        self._q.qsize() + self._busy, 1, self.served)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=self.hello_every)
            except queue.Empty:
                self.hello(force=False)
                continue
            if item is None:
                return
            msg = item[1]
            if not isinstance(msg, PrefillJob) or msg.worker != self.id:
                self.drop("not_mine")
                continue
            if msg.task != self.worker.task:
                self.drop("wrong_task")
                continue
            if not self._fresh(msg.rid):
                continue
            self.served += 1
            self._busy = 1
            try:
                self._serve(msg)
            except Exception as e:  # one bad job must not end the worker
                log.exception("prefill %s: request %s failed", self.id, msg.rid)
                self._fail(msg, E_INTERNAL, f"prefill worker {self.id} failed: {e}")
            finally:
                self._busy = 0
            self.hello(force=False)

    def _serve(self, job: PrefillJob) -> None:
        try:
            out = self.worker.prefill(job.prompt, request_id=job.rid, params=_params(job.sampling))
        except (ValueError, RuntimeError) as e:           # empty prompt, context full, bad ids
            self._fail(job, "bad_request", f"prefill of task {job.task!r} refused the prompt: {e}")
            return
        self.stats["jobs"] += 1
        self.stats["prefill_s"] += out.prefill_s
        self._send(sun_stream_topic(job.client, job.rid),
                   SunTokens(job.rid, 0, 0, [out.first_token], worker=self.id), job.secret)
        blob, n = out.blob, self.chunk_bytes
        total = max(1, math.ceil(len(blob) / n))
        for i in range(total):
            self._send(sun_kv_topic(job.decoder),
                       KVChunk(job.rid, i, total, out.first_token, blob[i * n:(i + 1) * n]), job.secret)
        self.stats["kv_bytes"] += len(blob)
        self.stats["chunks"] += total

    def _fail(self, job: PrefillJob, code: str, message: str) -> None:
        self.stats["failed"] += 1
        err = Error(job.rid, 0, code, message[:1024])
        self._send(sun_stream_topic(job.client, job.rid), err, job.secret)
        self._send(sun_kv_topic(job.decoder), err, job.secret)   # frees the decoder's reservation


def open_node(role: str, link: Link, directory, worker_id: str, task: Optional[str] = None,
              threads: Optional[int] = None, max_batch: int = 64, stop_ids: Sequence[int] = (),
              ctl_key: Optional[bytes] = None, backend: str = "torch"):
    """Load a specialist (role prefill) or the shared decoder (role decoder) from its directory,
    set the node's will on `link`, connect and start it. `edge-agent run --role prefill|decoder`."""
    if role == "prefill":
        node = PrefillNode(PrefillWorker.from_dir(directory, task=task, threads=threads, backend=backend), link,
                           worker_id, ctl_key=ctl_key)
    elif role == "decoder":
        from edge.roles.decoder_node import DecoderNode
        dec = SharedDecoder.from_dir(directory, threads=threads, max_batch=max_batch, stop_ids=stop_ids,
                                     name=worker_id, backend=backend)
        node = DecoderNode(dec, link, worker_id, ctl_key=ctl_key)
    else:
        raise ValueError(f"role must be 'prefill' or 'decoder', got {role!r}")
    link.set_will(sun_hello_topic(worker_id), node.will())
    link.connect(timeout=10)
    return node.start()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m edge.roles.sun_nodes --role decoder --hub mqtt://H:P DIR`: one SUN worker until SIGTERM."""
    import argparse
    import signal

    from edge.link import MqttLink
    ap = argparse.ArgumentParser(prog="python -m edge.roles.sun_nodes", description=main.__doc__)
    ap.add_argument("directory", help="specialist (prefill) or shared decoder directory")
    ap.add_argument("--role", required=True, choices=["prefill", "decoder"])
    ap.add_argument("--hub", required=True, help="mqtt://HOST:PORT of the hub's broker")
    ap.add_argument("--id", required=True, help="worker id (with the hub's ACL: the username)")
    ap.add_argument("--task", default=None, help="prefill: task name (default: the manifest's)")
    ap.add_argument("--username", default=None)
    ap.add_argument("--password", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=64)
    a = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    link = MqttLink(a.hub, username=a.username, password=a.password)
    node = open_node(a.role, link, a.directory, a.id, task=a.task, threads=a.threads, max_batch=a.max_batch)
    print(f"{a.role} {a.id} up at {a.hub}", flush=True)
    while not stop.wait(3600):
        pass
    node.stop()
    link.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
