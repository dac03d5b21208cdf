"""The fleet's discrete-event simulation: N targets over K hubs (broker nodes) and M draft services.

One StarSD round of one target, as the star runs it (edge/star/, edge/wire/):

    target --net--> broker node --broker net--> draft service queue   (DraftRequest, QoS 0)
    draft service: batched engine steps; a request joins at the next step, leaves after γ
                   (or, as the planner: when free, takes every pending request as one batch, D(b))
    draft service --broker net--> broker node --net--> target          (DraftResponse, QoS 0)
    target verifies γ+1 tokens on its own device (target step × v(γ+1)), commits
    1 + (accepted drafts) tokens, and sends its next request (`extra_ms` later: signing etc.)

A broker node is one FIFO server (Mosquitto is single-threaded): every routed message
(benchmarks/lib/fleet_round_count.py ROUND_MESSAGES: one publish in, delivered once) costs it `broker_msg_ms`, so its load is
its routed messages per second over 1000 / broker_msg_ms. The draft service batches as the real
one does by default (iteration-level joining, one step's time from the measured per-step table),
or, with join=False, as the planner (server/planner.py: work-conserving, all pending at once,
D(b) from SystemInputs), so with no broker and no network that loop is the planner's.

Hub h (of K) is broker node h; draft service j lives on hub j % K; target i joins hub i % K and
one of that hub's services, round robin. M must be a multiple of K, so no round crosses nodes
(the cluster's inter-node forwarding is left out). Left out too: prefills and joins (a session's
start), QoS 0 losses and the targets' deadlines (a target always waits, as starsd_scaling's
`--deadline wait`), the draft node's per-reply signing, and the broker's latency apart from its
queue (loopback-measured costs only).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import List

import numpy as np

from edge.speculative.verify import expected_tokens
from server.planner import SystemInputs, interp_table

REQ_AT_BROKER, REQ_AT_DRAFT, BATCH_DONE, RESP_AT_BROKER, RESP_AT_TARGET = range(5)


@dataclass
class FleetInputs:
    system: SystemInputs          # draft D(b), target step and verify, α, extra round-trip ms (rtt_ms)
    gamma: int = 4
    net_ms: float = 0.0           # device <-> broker, one way
    hub_net_ms: float = 0.0       # draft service <-> broker, one way
    broker_msg_ms: float = 0.0    # broker CPU per routed message (0: free)
    max_sessions: int = 1 << 30   # sessions one draft service can hold (its KV memory)

    @property
    def broker_capacity(self) -> float:
        """Routed messages per second one broker node sustains."""
        return 1e3 / self.broker_msg_ms if self.broker_msg_ms > 0 else float("inf")


@dataclass
class FleetPoint:
    n: int
    k: int
    m: int
    per_target_tps: float
    standalone_tps: float
    speedup: float
    draft_busy: float             # mean over services, in the window
    mean_batch: float
    broker_msgs_per_s: float      # routed messages per second per node (mean over nodes)
    broker_load: float            # ... over what one node sustains
    rtt_p50_ms: float             # request sent -> answer at the target
    rtt_p99_ms: float
    round_ms: float               # mean round: request to next request
    messages_per_round: float
    rounds: int
    sessions_per_service: float
    fits: bool                    # every service holds its sessions
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


class _Node:
    """A FIFO server: Lindley's recursion on arrivals taken in time order."""
    __slots__ = ("free_at", "cost", "routed")

    def __init__(self, cost: float):
        self.free_at, self.cost, self.routed = 0.0, cost, 0

    def depart(self, t: float, counting: bool) -> float:
        self.free_at = max(t, self.free_at) + self.cost
        self.routed += counting
        return self.free_at


def _draws(inp: FleetInputs, rounds: int, rng, deterministic: bool) -> np.ndarray:
    """Tokens each round commits: 1 + accepted drafts, i.i.d. per position (or their mean)."""
    a, g = inp.system.alpha, inp.gamma
    if deterministic:
        return np.full(rounds, expected_tokens(a, g))
    p = np.array([a ** j * (1 - a) for j in range(g)] + [a ** g])
    return 1.0 + rng.choice(g + 1, size=rounds, p=p / p.sum())


class _Run:
    """One simulation's state; one method per event kind."""

    def __init__(self, inp: FleetInputs, n: int, k: int, m: int, warmup_ms: float, window_ms: float,
                 seed: int, deterministic: bool, join: bool):
        if m % k or m < k:
            raise ValueError(f"M ({m}) must be a positive multiple of K ({k})")
        self.inp, self.n, self.k, self.m, self.join = inp, n, k, m, join
        self.sysi, self.g = inp.system, inp.gamma
        self.verify_ms = self.sysi.return_ms(self.g) - self.sysi.rtt_ms     # target step × v(γ+1)
        self.rng, self.deterministic = np.random.default_rng(seed), deterministic
        self.draws, self.drawn = _draws(inp, 1 << 16, self.rng, deterministic), 0
        self.nodes = [_Node(inp.broker_msg_ms) for _ in range(k)]
        self.node_of = [i % k for i in range(n)]
        self.svc_of = [((i // k) % (m // k)) * k + i % k for i in range(n)]
        self.queues: List[list] = [[] for _ in range(m)]
        self.active: List[list] = [[] for _ in range(m)]   # [target, draft steps left] in the engine's batch
        self.busy_until, self.busy_ms, self.batches = [0.0] * m, [0.0] * m, []
        self.sent, self.hops = [0.0] * n, [0] * n          # hops: broker messages of the round so far
        self.round_msgs = 0                                 # ... summed over the rounds counted
        self.window_ms, self.t_open, self.t_end = window_ms, warmup_ms, warmup_ms + window_ms
        self.tokens, self.rtts, self.round_ms = np.zeros(n), [], []
        self.ev: list = []
        self.seq = 0
        first = self.verify_ms + self.sysi.rtt_ms
        for i in range(n):                  # staggered over one return time, as the planner
            self.sent[i] = first * i / max(n, 1)
            self.push(self.sent[i] + inp.net_ms, REQ_AT_BROKER, i)

    def push(self, at: float, kind: int, x) -> None:
        heapq.heappush(self.ev, (at, self.seq, kind, x))
        self.seq += 1

    def start(self, j: int, t: float) -> None:
        """The service's next engine call: one step of every active request (join), or the whole
        batch of what is pending (the planner's model)."""
        self.active[j] += [[x, self.g] for x in self.queues[j]]
        self.queues[j] = []
        b = len(self.active[j])
        d = interp_table(self.sysi.draft_step_ms, b) if self.join else self.sysi.draft_service_ms(b, self.g)
        self.busy_until[j] = t + d
        if t >= self.t_open:
            self.busy_ms[j] += min(d, self.t_end - t)
            self.batches.append(b)
        self.push(t + d, BATCH_DONE, j)

    def at_draft(self, t: float, x: int) -> None:
        j = self.svc_of[x]
        self.queues[j].append(x)
        if self.busy_until[j] <= t:
            self.start(j, t)

    def batch_done(self, t: float, j: int) -> None:
        still = []
        for req in self.active[j]:
            req[1] = req[1] - 1 if self.join else 0
            if req[1] > 0:
                still.append(req)
            else:
                self.push(t + self.inp.hub_net_ms, RESP_AT_BROKER, req[0])
        self.active[j] = still
        if still or self.queues[j]:
            self.start(j, t)

    def at_target(self, t: float, x: int) -> None:
        """The answer is at the target: verify, commit, ask again."""
        if self.drawn == len(self.draws):
            self.draws, self.drawn = _draws(self.inp, len(self.draws), self.rng, self.deterministic), 0
        next_sent = t + self.verify_ms + self.sysi.rtt_ms
        if self.sent[x] >= self.t_open and next_sent <= self.t_end:     # rounds wholly in the window
            self.tokens[x] += self.draws[self.drawn]
            self.rtts.append(t - self.sent[x])
            self.round_ms.append(next_sent - self.sent[x])
            self.round_msgs += self.hops[x]
        self.hops[x] = 0
        self.drawn += 1
        self.sent[x] = next_sent
        self.push(next_sent + self.inp.net_ms, REQ_AT_BROKER, x)

    def run(self) -> FleetPoint:
        inp = self.inp
        while self.ev:
            t, _, kind, x = heapq.heappop(self.ev)
            if t > self.t_end:
                break
            if kind == REQ_AT_BROKER or kind == RESP_AT_BROKER:
                self.hops[x] += 1
                out = self.nodes[self.node_of[x]].depart(t, t >= self.t_open)
                if kind == REQ_AT_BROKER:
                    self.push(out + inp.hub_net_ms, REQ_AT_DRAFT, x)
                else:
                    self.push(out + inp.net_ms, RESP_AT_TARGET, x)
            elif kind == REQ_AT_DRAFT:
                self.at_draft(t, x)
            elif kind == BATCH_DONE:
                self.batch_done(t, x)
            else:
                self.at_target(t, x)
        return _point(inp, self.n, self.k, self.m, self.window_ms, self.tokens, self.rtts, self.round_ms,
                      self.round_msgs, self.busy_ms, self.batches, self.nodes)


def simulate(inp: FleetInputs, n: int, k: int = 1, m: int = 1, warmup_ms: float = 2000.0,
             window_ms: float = 8000.0, seed: int = 0, deterministic: bool = False,
             join: bool = True) -> FleetPoint:
    """join: iteration-level batching (the draft service's default, `--join`): a request joins the
    engine's batch at its next step and leaves after its γ steps; False: whole batches, D(b) from
    SystemInputs.draft_service_ms (the planner's model, its feed cost included)."""
    return _Run(inp, n, k, m, warmup_ms, window_ms, seed, deterministic, join).run()


def _point(inp, n, k, m, window_ms, tokens, rtts, round_ms, counted, busy_ms, batches, nodes) -> FleetPoint:
    rounds, round_msgs = len(round_ms), counted
    w = window_ms / 1e3
    alone = 1e3 / inp.system.target_step_ms
    # tokens over the time their rounds took: no partial round at the window's edges
    per_target = 1e3 * float(tokens.sum()) / float(np.sum(round_ms)) if round_ms else 0.0
    routed = float(np.mean([nd.routed for nd in nodes])) / w
    cap = inp.broker_capacity
    sessions = n / m
    return FleetPoint(
        n=n, k=k, m=m, per_target_tps=per_target, standalone_tps=alone, speedup=per_target / alone,
        draft_busy=float(np.mean(busy_ms)) / window_ms, mean_batch=float(np.mean(batches)) if batches else 0.0,
        broker_msgs_per_s=routed, broker_load=routed / cap if cap != float("inf") else 0.0,
        rtt_p50_ms=float(np.percentile(rtts, 50)) if rtts else float("nan"),
        rtt_p99_ms=float(np.percentile(rtts, 99)) if rtts else float("nan"),
        round_ms=float(np.mean(round_ms)) if round_ms else float("nan"),
        messages_per_round=round_msgs / rounds if rounds else float("nan"), rounds=rounds,
        sessions_per_service=sessions, fits=sessions <= inp.max_sessions)
