"""A count-bounded suffix trie: how often each short substring of some token sequences
occurred, and what most often followed it (SuffixDecoding, Oliaro et al. 2024).

Every substring of length <= `depth` of the indexed sequences is a path from the root;
a node's `count` is how many times its substring starts somewhere in them. Appending a
token extends the open suffixes (at most depth - 1 of them) by one node each: O(depth)
per token. A proposal finds the longest suffix of the context that occurred *with a
continuation* (binary search: if a string occurred followed by x, so did each of its
suffixes) and walks down the most frequent child while the path's probability (the
product of child count / sum of its siblings' counts) stays >= min_prob. Its score is
the sum of those probabilities (the expected number of accepted tokens if the counts
are the truth); its length is capped at spec_factor x match length + spec_offset (a
long match predicts far, a one-token match barely at all).

Memory is bounded by a node count: after each `extend`, while the trie holds more than
`max_nodes` nodes, the least recently extended sequence is forgotten (all of it; the
last sequence left loses its oldest quarter instead, so the bound holds for one long
sequence too). So nodes <= max_nodes between calls, whatever is fed. Pure Python, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: Optional[Dict[int, "_Node"]] = None   # made on the first child: most nodes are leaves


class _Seq:
    """One indexed sequence: its tokens from `base` on, and the nodes of its open suffixes."""
    __slots__ = ("tokens", "base", "open")

    def __init__(self) -> None:
        self.tokens: List[int] = []
        self.base = 0                              # absolute position of tokens[0]
        self.open: List[Tuple[int, _Node]] = []    # (start position, node) of suffixes shorter than depth


@dataclass
class Proposal:
    tokens: List[int] = field(default_factory=list)
    probs: List[float] = field(default_factory=list)   # path probability after each token
    match_len: int = 0                                 # context suffix the proposal continues

    @property
    def score(self) -> float:
        """Expected accepted tokens under the counts: the sum of the path probabilities."""
        return float(sum(self.probs))


class SuffixTree:
    def __init__(self, depth: int = 24, max_nodes: int = 200_000):
        if not (isinstance(depth, int) and depth >= 2):
            raise ValueError(f"depth must be an integer >= 2 (longest substring indexed), got {depth!r}")
        if not (isinstance(max_nodes, int) and max_nodes >= depth):
            raise ValueError(f"max_nodes must be an integer >= depth ({depth}), got {max_nodes!r}")
        self.depth, self.max_nodes = depth, max_nodes
        self.root = _Node()
        self.nodes = 0                              # nodes below the root
        self.evicted = 0                            # sequences (or parts) forgotten for the bound
        self._seqs: "OrderedDict[Hashable, _Seq]" = OrderedDict()

    def __len__(self) -> int:
        return self.nodes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def keys(self) -> List[Hashable]:
        return list(self._seqs)

    def tokens(self, key: Hashable) -> List[int]:
        """The tokens of `key` still indexed."""
        s = self._seqs.get(key)
        return list(s.tokens) if s else []

    # ---- feeding ----
    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `key` (a new one if unknown), then keep the node bound."""
        s = self._seqs.get(key)
        if s is None:
            s = self._seqs[key] = _Seq()
        self._seqs.move_to_end(key)                 # the most recently extended is evicted last
        depth, root = self.depth, self.root
        for t in tokens:
            t = int(t)
            pos = s.base + len(s.tokens)
            s.tokens.append(t)
            grown = []
            for start, node in s.open + [(pos, root)]:
                ch = node.children
                if ch is None:
                    ch = node.children = {}
                child = ch.get(t)
                if child is None:
                    child = ch[t] = _Node()
                    self.nodes += 1
                child.count += 1
                if pos - start + 1 < depth:
                    grown.append((start, child))
            s.open = grown
            if self.nodes > self.max_nodes:     # inside the loop: a long prompt never overshoots
                self._bound(key)

    def remove(self, key: Hashable) -> None:
        """Forget sequence `key` entirely."""
        s = self._seqs.pop(key, None)
        if s is not None:
            self._trim(s, s.base + len(s.tokens))

    def _trim(self, s: _Seq, upto: int) -> None:
        """Un-index the suffixes of `s` that start before absolute position `upto`."""
        depth, toks, base = self.depth, s.tokens, s.base
        for start in range(base, upto):
            node = self.root
            for t in toks[start - base:start - base + depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:                # its whole subtree goes with it
                    self.nodes -= 1
                    del node.children[t]
                    if not node.children:
                        node.children = None
                node = child
        del toks[:upto - base]
        s.base = upto
        s.open = [(st, n) for st, n in s.open if st >= upto]

    def _bound(self, current: Hashable) -> None:
        """Forget the least recently extended sequences (never `current`, the one being fed)
        until the bound holds; alone, `current` loses its oldest quarter at a time."""
        while self.nodes > self.max_nodes:
            self.evicted += 1
            key = next(iter(self._seqs))
            if key != current:
                self.remove(key)
            else:
                s = self._seqs[key]
                self._trim(s, s.base + max(1, len(s.tokens) // 4))

    # ---- proposing ----
    def _walk(self, context: Sequence[int], n: int) -> Optional[_Node]:
        node = self.root
        for t in context[len(context) - n:]:
            ch = node.children
            node = ch.get(t) if ch else None
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int]) -> Tuple[int, Optional[_Node]]:
        """(n, node) for the longest suffix of `context` (n < depth tokens) that occurred
        followed by something; (0, None) if not even its last token did."""
        lo, hi, best = 1, min(self.depth - 1, len(context)), (0, None)
        while lo <= hi:                             # "occurred with a continuation" shrinks with n
            mid = (lo + hi) // 2
            node = self._walk(context, mid)
            if node is not None and node.children:
                best, lo = (mid, node), mid + 1
            else:
                hi = mid - 1
        return best

    def propose(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.1,
                spec_factor: float = 1.0, spec_offset: float = 0.0) -> Proposal:
        """The most frequent continuation of `context`: up to min(max_tokens, spec_factor *
        match length + spec_offset) tokens, stopping where the path probability < min_prob."""
        n, node = self.match(context)
        out = Proposal(match_len=n)
        if node is None:
            return out
        limit = min(int(max_tokens), int(spec_factor * n + spec_offset))
        prob, walked = 1.0, list(context[len(context) - n:])
        while len(out.tokens) < limit:
            if not node.children:                   # the depth bound: match again from here
                n2, node = self.match(walked)
                if node is None:
                    break
                walked = walked[len(walked) - n2:]
            total, best_t, best = 0, -1, None
            for t, c in node.children.items():
                total += c.count
                if best is None or c.count > best.count or (c.count == best.count and t < best_t):
                    best_t, best = t, c
            prob *= best.count / total
            if prob < min_prob:
                break
            out.tokens.append(best_t)
            out.probs.append(prob)
            walked.append(best_t)
            node = best
        return out
