"""The reverse star's system model, and which way each device joins a hub that runs both directions.

Which way (`choose_direction`): a device that can hold the target (its weights and KV fit the
profile's usable memory) joins as a StarSD target -- it verifies locally and decodes alone when the
hub is gone; one that cannot but holds the draft joins as a drafter (the reverse star); one that
holds neither is not served.

The reverse model: N drafting devices in a closed loop around ONE batching server, the hub's verify
service. A device's return time is its own drafting, γ draft steps, plus the round trip; the hub
serves everything pending as one batch whose time V(b·(γ+1)) comes from a measured table of one
target call over that many tokens in all (memory-bound: V grows far slower than its tokens), and it
waits for devices due back as the service does (edge/star/verify_join.py: at most one call's time),
so devices answered together stay together. Each device's round yields E(α, γ) tokens. The baseline
is the hub serving the same N clients by plain batched decoding (what vLLM or llama-server does): one
call over N tokens per N tokens, V(N). `simulate_reverse` is server/reverse_schedule.py's model with
no prompts and long generations (the steady loop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from server.planner import interp_table
from server.reverse_schedule import Job, simulate_schedule

TARGET, DRAFTER, NONE = "target", "drafter", "none"


def choose_direction(usable_bytes: float, target_bytes: float, draft_bytes: float,
                     kv_bytes: float) -> Tuple[str, str]:
    """(direction, why) for a device with `usable_bytes` of memory."""
    gb = 1e9
    if target_bytes + kv_bytes <= usable_bytes:
        return TARGET, (f"holds the target ({(target_bytes + kv_bytes) / gb:.1f} GB with its KV of "
                        f"{usable_bytes / gb:.1f} GB): StarSD, it verifies and decodes alone without the hub")
    if draft_bytes + kv_bytes <= usable_bytes:
        return DRAFTER, (f"cannot hold the target ({(target_bytes + kv_bytes) / gb:.1f} GB > "
                         f"{usable_bytes / gb:.1f} GB), holds the draft: the reverse star, the hub verifies")
    return NONE, (f"holds neither the target nor the draft ({(draft_bytes + kv_bytes) / gb:.1f} GB > "
                  f"{usable_bytes / gb:.1f} GB)")


@dataclass
class ReverseInputs:
    hub_call_ms: Dict[int, float]     # one hub target call over T tokens in all (b sequences x k), measured
    draft_step_ms: float              # one draft step on a device
    rtt_ms: float                     # network + protocol round trip
    alpha: float                      # acceptance rate

    def hub_ms(self, tokens: int) -> float:
        return self.hub_call_ms.get(tokens) or interp_table(self.hub_call_ms, tokens)


@dataclass
class ReversePrediction:
    n: int
    gamma: int
    hub_tps: float                    # tokens the hub's target commits per second, all devices
    per_device_tps: float
    plain_tps: float                  # the hub serving the n clients by plain batched decoding
    mean_batch: float
    hub_busy: float

    @property
    def vs_plain(self) -> float:
        return self.hub_tps / self.plain_tps


def simulate_reverse(inp: ReverseInputs, n: int, gamma: int, rounds: int = 200) -> ReversePrediction:
    """n drafting devices at γ >= 1 around the hub's batched, joining verify, `rounds` rounds each."""
    if gamma < 1:
        raise ValueError("a drafting device drafts at least one token a round")
    s = simulate_schedule(inp, [[Job(1, rounds * (gamma + 1))] for _ in range(n)], gamma)
    return ReversePrediction(n, gamma, s.hub_tps, s.per_device_tps, plain_batched_tps(inp, n), s.mean_batch,
                             min(1.0, s.busy_s / s.wall_s) if s.wall_s else 0.0)


def plain_batched_tps(inp: ReverseInputs, n: int) -> float:
    """The hub decoding for n clients at once, one token each per call (clients add no wait)."""
    return 1e3 * n / inp.hub_ms(n)


def sweep_reverse(inp: ReverseInputs, ns: Sequence[int], gammas: Sequence[int]) -> List[ReversePrediction]:
    """The best γ per N (hub tokens/s)."""
    return [max((simulate_reverse(inp, n, g) for g in gammas if g >= 1), key=lambda p: p.hub_tps) for n in ns]


def format_reverse(preds: Sequence[ReversePrediction]) -> str:
    rows = ["| N | γ | hub tok/s | per-device tok/s | plain batched tok/s | vs plain | mean batch | hub busy |",
            "|---|---|---|---|---|---|---|---|"]
    for p in preds:
        rows.append(f"| {p.n} | {p.gamma} | {p.hub_tps:.1f} | {p.per_device_tps:.2f} | {p.plain_tps:.1f} | "
                    f"{p.vs_plain:.2f}x | {p.mean_batch:.1f} | {p.hub_busy:.0%} |")
    return "\n".join(rows)
