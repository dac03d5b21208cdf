"""The reverse star with generations: each device's prompts, and the hub's prefill of each of them.

server/reverse_planner.py's closed loop prices only the rounds: a steady stream of verify calls. A
real device's generation begins with its prompt, and the hub's verify service prefills it in the
step it arrives in, ahead of that step's batched verify (edge/star/verify_service.py `_prepare`): a
prompt of L tokens costs one target call over L - 1 tokens (hundreds of tokens: seconds on a
memory-bound CPU hub), and every other device whose round lands in that step waits for it. With
N devices starting together, the first device answered decodes through the prefills of all the
others. That stall is what the steady-state loop misses: on the record of
benchmarks/results/reverse_star/ the loop over-predicted the hub's tokens/s by +23%, +37%, +79% at
N = 2, 4, 8; with the prompts -4%, +16%, +54% (the README there has what is still missed).

`simulate_schedule` runs the same work-conserving hub over explicit jobs: device i generates its
prompts (Job: prompt tokens, new tokens, its own acceptance) one after another, all devices starting
at t = 0, their requests STAGGER_MS apart (a work-conserving hub starts on the first; a batch's
answers reach their devices as far apart). A step takes every request pending when the hub is
free; its cost is the prefill of each first request's prompt plus one call over b·(γ+1) tokens. A
round yields E(α_job, γ) tokens (the last round only what is left); the device returns after its
drafting and the round trip. Rates are measured as benchmarks/star/reverse_star.py measures them:
per generation from its first answer to its last, less the first round's tokens; a device's rate
its decode tokens over its decode time; the hub's the devices' rates summed.
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from typing import List, Optional, Sequence

from edge.speculative.verify import expected_tokens

STAGGER_MS = 1.0     # requests sent together reach the hub one after another: it starts on the first


@dataclass(frozen=True)
class Job:
    prompt_tokens: int                 # the generation's prompt, prefilled at the hub at its first request
    new_tokens: int                    # tokens it generates
    alpha: Optional[float] = None      # its own acceptance (None: the inputs' alpha)


@dataclass
class SchedulePrediction:
    n: int
    gamma: int
    hub_tps: float                     # the devices' decode rates summed
    per_device_tps: float              # the median generation's decode rate
    prefill_s: float                   # hub seconds spent prefilling prompts
    busy_s: float                      # hub seconds busy in all
    wall_s: float


class _Device:
    def __init__(self, jobs: Sequence[Job]):
        self.jobs, self.at = list(jobs), 0
        self.done = 0.0                # tokens of the current job committed
        self.first: Optional[float] = None     # its first answer
        self.first_tokens = 0.0
        self.windows: List[tuple] = []          # (decode tokens, decode seconds) per finished job

    @property
    def job(self) -> Job:
        return self.jobs[self.at]


def simulate_schedule(inp, jobs: Sequence[Sequence[Job]], gamma: int) -> SchedulePrediction:
    """Every device (jobs[i]: its generations in turn) around the hub; `inp` a ReverseInputs
    (hub call table, draft step, round trip, default acceptance)."""
    if gamma < 1:
        raise ValueError("a drafting device drafts at least one token a round")
    devices = [_Device(j) for j in jobs if j]
    ret = gamma * inp.draft_step_ms + inp.rtt_ms        # a device's time between answer and request
    events = [(ret + STAGGER_MS * i, i) for i in range(len(devices))]   # each drafts its first round, then asks
    heapq.heapify(events)
    free_at = busy = prefill = 0.0
    while events:
        start = max(free_at, events[0][0])
        batch = []
        while events and events[0][0] <= start:
            batch.append(heapq.heappop(events)[1])
        fills = sum(prefill_ms(inp, devices[i].job.prompt_tokens) for i in batch if devices[i].first is None)
        cost = fills + inp.hub_ms(len(batch) * (gamma + 1))
        free_at, busy, prefill = start + cost, busy + cost, prefill + fills
        for k, i in enumerate(batch):         # the answers reach the devices one after another
            if _answered(devices[i], free_at, gamma, inp.alpha):
                heapq.heappush(events, (free_at + ret + STAGGER_MS * k, i))
    rates = [sum(t for t, _ in d.windows) / sum(s for _, s in d.windows) for d in devices
             if sum(s for _, s in d.windows) > 0]
    gens = [t / s for d in devices for t, s in d.windows if s > 0]
    return SchedulePrediction(len(devices), gamma, 1e3 * sum(rates), 1e3 * statistics.median(gens) if gens else 0.0,
                              prefill / 1e3, busy / 1e3, free_at / 1e3)


def prefill_ms(inp, prompt_tokens: int) -> float:
    """The hub's prefill of a prompt: one call over all its tokens but the last (fed with the drafts)."""
    return inp.hub_ms(prompt_tokens - 1) if prompt_tokens > 1 else 0.0


def steady_jobs(n: int, prompt_tokens: int, new_tokens: int, generations: int = 8) -> List[List[Job]]:
    """n devices each generating `generations` answers of new_tokens after prompts of prompt_tokens."""
    return [[Job(prompt_tokens, new_tokens)] * generations for _ in range(n)]


def _answered(d: _Device, t: float, gamma: int, alpha: float) -> bool:
    """Commit one round's tokens at time t (ms); False when the device has no job left."""
    job = d.job
    got = min(expected_tokens(job.alpha if job.alpha is not None else alpha, gamma), job.new_tokens - d.done)
    d.done += got
    if d.first is None:
        d.first, d.first_tokens = t, got
    if d.done < job.new_tokens - 1e-9:
        return True
    d.windows.append((job.new_tokens - d.first_tokens, t - d.first))
    d.at, d.done, d.first = d.at + 1, 0.0, None
    return d.at < len(d.jobs)
