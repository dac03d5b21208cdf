"""best_kept: which kept hub session a new prompt takes (edge/star/session_reuse.py) -- its own
conversation's, never another's while there is room for a new one."""
from edge.star.session_reuse import KeptSession, best_kept

SYSTEM = list(range(1, 41))


def kept(*helds):
    return [KeptSession(session=name, held=tuple(h), since=float(i)) for i, (name, h) in enumerate(helds)]


def taken(k):
    return None if k is None else k.session


def test_a_conversations_next_turn_takes_its_own_session_even_with_room():
    ks = kept(("a", SYSTEM + [50, 51, 52]), ("b", SYSTEM + [60, 61]))
    assert taken(best_kept(ks, SYSTEM + [60, 61, 62, 63], room=True)) == "b"
    assert [k.session for k in ks] == ["a"]


def test_the_same_prompt_asked_again_takes_the_session_that_holds_it():
    ks = kept(("a", SYSTEM + [50, 51, 52, 53]), ("b", SYSTEM + [60]))
    assert taken(best_kept(ks, SYSTEM + [50, 51], room=True)) == "a"


def test_another_conversation_joins_anew_while_there_is_room():
    ks = kept(("a", SYSTEM + [50, 51]))
    assert best_kept(ks, SYSTEM + [70, 71], room=True) is None and len(ks) == 1


def test_without_room_the_longest_shared_prefix_then_the_oldest():
    ks = kept(("a", SYSTEM[:10] + [99]), ("b", SYSTEM + [50]), ("c", SYSTEM + [60]))
    assert taken(best_kept(ks, SYSTEM + [70], room=False)) == "c"     # b and c tie: the latest
    ks = kept(("a", [7, 8]), ("b", [9]))
    assert taken(best_kept(ks, [1, 2, 3], room=False)) == "a"          # nothing shared: the oldest
    assert best_kept([], [1, 2], room=False) is None
