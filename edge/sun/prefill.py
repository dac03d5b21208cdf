"""SUN prefill worker: one task specialist's prefill module -> KV blob + first token.

The worker runs its prompt through the specialist's (tuned) prefill module,
picks the first answer token from the last position's logits, and exports the
KV cache as a blob that names the shared decoder the specialist was tuned for
(the manifest's `decoder_fingerprint`). Any decoder with that fingerprint can
continue the sequence; every other decoder refuses the blob.

`prefill` serves one prompt now. As a core for edge/runtime/loop.py (the SUN
prefill node) the worker queues prompts with `submit` and `step` prefills the
oldest one, returning its PrefillOutput -- or a PrefillFailed: one bad prompt
fails alone. At most `max_queue` prompts wait: `submit` past it raises QueueFull (the node
answers `overloaded`), so a burst faster than the prefills cannot grow the queue without bound.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np

from edge.engines.base import Engine
from edge.sun.worker_limits import DEFAULT_MAX_QUEUE
from edge.sun.prompt_queue import PromptQueue
from edge.speculative.sampling import GREEDY, Role, SamplingParams, role_rng
from edge.sun.token_rules import RowRules, SunGrammars, choose

log = logging.getLogger(__name__)


@dataclass
class PrefillOutput:
    request_id: str
    task: str
    blob: bytes               # KV of the prompt, made for decoder `decoder_fingerprint`
    first_token: int
    prompt_len: int
    decoder_fingerprint: str
    prefill_s: float
    logprob: Optional[tuple] = None     # token 0's (logprob, alternatives) when the request asked


@dataclass
class PrefillFailed:
    request_id: str
    reason: str
    refused: bool             # True: the prompt was refused (empty, too long, bad ids); False: a fault


class PrefillWorker(PromptQueue):
    """The prefill core (an edge.runtime.core.EngineCore) of one task. The engine's fingerprint
    must be the target decoder's fingerprint."""

    def __init__(self, engine: Engine, task: str, kv_dtype: str = "float16", name: str = "",
                 max_queue: int = DEFAULT_MAX_QUEUE, grammars: Optional[SunGrammars] = None):
        """grammars: the base tokenizer's, so token 0 can follow a request's grammar (None: refused)."""
        if not engine.fingerprint:
            raise ValueError("a prefill engine needs the fingerprint of the decoder it was tuned for "
                             "(the specialist manifest's decoder_fingerprint)")
        # items: (request id, prompt, params)
        super().__init__(name or f"prefill/{task}", max_queue, grammars)
        self.engine = engine
        self.task = task
        self.kv_dtype = kv_dtype

    @property
    def decoder_fingerprint(self) -> str:
        return self.engine.fingerprint

    @property
    def tasks(self) -> List[str]:
        """The one task served (an AdapterPrefillWorker serves several)."""
        return [self.task]

    @classmethod
    def from_dir(cls, directory, task: Optional[str] = None, threads: Optional[int] = None,
                 kv_dtype: str = "float16", backend: str = "torch",
                 max_queue: int = DEFAULT_MAX_QUEUE, engine_kw: Optional[dict] = None,
                 grammars: Optional[SunGrammars] = None) -> "PrefillWorker":
        """Load a specialist written by `edge-export tune` (SUN, QSUN or full-FT), or its prefill
        artifact from a bundle (`edge-export bundle DIR OUT --onnx prefill`) on backend onnx/llamacpp.
        engine_kw: where it runs (edge/engines/placement.py's Placement.engine_kwargs())."""
        from edge.model.sun_error import SunError
        engine_kw = dict(engine_kw or {})
        if backend != "torch":
            engine = _bundle_engine(directory, backend, "prefill", threads, **engine_kw)
            fp = engine.artifact.get("decoder_fingerprint")
            if not fp:
                raise SunError(f"{directory}: artifact {engine.artifact['name']!r} is not a SUN prefill module "
                               "(no decoder fingerprint); bundle the specialist's directory")
            return cls(engine, task or engine.artifact.get("task") or "task", kv_dtype=kv_dtype, max_queue=max_queue,
                       grammars=grammars)
        from edge.engines.torch_engine import TorchEngine
        from edge.model.sun_modules import load_module
        model, man = load_module(directory)
        fp = man.get("decoder_fingerprint")
        if not fp:
            raise SunError(f"{directory}: the manifest names no decoder_fingerprint; re-run the tuning")
        engine = TorchEngine(model, fingerprint=fp, threads=threads, device=engine_kw.get("device"))
        return cls(engine, task or man.get("task", "task"), kv_dtype=kv_dtype, max_queue=max_queue, grammars=grammars)

    def prefill(self, prompt: Sequence[int], request_id: Optional[str] = None,
                params: SamplingParams = GREEDY, rng: Optional[np.random.Generator] = None,
                rules: Optional[RowRules] = None) -> PrefillOutput:
        """rules: the request's grammar (token 0 follows it) and logprobs (token 0's entry)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: a prefill needs at least one token")
        rid = request_id or f"{self.name}#{next(self._ids)}"
        t0 = time.perf_counter()
        seq = self.engine.new_sequence()
        try:
            logits = self.engine.forward_last(seq, prompt)
            # the PREFILL stream: the decoder samples the next tokens from the DECODER one
            first, entry = choose(logits[-1], params, rng if rng is not None else role_rng(params.seed, Role.PREFILL),
                                  rules)
            blob = self.engine.export_kv(seq, dtype=self.kv_dtype,
                                         meta={"task": self.task, "request_id": rid, "first_token": first})
        finally:
            self.engine.free(seq)
        return PrefillOutput(rid, self.task, blob, first, len(prompt), self.decoder_fingerprint,
                             time.perf_counter() - t0, entry)

    # ---- the core ----
    def submit(self, prompt: Sequence[int], request_id: Optional[str] = None,
               params: SamplingParams = GREEDY, task: Optional[str] = None, grammar: str = "",
               logprobs: Optional[int] = None) -> str:
        """Queue a prompt for `step`; returns its request id. Raises QueueFull past max_queue
        (task: None or this worker's own), GrammarRefused for a grammar it cannot follow."""
        if task not in (None, self.task):
            raise ValueError(f"{self.name} serves task {self.task!r}, not {task!r}")
        return self._admit(request_id, (list(prompt), params), "a prefill worker for this task", grammar, logprobs)

    def step(self) -> List[Union[PrefillOutput, PrefillFailed]]:
        """Prefill the oldest queued prompt (one at a time: a prompt already batches its tokens)."""
        rid, prompt, params = self._queue.popleft()
        try:
            return [self.prefill(prompt, request_id=rid, params=params, rules=self.take_rules(rid))]
        except (ValueError, RuntimeError) as e:           # empty prompt, context full, bad ids
            return [PrefillFailed(rid, str(e), refused=True)]
        except Exception as e:                            # one bad job must not end the worker
            log.exception("%s: request %s failed", self.name, rid)
            return [PrefillFailed(rid, str(e), refused=False)]


def _bundle_engine(directory, backend: str, role: str, threads: Optional[int], **engine_kw):
    """An onnx/llama.cpp engine for a SUN role from a bundle; errors say how to make one."""
    from pathlib import Path

    from edge.engines.loader import load_engine
    from edge.model.sun_error import SunError
    if not (Path(directory) / "manifest.json").is_file():
        raise SunError(f"{directory}: backend {backend!r} runs exported artifacts; make a bundle with "
                       f"`edge-export bundle {directory} OUT --onnx {role}` and pass OUT")
    return load_engine(directory, backend=backend, role=role, threads=threads, **engine_kw)
