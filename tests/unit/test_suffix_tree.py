"""The suffix trie (edge/speculative/suffix_tree.py) and one request's view of it (edge/speculative/suffix_drafter.py):
longest match, frequency scoring, adaptive length, the node bound, the fleet tree."""
import random

import pytest

from edge.speculative.suffix_drafter import SuffixConfig, SuffixContext
from edge.speculative.suffix_tree import SuffixTree


def occurrences(seqs, pattern):
    """Start positions of `pattern` in each sequence, by brute force."""
    n = len(pattern)
    return [(k, i) for k, s in enumerate(seqs) for i in range(len(s) - n + 1) if s[i:i + n] == pattern]


def brute_longest(seqs, context, depth):
    """Longest suffix (< depth tokens) of context that occurs followed by a token."""
    best = 0
    for n in range(1, min(depth - 1, len(context)) + 1):
        pat = context[len(context) - n:]
        if any(i + n < len(seqs[k]) for k, i in occurrences(seqs, pat)):
            best = n
    return best


def node_count(tree, pattern):
    n = tree._walk(pattern, len(pattern))
    return n.count if n else 0


def test_longest_match_and_counts_agree_with_brute_force():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    tree = SuffixTree(depth=7, max_nodes=10**6)
    for k, s in enumerate(seqs):
        tree.extend(k, s[:3])            # fed in pieces, as a session's appends arrive
        tree.extend(k, s[3:])
    for _ in range(300):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        n, node = tree.match(ctx)
        assert n == brute_longest(seqs, ctx, 7), ctx
        pat = ctx[len(ctx) - rng.randrange(1, len(ctx) + 1):][:7]
        assert node_count(tree, pat) == len(occurrences(seqs, pat)), pat


def test_the_most_frequent_continuation_wins_and_scores_by_frequency():
    tree = SuffixTree(depth=8, max_nodes=10**4)
    for k, tail in enumerate([[3, 4], [3, 4], [3, 5], [6, 7]]):
        tree.extend(k, [1, 2] + tail)
    p = tree.propose([9, 1, 2], max_tokens=4, min_prob=0.0, spec_factor=9)
    # [1, 2] continued with 3 three times of four, then 3 continued with 4 two times of three
    assert p.match_len == 2 and p.tokens == [3, 4]
    assert p.probs == pytest.approx([0.75, 0.5]) and p.score == pytest.approx(1.25)
    assert tree.propose([9, 1, 2], 4, min_prob=0.6, spec_factor=9).tokens == [3]   # 0.5 < 0.6: stop


def test_proposal_length_follows_the_match_length():
    tree = SuffixTree(depth=16, max_nodes=10**4)
    text = list(range(10, 30))
    tree.extend("a", text)
    short = tree.propose([99, 15], max_tokens=8, spec_factor=1.0)      # one-token match
    long = tree.propose([99] + text[:6], max_tokens=8, spec_factor=1.0)  # a six-token match
    assert short.tokens == [16] and short.match_len == 1
    assert long.tokens == text[6:12] and long.match_len == 6
    assert tree.propose([99] + text[:6], max_tokens=3).tokens == text[6:9]   # capped by gamma
    assert tree.propose([1, 2, 3], max_tokens=8).tokens == []                # never seen


def test_a_proposal_runs_past_the_depth_bound():
    tree = SuffixTree(depth=4, max_nodes=10**4)
    text = list(range(40))
    tree.extend("a", text)
    p = tree.propose(text[:3], max_tokens=10, spec_factor=5)
    assert p.tokens == text[3:13]


def test_the_node_bound_holds_and_eviction_leaves_a_consistent_tree():
    rng = random.Random(2)
    tree = SuffixTree(depth=6, max_nodes=2000)
    for k in range(60):
        tree.extend(k, [rng.randrange(30) for _ in range(rng.randrange(20, 120))])
        assert len(tree) <= 2000
    assert tree.evicted > 0 and 0 not in tree          # the oldest went first
    fresh = SuffixTree(depth=6, max_nodes=10**6)
    for k in tree.keys():
        fresh.extend(k, tree.tokens(k))
    assert len(fresh) == len(tree)                      # no leaked or missing nodes
    for k in tree.keys():
        tree.remove(k)
    assert len(tree) == 0 and tree.root.children is None


def test_one_long_sequence_keeps_a_window_within_the_bound():
    rng = random.Random(3)
    tree = SuffixTree(depth=8, max_nodes=1000)
    for _ in range(50):                                 # a session that never ends
        tree.extend("s", [rng.randrange(1000) for _ in range(40)])
        assert len(tree) <= 1000
    kept = tree.tokens("s")
    assert 0 < len(kept) < 2000
    assert tree.propose(kept[:5], 3).tokens == kept[5:8]   # the recent window still proposes


def test_the_global_tree_learns_from_another_session():
    cfg = SuffixConfig(depth=12)
    shared = cfg.global_tree()
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    a = SuffixContext(cfg, shared, key="a")
    a.sync([1, 2, 3, 7] + [0] * 20)                    # a prompt (longer than prompt_feed): local only
    context = a.tokens
    for i in range(0, len(answer), 2):                 # its output arrives a few tokens at a time
        context = context + answer[i:i + 2]
        a.sync(context, same=len(a.tokens))
    b = SuffixContext(cfg, shared, key="b")
    b.sync([9, 9, 8] + [0] * 20 + [50, 51, 52])       # another prompt, then the same first tokens
    p = b.propose(4)
    assert b.source == "global" and p.tokens == [53, 54, 55, 56]
    alone = SuffixContext(cfg, None, key="c")
    alone.sync(b.tokens)
    assert alone.propose(4).tokens == []                # without the fleet tree: nothing to say
    assert ("a", a.segment) in shared and len(shared.tokens(("a", a.segment))) == len(answer) + 4


def test_a_new_prompt_starts_a_new_local_tree():
    ctx = SuffixContext(SuffixConfig(), None)
    ctx.sync([1, 2, 3, 1, 2])
    assert ctx.propose(2).tokens == [3, 1]
    ctx.sync([7, 8, 9])                                 # not an extension: another request
    assert ctx.tokens == [7, 8, 9] and ctx.propose(2).tokens == []


def test_bad_settings_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(depth=1)
    with pytest.raises(ValueError, match="max_nodes"):
        SuffixTree(depth=8, max_nodes=4)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixConfig(min_prob=2.0)
