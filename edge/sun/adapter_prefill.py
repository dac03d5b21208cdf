"""SUN prefill worker of many tasks over one base: a LoRA adapter per task, the base held once.

Where `PrefillWorker` (prefill.py) runs one specialist -- a full copy of the prefill module --
`AdapterPrefillWorker` runs the frozen base (the shared decoder's own weights, so its KV is made
for that decoder's fingerprint) plus one prefill-only adapter per task, and serves every task it
holds an adapter for. A backend does the runtime's part:

* adapter_torch.py (`TorchAdapterBackend`): one `lora_prefill` call per step over a padded batch
  whose rows may be of different tasks (per-row adapter gather, as Punica / S-LoRA batch LoRAs);
* adapter_llamacpp.py (`LlamaCppAdapterBackend`, no torch): llama.cpp applies one adapter set
  per decode call, so a step groups its rows by task and prefills each row under its task's
  adapter (one adapter switch per distinct task per step).

Adapters can be added while serving (`add`): checked first (sha256 of the file it loads, the
base's shapes, rank, targets; a bundle entry's manifest too), a bad one is refused with an
AdapterError that says why and the tasks already served carry on.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from edge.model.sun_error import SunError
from edge.speculative.constrained import NoTokenAllowed
from edge.speculative.sampling import GREEDY, Role, SamplingParams, role_rng
from edge.sun.worker_limits import DEFAULT_MAX_QUEUE
from edge.sun.prefill import PrefillFailed, PrefillOutput
from edge.sun.prompt_queue import PromptQueue
from edge.sun.token_rules import SunGrammars, choose

log = logging.getLogger(__name__)
DEFAULT_MAX_ROWS = 8          # prompts prefilled together in one step
MAX_TASKS = 256               # tasks one hello can list (edge/wire/field_types.py id_list)


class AdapterPrefillWorker(PromptQueue):
    """The prefill core (an edge.runtime.core.EngineCore) of every task whose adapter `backend` holds.

    backend: TorchAdapterBackend or LlamaCppAdapterBackend (their docstrings say what each costs);
    it owns the base and the adapters, and answers `tasks`, `add`, `prefill_rows`."""

    def __init__(self, backend, kv_dtype: str = "float16", name: str = "prefill",
                 max_queue: int = DEFAULT_MAX_QUEUE, max_rows: int = DEFAULT_MAX_ROWS,
                 grammars: Optional[SunGrammars] = None):
        if not backend.fingerprint:
            raise SunError("an adapter prefill worker needs the fingerprint of the shared decoder its base is")
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        super().__init__(name, max_queue, grammars)   # items: (request id, prompt, params, task)
        self.backend, self.engine = backend, backend.engine
        self.kv_dtype, self.max_rows = kv_dtype, max_rows
        self.steps: List[Tuple[str, ...]] = []  # the tasks of each step's rows (the last 256 steps)
        self.refused: Dict[str, str] = {}       # task -> why, of adapters refused at open

    @classmethod
    def open(cls, directory, adapters: Sequence[Tuple[str, str]] = (), backend: str = "torch",
             threads: Optional[int] = None, kv_dtype: str = "float16", max_queue: int = DEFAULT_MAX_QUEUE,
             max_rows: int = DEFAULT_MAX_ROWS, engine_kw: Optional[dict] = None,
             name: str = "prefill", grammars: Optional[SunGrammars] = None,
             decode_batch: Optional[int] = None) -> "AdapterPrefillWorker":
        """`edge-agent run --role prefill` with adapters. directory: on torch the shared decoder's
        directory (the base), on llamacpp a bundle (its decoder artifact is the base; every adapter
        its manifest lists is served). adapters: (task, path) more (torch: PEFT directories;
        llamacpp: GGUF LoRA files). An adapter that is refused is logged and left out (`refused`:
        task -> why); a worker left with no task at all is a SunError. decode_batch (llamacpp, colocated):
        the shared decoder's context of that many rows, made before the adapters load
        (adapter_llamacpp.py says why)."""
        if backend == "torch":
            from edge.sun.adapter_torch import TorchAdapterBackend
            if listed_tasks(directory):
                raise SunError(f"{directory} is a bundle: on torch pass the shared decoder's directory as "
                               "--module and each task's PEFT adapter directory as --adapter TASK=DIR "
                               "(or use --backend llamacpp)")
            be = TorchAdapterBackend.from_dir(directory, threads, device=(engine_kw or {}).get("device"))
        elif backend == "llamacpp":
            from edge.sun.adapter_llamacpp import LlamaCppAdapterBackend
            be = LlamaCppAdapterBackend.from_bundle(directory, threads, decode_batch=decode_batch, n_seq_max=max_rows,
                                                    **dict(engine_kw or {}))
        else:
            raise SunError(f"adapters are served on --backend torch or llamacpp, not {backend}")
        worker = cls(be, kv_dtype=kv_dtype, name=name, max_queue=max_queue, max_rows=max_rows, grammars=grammars)
        sources = [(t, directory, True) for t in (listed_tasks(directory) if backend == "llamacpp" else [])]
        for task, path, bundle in sources + [(t, p, False) for t, p in adapters]:
            try:
                worker.add(task, path, bundle=bundle)
            except Exception as e:                        # one bad adapter: the others serve
                worker.refused[task] = str(e)
                log.warning("%s: adapter for task %r refused: %s", name, task, e)
        if not worker.tasks:
            why = "; ".join(f"{t}: {w}" for t, w in worker.refused.items()) or "none given"
            raise SunError(f"no adapter could be loaded ({why}); give --adapter TASK=PATH or a bundle with "
                           "adapters (edge-export adapter --bundle)")
        return worker

    @property
    def decoder_fingerprint(self) -> str:
        return self.backend.fingerprint

    @property
    def tasks(self) -> List[str]:
        """Every task served, sorted (the hello's task list; its first is the hello's task)."""
        return sorted(self.backend.tasks)

    @property
    def task(self) -> str:
        return self.tasks[0] if self.tasks else ""

    def add(self, task: str, path, sha256: Optional[str] = None, bundle: bool = False) -> None:
        """Load `task`'s adapter (a file, or with bundle=True the bundle's entry for `task`) after
        checking it; raises AdapterError / BundleError (nothing changes) when it is refused."""
        if len(self.backend.tasks) >= MAX_TASKS:
            raise SunError(f"{self.name} serves {MAX_TASKS} tasks, the most its hello can list; "
                           "start another prefill worker for more")
        self.backend.add(task, path, sha256=sha256, bundle=bundle)
        log.info("%s: serving task %r (tasks now: %s)", self.name, task, ", ".join(self.tasks))

    # ---- the core ----
    def submit(self, prompt: Sequence[int], request_id: Optional[str] = None,
               params: SamplingParams = GREEDY, task: Optional[str] = None, grammar: str = "",
               logprobs: Optional[int] = None) -> str:
        """Queue a prompt of `task` for `step`; raises QueueFull past max_queue, SunError for a task
        this worker holds no adapter for, GrammarRefused for a grammar it cannot follow."""
        if task not in self.backend.tasks:
            raise SunError(f"{self.name} holds no adapter for task {task!r} (it serves: "
                           f"{', '.join(self.tasks) or 'none'})")
        return self._admit(request_id, ([int(t) for t in prompt], params, task),
                           "a prefill worker with this task's adapter", grammar, logprobs)

    def step(self) -> List[Union[PrefillOutput, PrefillFailed]]:
        """Prefill up to max_rows queued prompts, whatever their tasks, in one backend call."""
        jobs = [self._queue.popleft() for _ in range(min(self.max_rows, len(self._queue)))]
        out: List[Union[PrefillOutput, PrefillFailed]] = []
        good = []
        rules = {job[0]: self.take_rules(job[0]) for job in jobs}
        for job in jobs:
            bad = self._refusal(job)
            if bad:
                out.append(PrefillFailed(job[0], bad, refused=True))
            elif job[3] not in self.backend.tasks:     # unloaded since it was queued
                out.append(PrefillFailed(job[0], f"task {job[3]!r} is no longer served here", refused=True))
            else:
                good.append(job)
        if good:
            out.extend(self._prefill(good, rules))
        return out

    def _refusal(self, job) -> Optional[str]:
        prompt = job[1]
        if not prompt:
            return "empty prompt: a prefill needs at least one token"
        bad = next((t for t in prompt if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (0..{self.engine.vocab_size - 1})"
        if len(prompt) >= self.backend.max_len:
            return f"a prompt of {len(prompt)} tokens does not fit the context of {self.backend.max_len}"
        return None

    def _prefill(self, jobs, rules) -> List[Union[PrefillOutput, PrefillFailed]]:
        t0 = time.perf_counter()
        tasks = [j[3] for j in jobs]
        try:
            rows = self.backend.prefill_rows([j[1] for j in jobs], tasks)
        except Exception as e:                            # one bad batch must not end the worker
            log.exception("%s: a prefill of %d rows failed", self.name, len(jobs))
            return [PrefillFailed(j[0], str(e), refused=False) for j in jobs]
        self.steps = (self.steps + [tuple(tasks)])[-256:]
        took = (time.perf_counter() - t0) / len(jobs)
        out: List[Union[PrefillOutput, PrefillFailed]] = []
        for (rid, prompt, params, task), (logits, export) in zip(jobs, rows):
            # the PREFILL stream, as PrefillWorker picks it: the decoder samples the rest from its own
            try:
                first, entry = choose(logits, params, role_rng(params.seed, Role.PREFILL), rules.get(rid))
            except NoTokenAllowed as e:                   # its grammar allows no first token
                out.append(PrefillFailed(rid, f"its grammar: {e}", refused=True))
                continue
            blob = export(self.kv_dtype, {"task": task, "request_id": rid, "first_token": first})
            out.append(PrefillOutput(rid, task, blob, first, len(prompt), self.decoder_fingerprint, took, entry))
        return out


def listed_tasks(directory) -> List[str]:
    """The tasks a bundle's manifest lists adapters for ([] for a directory that is not a bundle)."""
    if not (Path(directory) / "manifest.json").is_file():
        return []
    from edge.engines.lora_bundle import adapter_entries
    try:
        return [a["task"] for a in adapter_entries(directory)]
    except Exception:                                     # not a bundle's manifest (a tuned directory's)
        return []
