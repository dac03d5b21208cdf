"""Model-free drafting from suffix trees (SuffixDecoding): a tree over the request's own
prompt and output, and one global tree over recent outputs of every request that shares it.

`SuffixContext` is one request's view: it indexes the request's committed tokens in its
local tree as they grow, feeds the tokens that look like output (appends of at most
`prompt_feed` tokens; a longer one is a prompt, kept local) into the shared global tree,
and proposes from whichever tree scores higher. `SuffixDrafter` plugs one into
edge.speculative.generate; the StarSD services (edge/star/suffix_service.py, hybrid_draft.py) keep one
per session over one global tree, so every session teaches every other.

Proposals are deterministic: q is the point mass at each proposed token (as NgramDrafter
sends it), so verification stays exactly lossless under sampling.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Tuple

import numpy as np

from edge.speculative.drafter import Drafter
from edge.speculative.sampling import SparseDist
from edge.speculative.suffix_tree import Proposal, SuffixTree

HEAD = 4                             # context tokens an output's shared sequence starts with
_keys = itertools.count()            # distinct shared-tree keys for drafters made without one


@dataclass
class SuffixConfig:
    # Bounds are in trie nodes; a node costs ~260 B in CPython (tracemalloc, 2026-12-01), and
    # a token of fresh text makes up to `depth` of them (repeated text far fewer).
    depth: int = 24                  # the fleet tree's longest substring (vLLM's default max_tree_depth)
    local_depth: int = 16            # a request's own tree: its matches are specific sooner
    max_global_nodes: int = 400_000  # the fleet tree's bound: ~100 MB
    max_local_nodes: int = 32_768    # each request's bound: ~8.5 MB, >= ~2k tokens of fresh text
    min_prob: float = 0.1            # stop a proposal where its path probability falls below this
    spec_factor: float = 1.0         # propose at most spec_factor x match length (+ offset) tokens
    spec_offset: float = 0.0
    prompt_feed: int = 17            # a longer append is a prompt: local tree only, not the fleet's

    def __post_init__(self):
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob!r}")
        if self.spec_factor <= 0 and self.spec_offset <= 0:
            raise ValueError("spec_factor or spec_offset must be > 0, or nothing is ever proposed")

    def global_tree(self) -> SuffixTree:
        return SuffixTree(self.depth, self.max_global_nodes)


class SuffixContext:
    """One request: its committed tokens in a local tree, its outputs into `shared`."""

    def __init__(self, cfg: SuffixConfig, shared: Optional[SuffixTree] = None, key: Hashable = 0):
        self.cfg, self.shared, self.key = cfg, shared, key
        self.segment = 0                 # a new prompt starts a new sequence in the shared tree
        self.local = SuffixTree(cfg.local_depth, cfg.max_local_nodes)
        self.tokens: List[int] = []      # what the local tree was fed, in order
        self.last: Proposal = Proposal()
        self.source = ""                 # "local" / "global": where the last proposal came from

    def sync(self, context: Sequence[int], same: int = 0) -> None:
        """Make `context` the request's committed tokens; `same`: its first `same` tokens
        are known to equal what was synced before (a DraftRequest's keep)."""
        n = len(self.tokens)
        same = min(same, n)
        if len(context) >= n and list(context[same:n]) == self.tokens[same:]:
            self._extend(context[n:])
            return
        self.local = SuffixTree(self.cfg.local_depth, self.cfg.max_local_nodes)   # another request
        self.tokens = []
        self.segment += 1
        self._extend(context)

    def _extend(self, new: Sequence[int]) -> None:
        if not len(new):
            return
        new = [int(t) for t in new]
        self.local.extend(0, new)
        self.tokens.extend(new)
        if self.shared is None:
            return
        if len(new) > self.cfg.prompt_feed:
            self.segment += 1            # a prompt: outputs after it are a sequence of their own
        else:
            # an output's shared sequence starts with the few tokens before it, so the fleet
            # tree also learns how outputs begin (after a chat template's assistant header)
            key = (self.key, self.segment)
            if key not in self.shared:
                head = self.tokens[max(0, len(self.tokens) - len(new) - HEAD):len(self.tokens) - len(new)]
                new = head + new
            self.shared.extend(key, new)

    def propose(self, gamma: int) -> Proposal:
        """The better-scoring proposal of the local and the shared tree (at most gamma tokens)."""
        c = self.cfg
        kw = dict(min_prob=c.min_prob, spec_factor=c.spec_factor, spec_offset=c.spec_offset)
        best, self.source = self.local.propose(self.tokens, gamma, **kw), "local"
        if self.shared is not None and gamma > 0:
            g = self.shared.propose(self.tokens, gamma, **kw)
            if g.score > best.score:
                best, self.source = g, "global"
        self.last = best
        return best

    def close(self) -> None:
        """The request ended: its local tree goes; its outputs stay in the shared tree."""
        self.local = SuffixTree(self.cfg.local_depth, self.cfg.local_depth)
        self.tokens = []


class SuffixDrafter(Drafter):
    """edge.speculative.generate's Drafter over a SuffixContext. Pass one `shared` tree to many drafters
    (or generations) to let them learn from each other's outputs."""
    name = "suffix"
    vocab_size: Optional[int] = None     # works with any vocabulary

    def __init__(self, cfg: Optional[SuffixConfig] = None, shared: Optional[SuffixTree] = None,
                 key: Optional[Hashable] = None):
        self.cfg = cfg or SuffixConfig()
        self.shared = shared if shared is not None else self.cfg.global_tree()
        self.ctx = SuffixContext(self.cfg, self.shared, f"drafter-{next(_keys)}" if key is None else key)

    def prefill(self, prompt: Sequence[int]) -> bool:
        self.ctx.sync(prompt)
        return False                     # microseconds to milliseconds: not worth a timing line

    def draft(self, context: Sequence[int], gamma: int,
              rng: Optional[np.random.Generator] = None) -> Tuple[List[int], List[SparseDist]]:
        """The proposal and its q: one-hot at each token (a deterministic draft is a sample
        from the point mass at it, so stochastic verification stays exactly lossless)."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        self.ctx.sync(context)
        tokens = self.ctx.propose(gamma).tokens if gamma else []
        return tokens, [SparseDist.one_hot(t) for t in tokens]

    def close(self) -> None:
        self.ctx.close()
