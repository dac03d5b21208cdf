"""Why speculation did not pay in a run: the lines `edge-agent generate` prints under its table
when the speculative run was slower than the target alone, or γ=auto drafted in fewer than half
of its rounds.

Only what the run measured goes in: the target's call times (a verify over k tokens in single
steps, v(k)), the draft's step in target steps (c), the acceptance, the γ each round asked for.
With γ=auto these are the policy's own estimates (edge/speculative/local_gamma.py: what it chose
from); with a fixed γ they are read from the run's call timings the same way. What was not
measured is named as such (v(k) is a prior until a round drafts). Pure: no I/O.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from edge.speculative.verify import CostTracker, predicted_speedup

WHERE_IT_PAYS = ("a memory-bound target (F16 on a CPU, a GPU, a Jetson), where verifying several tokens costs "
                 "about one step, or the star (the draft on another core or device) is where it pays: see "
                 "docs/star.md")
COMPUTE_BOUND = 0.6       # v(k) >= this x k: a verify over k tokens costs nearly k steps
OPTIMISTIC_ALPHA = 0.8    # AdaptiveGamma's explore_alpha: the acceptance a run with no drafts is priced at


def costs_from_timings(*runs) -> CostTracker:
    """The runs' target and draft call times as the γ policy reads them (GenResults; the first
    target call of each is left out: it pays warm-up costs, as edge/speculative/gamma_rounds.py does)."""
    costs = CostTracker()
    for r in runs:
        verifies = [t for t in r.timings if t.kind == "verify"]
        for t in verifies[1:]:
            costs.add_target(t.n_tokens, t.seconds)
        for t in r.timings:
            if t.kind == "draft":
                costs.add_draft(t.n_tokens, t.seconds)
    return costs


def speedup_note(spec, plain=None, policy=None, max_gamma: int = 1) -> Optional[str]:
    """The lines that say why `spec` (a speculative GenResult) did not beat `plain` (the target
    alone, if run), or None when it did and γ=auto drafted in most rounds. policy: γ=auto's
    (AdaptiveGamma: its costs are used), None for a fixed γ (max_gamma)."""
    rounds, drafted = len(spec.gammas), sum(g > 0 for g in spec.gammas)
    ratio = spec.tokens_per_s / plain.tokens_per_s if plain is not None and plain.tokens_per_s else None
    if rounds == 0 or not ((ratio is not None and ratio < 1.0) or (policy is not None and 2 * drafted < rounds)):
        return None
    costs = policy.costs if policy is not None else costs_from_timings(spec, *([plain] if plain else []))
    if costs.target_seconds(1) is None:
        return None                              # no single step timed: nothing to say in its units
    top = policy.max_gamma if policy is not None else max_gamma
    head = (f"γ=auto drafted in {drafted} of {rounds} rounds" if policy is not None else
            f"γ={top} drafted in {drafted} of {rounds} rounds")
    if ratio is not None:
        head += f" ({ratio:.2f}x the target alone)"
    probe = sum(t.seconds for t in spec.timings if t.kind == "draft_probe")
    if drafted == 0 and probe and spec.decode_s > 0:
        head += (f": the target alone plus the draft's pricing probe ({probe:.2f} s, "
                 f"{probe / spec.decode_s:.0%} of the decode time)")
    c = costs.c if costs.has_draft else math.nan
    alpha = spec.acceptance_rate if spec.n_drafted else None
    margin = policy.margin if policy is not None else 0.0
    verdict, pays = _verdict(costs, c, alpha, top, margin)
    return "\n".join([head, "  " + _measured(costs, c, alpha, spec.n_drafted), "  " + verdict]
                     + ([] if pays else ["  " + WHERE_IT_PAYS]))


def _measured_ks(costs: CostTracker) -> List[int]:
    return [k for k in range(2, 65) if costs.samples(k)]


def _measured(costs: CostTracker, c: float, alpha: Optional[float], n_drafted: int) -> str:
    """What this run measured, in target single steps."""
    ks = _measured_ks(costs)
    if ks:
        k = max(ks, key=lambda k: (costs.samples(k), k))
        verify = f"a verify over {k} tokens costs {costs.verify_cost(k):.1f} single steps"
    else:
        verify = (f"a verify over k tokens was priced at 1 + {costs.prior_slope:g}·(k-1) single steps "
                  "(a prior: no round drafted to measure it)")
    draft = f"a draft step costs {c:.2f} target steps" if not math.isnan(c) else "the draft step was not timed"
    accept = (f"the target accepted {alpha:.0%} of {n_drafted} drafts" if alpha is not None
              else "no drafts were verified")
    return f"measured here: {draft}; {verify}; {accept}"


def _verdict(costs: CostTracker, c: float, alpha: Optional[float], top: int, margin: float) -> Tuple[str, bool]:
    """The best round the cost model allows and what stands in its way (`margin`: the gain over
    the target alone γ=auto asks for before it drafts); whether drafting pays by it."""
    a = alpha if alpha is not None else OPTIMISTIC_ALPHA
    cc = 0.0 if math.isnan(c) else c
    best, g = max((predicted_speedup(a, g, cc, costs.verify_cost), g) for g in range(1, max(1, top) + 1))
    at = f"at {a:.0%} acceptance" + (" (optimistic)" if alpha is None else "")
    why = []
    ks = _measured_ks(costs)
    if ks and costs.verify_cost(max(ks)) >= COMPUTE_BOUND * max(ks):
        why.append("the target is compute-bound here: a verify over k tokens costs ~k steps")
    if cc >= 0.2:
        why.append(f"each draft token costs {cc:.2f} of a target step")
    if alpha is not None and alpha < 0.5:
        why.append(f"the draft agrees with the target on only {alpha:.0%} of this text")
    line = f"{at} the best round (γ={g}) would run at {best:.2f}x the target alone"
    if best <= 1.0 + margin:
        bar = f", not above the {1.0 + margin:.2f}x γ=auto asks for" if margin else ""
        return f"{line}{bar}: drafting does not pay on this machine" + "".join(f"; {w}" for w in why), False
    return (f"{line}: drafting pays here, and this run was too short to show it (γ=auto times the target "
            "with plain steps first) or the machine too busy"), True
