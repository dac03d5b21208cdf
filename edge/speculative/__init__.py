"""Speculative decoding, pure and local: sampling, the lossless verification, drafters, γ policies.

sampling.py (logits -> float64 distributions), verify.py (`verify_greedy`, `verify_stochastic`,
the cost model), generate.py (`generate_plain`, `generate_speculative`, `ModelDrafter`; γ's
bookkeeping in its rounds: gamma_rounds.py), drafter.py (the Drafter interface), ngram.py /
suffix_tree.py / suffix_drafter.py (model-free drafts), local_gamma.py and remote_gamma.py (how
many tokens to draft each round; their probe and refresh rounds: gamma_probes.py), verify_costs.py
(a target's measured verify curve), common_prefix.py.

May import: edge.engines, edge.model. No I/O, no threads.
"""
