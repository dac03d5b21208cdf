"""The runtime every networked role shares: one engine loop, one node base.

loop.py (`EngineLoop`: drives a core -- core.py's `EngineCore`: has_work / step -- on one
thread), node.py (`Node`: a core on a loop, announced on the star), isolated_step.py (a batched
step in which one bad sequence fails alone).

May import: edge.speculative, edge.engines, edge.model, edge.wire.
"""
