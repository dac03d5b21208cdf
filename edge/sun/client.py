"""The requesting side of SUN: send a request naming a task, collect its signed token stream.

A request carries a fresh secret drawn here (edge/wire/protocol.py explains the
keys); the prefill worker's token 0 and the decoder's tokens 1.. arrive on
ss/sun/r/{client}/{rid}, possibly out of order between the two senders, and
are handed to `on_token` in answer order. Each sender's seq is accepted once,
so a replayed message is dropped and counted; a forged one fails its HMAC.

When the router says a worker died holding the request (worker_lost), or its decoder says
its KV cache never came (timeout: lost on the way, e.g. while the decoder's link moved to
another broker node), a request whose tokens cannot change (greedy, or seeded sampling) is
sent again under a new id (`retries` times): it is prefilled again and lands on a live
decoder; the tokens already handed out are not repeated, and the new stream must agree with
them (else the request fails, it never hands out a changed token).

A request that hears nothing for `claim_s` (no token, no error) is sent again as the SAME
request -- same id, same secret -- after claim_s, 2 claim_s, 4 claim_s ... (at most `reasks`
times in a row; any token starts the count again). Why the same id: the copy is idempotent
everywhere. No router routed the first one (of two hubs, none claimed this client yet: a
starting hub claims its clients two status periods late, a dead hub's are claimed when its
will arrives; or the router's link was moving): the owner routes the copy now. A router did
route it: its replay memory stops a second routing, and it hands the same job and assignment
again to the workers it chose (server/sun_routes.py), who drop what they hold already and take
what was lost on the way (a worker's link that moved to another broker node). So nothing runs
twice and no work is wasted on a request that is merely slow. A new id would be routed anew
by the same router: the slow request would be prefilled and decoded twice. Only when SAME_COPIES
copies brought nothing (a loss that no worker still counted as holding: seen once on a RabbitMQ
cluster when a node died) is it sent under a new id, as after a lost worker (from `retries`).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from edge.wire.link import Link
from edge.wire.protocol import (E_TIMEOUT, E_WORKER_LOST, GREEDY_WIRE, Error, ProtocolError, SunRequest, SunTokens, decode, encode,
                           new_secret, new_sid, parse_topic, sampling, sun_req_topic, sun_stream_sub)
from edge.speculative.sampling import SamplingParams

log = logging.getLogger(__name__)
# the errors after which the same request, sent again under a new id, can still succeed: its
# worker died (worker_lost), or its KV cache was lost on the way to its decoder (timeout)
RETRYABLE = frozenset({E_WORKER_LOST, E_TIMEOUT})
CLAIM_S = 2.0                  # silence after which a request is sent again (the hubs' status period)
REASKS = 6                     # copies in a row (2+4+...+64 s of silence at claim_s 2)
SAME_COPIES = 2                # then (2+4 s: past a starting hub's claim) a new id, if retries are left


class SunRequestError(RuntimeError):
    """The star could not serve a request; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class SunResult:
    rid: str
    task: str
    tokens: List[int]
    finish_reason: str
    workers: List[str]             # who produced them: the prefill worker, then the decoder
    ttft_s: float
    total_s: float
    logprobs: List[Optional[tuple]] = field(default_factory=list)   # per token (logprob, [(id, lp)]), if asked


class SunHandle:
    """One request in flight; tokens arrive in order through on_token, wait() gives the result."""

    def __init__(self, req: SunRequest, on_token: Optional[Callable[[int, int], None]], retries: int = 0,
                 resend: Optional[Callable[["SunHandle"], None]] = None):
        self.req, self.on_token = req, on_token
        self.retries, self._resend = retries, resend
        self.resent = 0                   # times it was sent again (new id) after a lost worker or KV
        self.reasked = 0                  # copies of it sent after silence (same id)
        self._quiet = 0                   # ... since it last heard something
        self.heard = time.monotonic()     # when it was last sent or heard of
        self.rid, self.task = req.rid, req.task
        self.t0 = time.perf_counter()
        self.t_first: Optional[float] = None
        self._tokens: Dict[int, int] = {}
        self._entries: Dict[int, tuple] = {}   # index -> (logprob, [(id, logprob), ...]), when asked
        self._told = 0
        self._total: Optional[int] = None
        self._reason = ""
        self._seqs: set = set()
        self._workers: List[str] = []
        self._error: Optional[SunRequestError] = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def _take(self, msg) -> bool:
        """False for a replay (a seq seen before)."""
        with self._lock:                                  # the client's watchdog may send it again meanwhile
            return self._take_locked(msg)

    def _renew(self) -> bool:
        """Send it again under a new id, if it may be (retries left, same tokens again); with _lock."""
        if not (self.retries > 0 and self._resend and self._replayable()) or self._done.is_set():
            return False
        self.retries -= 1
        self.resent += 1
        self._seqs, self._workers, self._total = set(), [], None
        self._tokens = {i: t for i, t in self._tokens.items() if i < self._told}
        self.heard, self._quiet = time.monotonic(), 0
        self._resend(self)                                # a new id: the old stream's late tokens are dropped
        return True

    def _take_locked(self, msg) -> bool:
        if isinstance(msg, Error):
            if msg.code in RETRYABLE and self._renew():
                return True
            self._error = SunRequestError(msg.code, msg.message)
            self._done.set()
            return True
        if msg.seq in self._seqs:
            return False
        self._seqs.add(msg.seq)
        self.heard, self._quiet = time.monotonic(), 0
        if msg.worker and msg.worker not in self._workers:
            # pipeline order, not arrival order: the prefill's token 0 may come after the decoder's
            # first tokens (two links race); a decoder's index-0 message is its done echo
            self._workers.insert(0 if msg.index == 0 and not msg.done else len(self._workers), msg.worker)
        for i, t in enumerate(msg.tokens, msg.index):
            if self.resent and i < self._told and self._tokens[i] != t:
                self._error = SunRequestError("diverged", f"request {self.rid} was sent again after a lost "
                                              f"worker and its token {i} differs from the one handed out")
                self._done.set()
                return True
            self._tokens.setdefault(i, t)                 # the decoder may echo token 0 when it ends at once
            if msg.logprobs:
                lp, ids, lps = msg.logprobs[i - msg.index]
                self._entries.setdefault(i, (lp, list(zip(ids, lps))))
        if self.t_first is None and 0 in self._tokens:
            self.t_first = time.perf_counter()
        if msg.done:
            self._total, self._reason = msg.index + len(msg.tokens), msg.finish_reason
        while self._told in self._tokens and (self._total is None or self._told < self._total) \
                and self._entry_known(self._told):
            if self.on_token:
                self.on_token(self._told, self._tokens[self._told])
            self._told += 1
        if self._total is not None and self._told >= self._total:
            self._done.set()
        return True

    def _entry_known(self, i: int) -> bool:
        """Token i may be handed out: no logprobs asked, or its entry is here. Token 0's comes with the
        prefill's message; a decoder that ends at once echoes token 0 without one (it may come first)."""
        return self.req.logprobs is None or i in self._entries or i > 0

    def entry(self, i: int) -> Optional[tuple]:
        """Token i's (logprob, [(id, logprob), ...]), when the request asked for logprobs."""
        return self._entries.get(i)

    def _quiet_past(self, now: float, claim_s: float, reasks: int) -> bool:
        """Heard nothing for claim_s * 2**(copies sent since): time to send the same request again."""
        return not self._done.is_set() and self._quiet < reasks and now - self.heard >= claim_s * 2 ** self._quiet

    def _replayable(self) -> bool:
        """Sent again, it gives the same tokens: greedy, or sampling with a seed."""
        sp = self.req.sampling
        return not self._told or float(sp.get("temperature", 0.0)) == 0.0 or sp.get("seed") is not None

    def wait(self, timeout: float = 60.0) -> SunResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"SUN request {self.rid} (task {self.task!r}) got {self._told} tokens and no "
                               f"end within {timeout:g} s: is the hub's SUN router running, and a decoder?")
        if self._error is not None:
            raise self._error
        n = self._total or 0
        now = time.perf_counter()
        return SunResult(self.rid, self.task, [self._tokens[i] for i in range(n)], self._reason,
                         list(self._workers), (self.t_first or now) - self.t0, now - self.t0,
                         [self._entries.get(i) for i in range(n)] if self.req.logprobs is not None else [])


class SunClient:
    """Sends SunRequests for `client_id` and collects their signed token streams."""

    def __init__(self, link: Link, client_id: str, retries: int = 2, claim_s: float = CLAIM_S,
                 reasks: int = REASKS):
        """retries: how often a request is sent again (new id) after its worker died or its KV was lost;
        claim_s: silence after which it is sent again as the same request (0: never), `reasks` times."""
        self.link, self.client, self.retries = link, client_id, retries
        self.claim_s, self.reasks = claim_s, reasks
        self._handles: Dict[str, SunHandle] = {}
        self._lock = threading.Lock()
        self.dropped: Dict[str, int] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

    def start(self) -> "SunClient":
        self.link.subscribe(sun_stream_sub(self.client), self._on_stream)
        if self.claim_s > 0 and self._watchdog is None:
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name=f"sun-client-{self.client}", daemon=True)
            self._watchdog.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        self._watchdog = None
        self.link.unsubscribe(sun_stream_sub(self.client))

    def _watch(self) -> None:
        tick = min(0.25, self.claim_s / 4)
        while not self._stop.wait(tick):
            try:
                self.reask_quiet()
            except Exception:                              # a failed publish must not end the watchdog
                log.debug("sun client %s: sending a quiet request again failed", self.client, exc_info=True)

    def reask_quiet(self, now: Optional[float] = None) -> int:
        """Send again, as the same request (same id and secret), each request quiet past its wait
        (the module docstring says why the same id); returns how many. The watchdog calls it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [h for h in set(self._handles.values()) if h._quiet_past(now, self.claim_s, self.reasks)]
        for h in due:
            with h._lock:
                if not h._quiet_past(now, self.claim_s, self.reasks):
                    continue
                if h._quiet >= SAME_COPIES and h._renew():
                    log.info("sun client %s: request %s heard nothing after %d copies: sent again as %s",
                             self.client, h.task, SAME_COPIES, h.rid)
                    continue
                h.reasked, h._quiet, h.heard, req = h.reasked + 1, h._quiet + 1, now, h.req
            log.debug("sun client %s: request %s heard nothing: sent again", self.client, req.rid)
            self.link.publish(sun_req_topic(self.client), encode(req), kind="control")
        return len(due)

    def submit(self, task: str, prompt: Sequence[int], max_new: int = 64, sampling: Optional[dict] = None,
               stop: Sequence[int] = (), on_token: Optional[Callable[[int, int], None]] = None,
               grammar: str = "", logprobs: Optional[int] = None) -> SunHandle:
        """grammar: llguidance's text every answer token follows ("": none); logprobs: alternatives
        per token to report (None: none; SunHandle.entry / SunResult.logprobs give them)."""
        req = SunRequest(self.client, f"{new_sid()}{next(self._ids)}", task, [int(t) for t in prompt],
                         max_new, dict(sampling or GREEDY_WIRE), [int(s) for s in stop], new_secret(),
                         grammar, logprobs)
        payload = encode(req)                              # raises ProtocolError for a bad request
        h = SunHandle(req, on_token, self.retries, self._resend)
        with self._lock:
            self._handles[req.rid] = h
        self.link.publish(sun_req_topic(self.client), payload, kind="control")
        return h

    def _resend(self, h: SunHandle) -> None:
        """Send `h` again under a new id and secret (the router prefills it anew, on live workers)."""
        old = h.req
        req = SunRequest(self.client, f"{new_sid()}{next(self._ids)}", old.task, old.prompt, old.max_new,
                         old.sampling, old.stop, new_secret(), old.grammar, old.logprobs)
        with self._lock:
            self._handles.pop(old.rid, None)
            self._handles[req.rid] = h
            h.req, h.rid = req, req.rid
        self.link.publish(sun_req_topic(self.client), encode(req), kind="control")

    def generate(self, task: str, prompt: Sequence[int], max_new: int = 64, timeout: float = 60.0,
                 **kw) -> SunResult:
        h = self.submit(task, prompt, max_new, **kw)
        try:
            return h.wait(timeout)
        finally:
            self.forget(h.rid)

    def stream(self, task: str, prompt: Sequence[int], max_new: int, params: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] = (), on_token: Optional[Callable[[int], None]] = None,
               timeout: float = 120.0, grammar: str = "", logprobs: Optional[int] = None,
               on_logprob: Optional[Callable[[int, float, list], None]] = None) -> SunResult:
        """Generate with `on_token` called in THIS thread (it may raise to stop early: the request
        then runs out on the decoder and its tokens are dropped). The signature of
        StarTarget.generate with the task first, so edge/api/openai_http.py can front the SUN star.
        With logprobs, on_logprob(token, logprob, [(id, logprob), ...]) comes just before on_token."""
        tokens: queue.Queue = queue.Queue()
        sp = sampling(params.temperature, params.top_k, params.top_p, params.seed)
        h = self.submit(task, prompt, max_new, sampling=sp, stop=stop_ids, grammar=grammar, logprobs=logprobs,
                        on_token=lambda i, t: tokens.put((i, t)))
        end = time.monotonic() + timeout
        try:
            while True:
                try:
                    t = tokens.get(timeout=0.05)
                except queue.Empty:
                    if h._done.is_set() and tokens.empty():
                        return h.wait(0)                   # raises the request's error, if any
                    if time.monotonic() > end:
                        return h.wait(0)                   # raises the timeout with what arrived
                    continue
                i, t = t
                entry = h.entry(i)                         # set before token i was handed out
                if on_logprob is not None and entry is not None:
                    on_logprob(t, entry[0], entry[1])
                if on_token is not None:
                    on_token(t)
        finally:
            self.forget(h.rid)

    def forget(self, rid: str) -> None:
        with self._lock:
            self._handles.pop(rid, None)

    def _drop(self, why: str) -> None:
        n = self.dropped[why] = self.dropped.get(why, 0) + 1
        # the first of each reason is worth a warning; a flood of them only a debug line each
        log.log(logging.WARNING if n == 1 else logging.DEBUG, "sun client %s: dropped a stream message (%s; "
                "%d so far)", self.client, why, n)

    def _on_stream(self, topic: str, payload: bytes) -> None:
        try:
            _, ids = parse_topic(topic)
        except ProtocolError:
            self._drop("topic")
            return
        with self._lock:
            h = self._handles.get(ids["rid"])
        if h is None:
            self._drop("unknown_request")
            return
        try:
            msg = decode(payload, h.req.secret)
        except ProtocolError as e:
            self._drop(e.code)
            return
        if (msg.rid if isinstance(msg, SunTokens) else getattr(msg, "sid", None)) != h.rid \
                or not isinstance(msg, (SunTokens, Error)):
            self._drop("invalid")
            return
        if not h._take(msg):
            self._drop("replay")
