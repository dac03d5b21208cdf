"""A SUN prefill worker on the MQTT star: PrefillJob -> token 0 to the client, KV chunks to the decoder.

Flow of one request (topics in edge/wire/protocol.py; the router is server/sun_router.py,
the decoder edge/sun/decoder_node.py, the client edge/sun/client.py):

    client --SunRequest--> router --DecodeAssign--> decoder      (reserve, with the secret)
                                  --PrefillJob----> prefill      (then: prompt -> KV + token 0)
    prefill --SunTokens(token 0)--> client          (time to first token without a decoder hop)
    prefill --KVChunk x n---------> decoder         (signed with the request's secret)
    decoder --SunTokens(1..)------> client          (continuous batching across all tasks)

A prefill worker with adapters (edge/sun/adapter_prefill.py) serves every task it holds an
adapter for: its hello lists them (SunHello.tasks) and a job of any of them is queued with its
task, so one step may prefill rows of several tasks. An AdapterAdd on its ctl topic (signed with
the ctl key: a worker without one refuses it) loads one more adapter while it serves; the answer,
AdapterResult (loaded, or refused with why), goes to ss/sun/r/{client}/{rid} signed with the ctl
key, and a loaded task is announced at once with a fresh hello.

Both SUN nodes announce themselves with a retained SunHello (the will says
online=False) and re-announce whenever their load changes, which is what the
router's least-loaded choice reads. KV chunks and tokens go at QoS 1: a lost
chunk would cost the request, a lost token would leave a hole in the answer.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Dict, Optional

from edge.wire.link import Link
from edge.wire.protocol import (E_BAD_REQUEST, E_INTERNAL, E_OVERLOADED, SUN_CHUNK_BYTES, AdapterAdd, AdapterResult,
                                Error, KVChunk, PrefillJob, SunHello, SunTokens, encode, sun_ctl_topic,
                                sun_hello_topic, sun_kv_topic, sun_stream_topic)
from edge.wire.field_types import MAX_SEQ
from edge.runtime.node import Node
from edge.sun.prefill import PrefillFailed, PrefillOutput, PrefillWorker
from edge.sun.prompt_queue import QueueFull
from edge.sun.token_rules import GrammarRefused
from edge.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_DELIVERED = 1024           # jobs answered lately whose copies are still answered "held"


class PrefillNode(Node):
    """A prefill worker on the star: one task's specialist, or a base with many tasks' adapters."""
    role = "prefill"

    def __init__(self, worker: PrefillWorker, link: Link, worker_id: str, ctl_key: Optional[bytes] = None,
                 hello_every: float = 2.0, chunk_bytes: int = SUN_CHUNK_BYTES, local_decoders=None):
        """local_decoders: {decoder id: DecoderNode} in this process (edge/sun/colocated.py): the KV
        of a job assigned to one is handed to it directly, not through the broker."""
        if not 0 < chunk_bytes <= SUN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{SUN_CHUNK_BYTES}")
        super().__init__(worker, link, worker_id, ctl_key, hello_every, idle_wait=hello_every)
        self.worker, self.chunk_bytes = worker, chunk_bytes
        self.stats = {"jobs": 0, "failed": 0, "overloaded": 0, "kv_bytes": 0, "chunks": 0, "prefill_s": 0.0,
                      "adapters_added": 0, "adapters_refused": 0}
        self._jobs: Dict[str, PrefillJob] = {}            # taken, not yet answered
        self._held: Dict[str, PrefillJob] = {}            # arrived (queued, taken or in the step), not answered
        self._held_notices = 0                            # "still held here" answers to copies of those
        self._delivered: "OrderedDict[str, PrefillJob]" = OrderedDict()   # answered lately (bounded)
        self.local_decoders = dict(local_decoders or {})
        self.stats["local_kv"] = 0                        # jobs whose KV stayed in this process

    @property
    def load(self) -> int:
        """Jobs received and not yet answered: in the loop's inbox, queued, or in the step now running.
        The worker's own load counts only its queue, and a step takes up to 8 prompts off it at once
        (adapters; one on a full copy): a hello from the heartbeat during a long step said 0, and the
        router, taking that for idle, forgot the jobs held here and stopped passing their clients'
        copies on, so each was sent again under a new id and prefilled twice (issue 45: 31 prefills
        for 17 requests in the split layout's burst)."""
        return self.loop.backlog() + len(self._jobs)

    def telemetry(self) -> dict:
        """The node's counters plus jobs queued; each prefill produces an answer's first token."""
        return {**super().telemetry(), "sessions": self.load, "tokens": self.stats["jobs"]}

    # ---- the node's hooks ----
    def hello_topic(self) -> str:
        return sun_hello_topic(self.id)

    def ctl_topic(self) -> str:
        return sun_ctl_topic(self.id)

    def status(self, online: bool = True) -> SunHello:
        w = self.worker
        return SunHello(self.id, "prefill", w.task, w.decoder_fingerprint, w.engine.vocab_size, online,
                        self.load, 1, self.served, w.max_queue, tasks=list(w.tasks), grammars=w.grammars is not None)

    def status_key(self):
        return self.load, self.served, tuple(self.worker.tasks)

    def handle(self, kind: str, msg) -> None:
        if isinstance(msg, AdapterAdd) and msg.worker == self.id:
            if self.fresh(msg.rid):
                self._add_adapter(msg)
        elif not isinstance(msg, PrefillJob) or msg.worker != self.id:
            self.drop("not_mine")
        elif msg.task not in self.worker.tasks:
            self._held.pop(msg.rid, None)
            self.drop("wrong_task")
        elif not self.fresh(msg.rid):
            self._held.pop(msg.rid, None)                 # answered before: not held here
        else:
            self.served += 1
            try:
                self.worker.submit(msg.prompt, msg.rid, SamplingParams.from_wire(msg.sampling), task=msg.task,
                                   grammar=msg.grammar, logprobs=msg.logprobs)
            except QueueFull as e:                        # tells the client and frees the decoder's slot
                self._held.pop(msg.rid, None)
                self.stats["overloaded"] += 1
                self._fail(msg, E_OVERLOADED, str(e))
                return
            except GrammarRefused as e:                   # no tokenizer here, or llguidance refuses it
                self._held.pop(msg.rid, None)
                self._fail(msg, E_BAD_REQUEST, f"prefill worker {self.id} cannot follow the request's grammar: {e}")
                return
            self._jobs[msg.rid] = msg

    def publish(self, out) -> None:
        self._held.pop(out.request_id, None)
        job = self._jobs.pop(out.request_id, None)
        if job is None:
            return
        if isinstance(out, PrefillFailed):
            if out.refused:
                self._fail(job, E_BAD_REQUEST, f"prefill of task {job.task!r} refused the prompt: {out.reason}")
            else:
                self._fail(job, E_INTERNAL, f"prefill worker {self.id} failed: {out.reason}")
            return
        try:
            self._deliver(job, out)
            self._delivered[job.rid] = job
            while len(self._delivered) > MAX_DELIVERED:
                self._delivered.popitem(last=False)
        except Exception as e:                            # one bad job must not end the worker
            log.exception("prefill %s: request %s failed", self.id, job.rid)
            self._fail(job, E_INTERNAL, f"prefill worker {self.id} failed: {e}")

    # ---- adapters added while serving ----
    def _add_adapter(self, msg: AdapterAdd) -> None:
        """Load the adapter (checked) or refuse it; either way say so to the sender, and keep serving."""
        add = getattr(self.worker, "add", None)
        if add is None:
            ok, why = False, (f"prefill worker {self.id} runs one full-copy specialist ({self.worker.task!r}); "
                              "start it with a base and adapters (--adapter task=DIR, or a bundle with adapters)")
        elif self.ctl_key is None:
            ok, why = False, (f"prefill worker {self.id} has no control key: adapters are added only by signed "
                              "control messages; restart it with --ctl-key-file")
        else:
            try:
                add(msg.task, msg.path, sha256=msg.sha256, bundle=msg.bundle)
                ok, why = True, f"task {msg.task!r} served"
            except Exception as e:                        # a bad adapter is refused; the worker serves on
                ok, why = False, f"adapter for task {msg.task!r} refused: {e}"
        self.stats["adapters_added" if ok else "adapters_refused"] += 1
        log.log(logging.INFO if ok else logging.WARNING, "prefill %s: %s (from %s)", self.id, why, msg.path)
        answer = AdapterResult(self.id, msg.rid, msg.task, ok, why[:1024], tasks=list(self.worker.tasks))
        self.link.publish(sun_stream_topic(msg.client, msg.rid), encode(answer, self.ctl_key), kind="control")
        if ok:
            self.hello()                                  # the router routes the new task from now on

    def answer_on_arrival(self, msg) -> bool:
        """A copy of a job held here (in the loop's inbox, queued, or in the step now running -- a
        burst of long prompts holds one for minutes): its client heard nothing and sent it again.
        Tell it the job is held (no tokens; a seq of its own, counted down from the largest: never a
        decoder's), so it waits instead of sending it under a new id, which would prefill a request
        that was only slow twice (edge/sun/client.py). Runs in the link's thread: the loop may be
        inside a step, and the first arrival may still wait in its inbox.
        A copy of a job answered lately is answered the same way: its first token and KV went out,
        and its decoder may not have admitted it yet (the KV on its way or queued behind a step),
        when nobody else would answer (the split layout's 64-task burst prefilled 31 jobs for 17
        requests). A KV lost on the way still ends as the decoder's timeout, which the client retries."""
        if not isinstance(msg, PrefillJob) or msg.worker != self.id:
            return False
        job = self._delivered.get(msg.rid) or self._held.setdefault(msg.rid, msg)
        if job is msg:                                    # the first arrival: the loop takes it
            return False
        self.drop("replay")
        self._held_notices += 1
        self.send(sun_stream_topic(job.client, job.rid), SunTokens(job.rid, MAX_SEQ - self._held_notices, 0, []),
                  job.secret)
        return True

    # ---- answers ----

    def _deliver(self, job: PrefillJob, out: PrefillOutput) -> None:
        self.stats["jobs"] += 1
        self.stats["prefill_s"] += out.prefill_s
        self.send(sun_stream_topic(job.client, job.rid),
                  SunTokens(job.rid, 0, 0, [out.first_token], worker=self.id,
                            logprobs=[out.logprob] if out.logprob is not None else []), job.secret)
        blob, n = out.blob, self.chunk_bytes
        total = max(1, math.ceil(len(blob) / n))
        for i in range(total):
            self._send_kv(job, KVChunk(job.rid, i, total, out.first_token, blob[i * n:(i + 1) * n]))
        self.stats["local_kv"] += job.decoder in self.local_decoders
        self.stats["kv_bytes"] += len(blob)
        self.stats["chunks"] += total

    def _fail(self, job: PrefillJob, code: str, message: str) -> None:
        self.stats["failed"] += 1
        err = Error(job.rid, 0, code, message[:1024])
        self.send(sun_stream_topic(job.client, job.rid), err, job.secret)
        self._send_kv(job, err)                          # frees the decoder's reservation

    def _send_kv(self, job: PrefillJob, msg) -> None:
        """A KV chunk (or the Error) for the job's decoder, signed with its secret: handed over in
        process to a local decoder, else published."""
        local = self.local_decoders.get(job.decoder)
        if local is not None:
            local.take_kv(self.id, encode(msg, job.secret))
        else:
            self.send(sun_kv_topic(job.decoder, self.id), msg, job.secret)
