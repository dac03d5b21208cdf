"""StarSD: one draft service for many targets, each verifying on its own device.

Draft side: draft_service.py (`DraftService`, the model draft core), suffix_service.py and
hybrid_service.py (model-free and mixed cores), draft_kinds.py (which core a service runs),
draft_node.py (a core on the star), draft_sessions.py / draft_chain.py / draft_limits.py /
draft_stats.py / batch_hold.py (its state, limits, accounting and batching), engine_sessions.py
(what the draft and the reverse star's verify service share over one engine's sequences).
Target side: target.py (`StarTarget`), remote_drafter.py (a hub session as a Drafter; its round
state and counters in remote_round.py, its adaptive γ's policy and probe score in
remote_probe.py), hub_client.py.

May import: edge.runtime and below. Not edge.sun.
"""
