"""The reverse star with generations: each device's prompts, the hub's prefill of each of them, and
the verify service's joining.

server/reverse_planner.py's closed loop is this model with prompts of one token (no prefill) and
generations long enough to be steady. A real device's generation begins with its prompt, and the
hub's verify service prefills it in the step it arrives in, ahead of that step's batched verify
(edge/star/verify_service.py `_prepare`): a prompt of L tokens costs one target call over L - 1
tokens (hundreds of tokens: seconds on a memory-bound CPU hub), and every other device whose round
lands in that step waits for it.

`simulate_schedule` runs the hub as the service runs it: device i generates its prompts (Job: prompt
tokens, new tokens, its own acceptance) one after another, all devices starting at t = 0, their
requests STAGGER_MS apart (requests sent together reach the hub one after another). When the hub is
free and a request is pending, the service's own join rule (edge/star/verify_join.py, fed the
model's times) says whether to wait for sessions due back (at most one call's time) or to serve; a
step takes every request pending and costs the prefill of each first request's prompt plus one call
over b·(γ+1) tokens. A round yields E(α_job, γ) tokens (the last round only what is left); the device
returns after its drafting and the round trip. With `together`, job k of every device starts once
every device finished job k - 1 (benchmarks/star/reverse_star.py runs them so).

Rates are measured as benchmarks/star/reverse_star.py measures them, over the decode only: a
generation's window runs from the last first answer of its group (together: the devices starting
that job; else the generation alone) -- every prompt of the group prefilled by then -- to its end,
and holds the tokens committed after its start; a device's rate is its window tokens over its window
time; the hub's the devices' rates summed.
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from edge.speculative.verify import expected_tokens
from edge.star.verify_join import VerifyJoin

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
    mean_batch: float = 0.0            # sessions a verify call




NEXT, JOB_DONE, FINISHED = "next", "job done", "finished"


class _Device:
    def __init__(self, jobs: Sequence[Job]):
        self.jobs, self.at = list(jobs), 0
        self.done = 0.0                                  # tokens of the current job committed
        self.stamps: List[Tuple[float, float]] = []     # its answers so far: (ms, tokens committed then)
        self.gens: List[Tuple[int, list]] = []           # finished jobs: (job index, their stamps)

    @property
    def job(self) -> Job:
        return self.jobs[self.at]


class _Hub:
    def __init__(self, inp, devices: List[_Device], gamma: int, together: bool):
        self.inp, self.devices, self.gamma, self.together = inp, devices, gamma, together
        self.ret = gamma * inp.draft_step_ms + inp.rtt_ms     # a device's time between answer and request
        self.join = VerifyJoin()
        self.events: list = []                         # (ms a request reaches the hub, device)
        self.parked: List[int] = []                    # devices waiting for the others' job to end
        self.busy = self.prefill = 0.0
        self.calls: List[int] = []

    def send(self, t: float, devices: Sequence[int]) -> None:
        """Each device drafts its round after t, then asks; requests sent together arrive STAGGER_MS apart."""
        for k, i in enumerate(devices):
            heapq.heappush(self.events, (t + self.ret + STAGGER_MS * k, i))

    def run(self) -> float:
        """The hub until every job is done; -> when its last answer left (ms)."""
        for i in range(len(self.devices)):
            self.join.opened(i, 0.0)
        self.send(0.0, range(len(self.devices)))
        pending: List[int] = []
        now = 0.0
        while self.events or pending:
            if not pending:
                now = max(now, self.events[0][0])
            while self.events and self.events[0][0] <= now:
                t, i = heapq.heappop(self.events)
                pending.append(i)
                self.join.arrived(i, t / 1e3)
            until = self.join.until(now / 1e3, set(pending))
            if until is not None and 1e3 * until > now:      # the service holds: wait for arrivals
                now = min(1e3 * until, self.events[0][0]) if self.events else 1e3 * until
                continue
            now, pending = self.serve(pending, now), []
        return now

    def serve(self, batch: List[int], now: float) -> float:
        """One step: the prefills of first requests, one call over every request; -> its end (ms)."""
        inp, devices = self.inp, self.devices
        fills = sum(prefill_ms(inp, devices[i].job.prompt_tokens) for i in batch if not devices[i].stamps)
        call = inp.hub_ms(len(batch) * (self.gamma + 1))
        end = now + fills + call
        self.busy, self.prefill = self.busy + fills + call, self.prefill + fills
        self.calls.append(len(batch))
        self.join.call(len(batch), call / 1e3, end / 1e3)
        again = []
        for i in batch:
            self.join.answered(i, end / 1e3)
            state = _answered(devices[i], end, self.gamma, inp.alpha)
            if state == NEXT or (state == JOB_DONE and not self.together):
                again.append(i)
            elif state == JOB_DONE:
                self.parked.append(i)
        self.send(end, again)
        if self.parked and not self.events and not again:  # every device's job k is done: k + 1 starts
            self.send(end, self.parked)
            self.parked = []
        return end


def simulate_schedule(inp, jobs: Sequence[Sequence[Job]], gamma: int, together: bool = False) -> SchedulePrediction:
    """Every device (jobs[i]: its generations in turn) around the hub; `inp` a ReverseInputs
    (hub call table, draft step, round trip, default acceptance). together: job k of every device
    starts once all finished job k - 1."""
    if gamma < 1:
        raise ValueError("a drafting device drafts at least one token a round")
    devices = [_Device(j) for j in jobs if j]
    hub = _Hub(inp, devices, gamma, together)
    wall = hub.run()
    windows = decode_windows([d.gens for d in devices], together)
    rates = [sum(t for t, _ in w) / sum(s for _, s in w) for w in windows if w and sum(s for _, s in w) > 0]
    gens = [t / s for w in windows for t, s in w if s > 0]
    return SchedulePrediction(len(devices), gamma, 1e3 * sum(rates), 1e3 * statistics.median(gens) if gens else 0.0,
                              hub.prefill / 1e3, hub.busy / 1e3, wall / 1e3,
                              statistics.fmean(hub.calls) if hub.calls else 0.0)


def decode_windows(gens: Sequence[Sequence[Tuple[int, list]]], together: bool) -> List[List[Tuple[float, float]]]:
    """Per device, each generation's (tokens, ms) over its decode: from the last first answer of its
    group (together: every device's job of the same index; else itself) to its last answer, the
    tokens committed after that start. gens[i]: device i's (job index, [(ms, tokens so far), ...])."""
    first: Dict[int, float] = {}
    for dev in gens:
        for k, st in dev:
            first[k] = max(first.get(k, 0.0), st[0][0])
    out = []
    for dev in gens:
        w = []
        for k, st in dev:
            t0 = first[k] if together else st[0][0]
            before = max((c for t, c in st if t <= t0), default=0.0)
            if st[-1][0] > t0:
                w.append((st[-1][1] - before, st[-1][0] - t0))
        out.append(w)
    return out


def prefill_ms(inp, prompt_tokens: int) -> float:
    """The hub's prefill of a prompt: one call over all its tokens but the last (fed with the drafts)."""
    return inp.hub_ms(prompt_tokens - 1) if prompt_tokens > 1 else 0.0


def steady_jobs(n: int, prompt_tokens: int, new_tokens: int, generations: int = 8) -> List[List[Job]]:
    """n devices each generating `generations` answers of new_tokens after prompts of prompt_tokens."""
    return [[Job(prompt_tokens, new_tokens)] * generations for _ in range(n)]


def _answered(d: _Device, t: float, gamma: int, alpha: float) -> str:
    """Commit one round's tokens at time t (ms): NEXT, JOB_DONE (another job follows) or FINISHED."""
    job = d.job
    d.done += min(expected_tokens(job.alpha if job.alpha is not None else alpha, gamma), job.new_tokens - d.done)
    d.stamps.append((t, d.done))
    if d.done < job.new_tokens - 1e-9:
        return NEXT
    d.gens.append((d.at, d.stamps))
    d.at, d.done, d.stamps = d.at + 1, 0.0, []
    return JOB_DONE if d.at < len(d.jobs) else FINISHED
