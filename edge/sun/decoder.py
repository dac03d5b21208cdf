"""SUN shared decoder: continues KV blobs from ANY specialist tuned for it, batched together.

`admit` validates a blob (it must name this decoder's fingerprint, be complete
and match the model's shapes) and queues the sequence; a refused blob raises
`AdmissionError` with the reason and leaves every admitted sequence untouched.
An engine that holds a fixed number of sequences (llama.cpp: `capacity`) keeps
the validated blobs of the rest waiting; they join as running ones finish.
`step` advances up to `max_batch` running sequences by one token with ONE
batched engine call, whatever task each came from (continuous batching: new
admissions join at the next step, finished ones leave at once). Tokens stream
through per-request callbacks and the events `step` returns.

The first answer token comes from the prefill worker (it is fed here as the
first decode input); `DecodeResult.tokens` holds the whole answer, first token
included; events are emitted only for the tokens this decoder generates.

The decoder is a core for edge/runtime/loop.py (the SUN decoder node runs it):
`admit` is its submit, `step` its step, `cancel` drops a request. A sequence
whose context is full finishes ("context"); one the engine refuses in a batch
finishes alone ("error"); the rest of the batch goes on either way.

`max_sequences` bounds what it holds, running and waiting together: past it `admit` raises
`DecoderFull` (the node answers `overloaded`), so a flood queues nowhere without bound -- not
in the engine (torch/onnx hold any number of sequences) nor in llama.cpp's waiting line.

A request may carry a grammar and ask for logprobs (edge/sun/token_rules.py): after the one
batched engine call, each row is masked by its own request's grammar before its token is drawn,
and its logprob entry read from that row; rows without either are drawn as before. This is
numpy over the rows the engine returns, so it holds on every backend (torch, onnxruntime,
llama.cpp). A decoder built without `grammars` (no tokenizer) refuses a request with a grammar.
"""
from __future__ import annotations

import itertools
import numbers
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence

import numpy as np

from edge.engines.base import Engine, EngineError
from edge.model.kv_blob import KVError, read_header
from edge.runtime.isolated_step import step_isolated
from edge.sun.worker_limits import DEFAULT_MAX_SEQUENCES
from edge.speculative.constrained import NoTokenAllowed
from edge.speculative.sampling import GREEDY, Role, SamplingParams, role_rng
from edge.sun.token_rules import GrammarRefused, RowRules, SunGrammars, choose, compile_grammar


class AdmissionError(ValueError):
    """A KV blob this decoder will not serve (other decoder, truncated, wrong shapes, bad request)."""


class DecoderFull(AdmissionError):
    """The decoder holds max_sequences already: retry later or elsewhere."""


@dataclass
class TokenEvent:
    request_id: str
    token: int
    index: int                  # position in the answer (0 = the prefill's first token)
    done: bool
    finish_reason: Optional[str] = None   # "stop", "length", "context" or "error" when done
    logprob: Optional[tuple] = None       # (logprob, [(id, logprob), ...]) when the request asked


@dataclass
class DecodeResult:
    request_id: str
    task: str
    tokens: List[int]
    finish_reason: str
    admitted_at: float
    first_step_at: Optional[float]
    finished_at: float


@dataclass(eq=False)
class _Running:
    rid: str
    task: str
    seq: Optional[int]          # engine handle; None while waiting for a slot
    next_input: int
    tokens: List[int]
    max_new: int
    params: SamplingParams
    stops: frozenset
    rng: Optional[np.random.Generator]
    on_token: Optional[Callable[[TokenEvent], None]]
    admitted_at: float
    first_step_at: Optional[float] = None
    rules: Optional[RowRules] = None      # its grammar and logprobs (None: neither)


class SharedDecoder:
    """The decoder core (an edge.runtime.core.EngineCore): one batched decode step at a time."""

    def __init__(self, engine: Engine, max_batch: int = 64, stop_ids: Sequence[int] = (),
                 name: str = "decoder", clock: Callable[[], float] = time.perf_counter,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES, grammars: Optional[SunGrammars] = None):
        """grammars: the base tokenizer's grammars (edge/sun/token_rules.py); None: requests with a
        grammar are refused."""
        if max_batch < 1 or max_sequences < 1:
            raise ValueError("max_batch and max_sequences must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.max_sequences = max_sequences      # running + waiting
        self.stop_ids = frozenset(int(s) for s in stop_ids)
        self.name = name
        self.grammars = grammars
        self.clock = clock
        self._run: Dict[str, _Running] = {}
        self._order: Deque[str] = deque()      # round-robin when more than max_batch are running
        self._waiting: Deque[tuple] = deque()  # (_Running, blob): admitted, no engine slot yet
        self.results: Dict[str, DecodeResult] = {}
        self.refused = 0
        self.steps = 0
        self.tokens_out = 0
        self.rows_out = 0                      # sequences stepped, summed over steps (mean batch)
        self.mixed_steps = 0                   # steps whose batch held more than one task
        self.batches: Deque[tuple] = deque(maxlen=4096)   # the tasks of each recent step's rows
        self._ids = itertools.count(1)

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    @property
    def load(self) -> int:
        """Running and waiting sequences (what least-loaded routing compares)."""
        return len(self._run) + len(self._waiting)

    @classmethod
    def from_dir(cls, directory, threads: Optional[int] = None, backend: str = "torch",
                 engine_kw: Optional[dict] = None, **kw) -> "SharedDecoder":
        """Load a decoder saved by export.tune.save_decoder (its weights must match its fingerprint),
        or its decoder artifact from a bundle on backend onnx/llamacpp. engine_kw: where it runs
        (edge/engines/placement.py's Placement.engine_kwargs(): device / providers / n_gpu_layers)."""
        engine_kw = dict(engine_kw or {})
        from edge.model.sun_error import SunError
        if backend != "torch":
            from edge.sun.prefill import _bundle_engine
            # a llama.cpp context holds a fixed number of sequences: one per batch row
            extra = {"n_seq_max": kw.get("max_batch", 64)} if backend == "llamacpp" else {}
            extra.update(engine_kw)
            engine = _bundle_engine(directory, backend, "decoder", threads, **extra)
            if engine.artifact.get("sun") != "sun-decoder":
                raise SunError(f"{directory}: artifact {engine.artifact['name']!r} is not a SUN shared decoder; "
                               "bundle the decoder's directory (edge-export tune writes it)")
            return cls(engine, **kw)
        from edge.engines.torch_engine import TorchEngine
        from edge.model.sun_modules import check_fingerprint, load_module
        model, man = load_module(directory)
        fp = check_fingerprint(model, man)
        return cls(TorchEngine(model, fingerprint=fp, threads=threads, device=engine_kw.get("device")), **kw)

    # -- admission -----------------------------------------------------------------------------
    def admit(self, blob: bytes, request_id: Optional[str] = None, max_new: int = 64,
              params: SamplingParams = GREEDY, first_token: Optional[int] = None,
              stop_ids: Optional[Sequence[int]] = None, task: Optional[str] = None,
              on_token: Optional[Callable[[TokenEvent], None]] = None, grammar: str = "",
              logprobs: Optional[int] = None) -> str:
        """Queue a prefilled sequence; returns its request id. Raises AdmissionError when refused
        (DecoderFull when it holds max_sequences). grammar: the text its tokens follow from token 1
        on, token 0 fed to it first (""); logprobs: alternatives per token to report (None: none)."""
        if self.load >= self.max_sequences:
            self.refused += 1
            raise DecoderFull(f"{self.name}: holds its limit of {self.max_sequences} sequences (running and "
                              "waiting); retry later or add a decoder")
        try:
            head = read_header(bytes(blob))
        except (KVError, TypeError) as e:
            self.refused += 1
            raise AdmissionError(f"{self.name}: KV blob refused: {e}") from None
        # the header's meta is the sender's word: use only values of the types we need
        meta = {k: v for k, v in (head.get("meta") or {}).items()
                if (k, type(v)) in (("request_id", str), ("task", str), ("first_token", int))}
        rid = request_id or meta.get("request_id") or f"{self.name}#{next(self._ids)}"
        if rid in self._run:
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r} is already running")
        first = first_token if first_token is not None else meta.get("first_token")
        if isinstance(first, bool) or not isinstance(first, numbers.Integral) \
                or not 0 <= first < self.engine.vocab_size:
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r} has no valid first token "
                                 "(pass first_token or use a blob from a PrefillWorker)")
        if max_new < 1:
            self.refused += 1
            raise AdmissionError(f"{self.name}: max_new must be >= 1, got {max_new}")
        if rid in {w.rid for w, _ in self._waiting}:
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r} is already waiting")
        rules = self._rules(rid, grammar, logprobs, int(first))
        stops = frozenset(int(s) for s in stop_ids) if stop_ids is not None else self.stop_ids
        stops |= rules.stop_ids if rules is not None else frozenset()
        # its own stream: the prefill worker drew the first token from the PREFILL one
        rng = None if params.greedy else role_rng(params.seed, Role.DECODER)
        r = _Running(rid, task or meta.get("task", ""), None, int(first), [int(first)], max_new, params,
                     stops, rng, on_token, self.clock(), rules=rules)
        full = not self._has_room()
        try:
            if full:   # check it all now (the caller hears of a bad blob now), import it later
                self.engine.check_kv(bytes(blob))
            else:
                r.seq = self.engine.import_kv(blob)
        except EngineError as e:
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r}: {e}") from None
        if int(first) in stops or max_new == 1:
            self._finish(r, "stop" if int(first) in stops else "length")
        elif full:
            self._waiting.append((r, bytes(blob)))
        else:
            self._run[rid] = r
            self._order.append(rid)
        return rid

    def _rules(self, rid: str, grammar: str, logprobs: Optional[int], first: int) -> Optional[RowRules]:
        """The request's grammar state after token 0, and its logprobs; AdmissionError when its
        grammar cannot be followed here or token 0 already breaks it."""
        if not grammar and logprobs is None:
            return None
        try:
            rules = RowRules.of(compile_grammar(self.grammars, grammar, self.name), logprobs)
        except GrammarRefused as e:
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r}: its grammar is refused: {e}") from None
        if not rules.follow(first):
            self.refused += 1
            raise AdmissionError(f"{self.name}: request {rid!r}: its token 0 ({first}) breaks its grammar "
                                 "(was it prefilled by a worker that follows grammars?)")
        return rules

    def _has_room(self) -> bool:
        cap = getattr(self.engine, "capacity", None)
        return cap is None or self.engine.active_sequences < cap

    def _start_waiting(self) -> List[TokenEvent]:
        """Import waiting blobs while the engine has room (they were validated on admission)."""
        events = []
        while self._waiting and self._has_room():
            r, blob = self._waiting.popleft()
            try:
                r.seq = self.engine.import_kv(blob)
            except EngineError:
                self.refused += 1
                events.append(self._finish(r, "error"))
                continue
            self._run[r.rid] = r
            self._order.append(r.rid)
        return events

    def cancel(self, request_id: str) -> bool:
        """Drop a running or waiting request (its engine slot is freed, no result is kept)."""
        r = self._run.get(request_id)
        if r is None:
            for item in self._waiting:
                if item[0].rid == request_id:
                    self._waiting.remove(item)
                    return True
            return False
        self._finish(r, "cancelled", emit=False)
        del self.results[request_id]
        return True

    # -- decoding ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._run or self._waiting)

    def step(self) -> List[TokenEvent]:
        """One batched decode step over up to max_batch running sequences (all tasks mixed)."""
        started = self._start_waiting()
        if not self._run:
            return started
        batch = [self._run[self._order[i]] for i in range(min(self.max_batch, len(self._order)))]
        self._order.rotate(-len(batch))
        # a sequence whose context is full finishes instead of failing the whole batch
        room = [r for r in batch if self.engine.length(r.seq) + 1 <= self.engine.max_len]
        fits = {r.rid for r in room}
        events = started + [self._finish(r, "context") for r in batch if r.rid not in fits]
        if not room:
            return events
        rows = step_isolated(self.engine, [r.seq for r in room], [r.next_input for r in room])
        now = self.clock()
        self.steps += 1
        self.rows_out += len(room)
        self.mixed_steps += len({r.task for r in room}) > 1
        self.batches.append(tuple(r.task for r in room))
        for r, row in zip(room, rows):
            if row is None:                    # the engine refused this sequence: it ends alone
                events.append(self._finish(r, "error"))
                continue
            try:
                tok, entry = choose(row, r.params, r.rng, r.rules)
            except NoTokenAllowed:             # its grammar allows nothing here: it ends alone
                events.append(self._finish(r, "error"))
                continue
            r.tokens.append(tok)
            r.next_input = tok
            if r.first_step_at is None:
                r.first_step_at = now
            self.tokens_out += 1
            reason = "stop" if tok in r.stops else ("length" if len(r.tokens) >= r.max_new else None)
            ev = TokenEvent(r.rid, tok, len(r.tokens) - 1, reason is not None, reason, entry)
            if reason is not None:
                self._finish(r, reason, emit=False)
            if r.on_token:
                r.on_token(ev)
            events.append(ev)
        return events

    def run(self, max_steps: Optional[int] = None) -> Dict[str, DecodeResult]:
        """Step until nothing is running (or max_steps); returns all results so far."""
        n = 0
        while (self._run or self._waiting) and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return self.results

    def _finish(self, r: _Running, reason: str, emit: bool = True) -> Optional[TokenEvent]:
        self._run.pop(r.rid, None)
        try:
            self._order.remove(r.rid)
        except ValueError:
            pass
        if r.seq is not None:
            self.engine.free(r.seq)
        self.results[r.rid] = DecodeResult(r.rid, r.task, r.tokens, reason, r.admitted_at,
                                           r.first_step_at, self.clock())
        if not emit:
            return None
        ev = TokenEvent(r.rid, r.tokens[-1], len(r.tokens) - 1, True, reason)
        if r.on_token:
            r.on_token(ev)
        return ev

    def stats_snapshot(self) -> dict:
        """Counters for dashboards: steps, mean batch, share of steps that mixed tasks."""
        steps = self.steps
        return {"steps": steps, "tokens_out": self.tokens_out, "running": len(self._run),
                "waiting": len(self._waiting),
                "refused": self.refused, "batch_mean": self.rows_out / steps if steps else 0.0,
                "mixed_frac": self.mixed_steps / steps if steps else 0.0}

    def pop_result(self, request_id: str) -> DecodeResult:
        try:
            return self.results.pop(request_id)
        except KeyError:
            raise KeyError(f"{self.name}: no finished request {request_id!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m edge.sun.decoder DECODER_DIR --blob F [--blob F ...]`: decode blobs, print JSON lines.

    A one-shot shared decoder for scripts and cross-process checks; the MQTT
    service runs the same SharedDecoder behind the hub's routing.
    """
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(prog="python -m edge.sun.decoder", description=main.__doc__)
    ap.add_argument("decoder_dir")
    ap.add_argument("--blob", action="append", required=True, help="a KV blob file from a prefill worker")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--stop", type=int, action="append", default=[], help="stop token id (repeatable)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    dec = SharedDecoder.from_dir(a.decoder_dir, threads=a.threads, stop_ids=a.stop)
    rids, rc = [], 0
    for path in a.blob:
        try:
            with open(path, "rb") as f:
                rids.append(dec.admit(f.read(), request_id=path, max_new=a.max_new))
        except (OSError, AdmissionError) as e:
            print(json.dumps({"request_id": path, "error": str(e)}), flush=True)
            rc = 2
    dec.run()
    for rid in rids:
        r = dec.pop_result(rid)
        print(json.dumps({"request_id": rid, "task": r.task, "tokens": r.tokens,
                          "finish_reason": r.finish_reason}), flush=True)
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
