"""What a remote draft's adaptive γ reads (edge/star/remote_drafter.py): the γ policy priced from
the target's verify costs and the waits seen, and a background probe's answer scored against the
tokens the target decoded meanwhile -- exactly what a greedy verify of them would have accepted."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from edge.speculative.common_prefix import common_prefix
from edge.speculative.remote_gamma import GammaPricing, RemoteGamma, RoundTrips
from edge.speculative.sampling import SamplingParams


def remote_gamma_policy(max_gamma: int, waits: RoundTrips, pricing: GammaPricing, sampling: dict) -> RemoteGamma:
    """γ from the running acceptance, the target's verify costs and the waits seen."""
    # With the cost curve measured, the primed first request (answered while the target
    # prefills: free) is the only exploring round; a second one costs a round at low α.
    # Greedy: a probe's drafts are scored against the target's own tokens, so probing does
    # not make the target wait (sampling has no such score: its probes are real rounds).
    # Background probes cost the target nothing: they start after 4 plain steps, not 16.
    background = SamplingParams.from_wire(sampling).greedy
    measured = bool(pricing.verify_costs)
    return RemoteGamma(max_gamma, waits, costs=pricing.cost_tracker(),
                       explore=1 if measured else 2, background=background,
                       probe_start=4 if background else 16, max_interval=32 if background else 64,
                       stop_aware=pricing.stop_aware, sharing=pricing.sharing)


def score_probe(probe: tuple, context: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(asked, accepted) of a background answer probe = (L, drafts, asked) once the target decoded
    past a mismatch or past all of its drafts; None while it has not. Drafts asked for and not
    sent (the service unsure of them) count as a rejection, as in a round."""
    L, drafts, asked = probe
    seen = list(context[L:L + len(drafts)])
    n = common_prefix(list(drafts), seen)
    if n < len(seen) or len(seen) == len(drafts):
        return max(asked, len(drafts)), n
    return None
