"""The reverse star's wire since version 12: a verify_req's grammar and logprobs, a verify_resp's
logprobs -- validated and capped like every field (edge/wire/reverse_messages.py)."""
import pytest

from edge.speculative.grammar import MAX_GRAMMAR_BYTES
from edge.wire.protocol import ProtocolError, VerifyRequest, VerifyResponse, decode, encode
from edge.wire.reverse_messages import check_reverse_vocab

KEY = b"k" * 32
GID = "0123456789abcdef"


def test_a_request_names_its_grammar_and_logprobs():
    msg = decode(encode(VerifyRequest("a", 1, 0, [1, 2, 3], [4], grammar_id=GID, grammar='{"x": 1}',
                                      grammar_from=3, logprobs=5), KEY), KEY)
    assert (msg.grammar_id, msg.grammar, msg.grammar_from, msg.logprobs) == (GID, '{"x": 1}', 3, 5)


@pytest.mark.parametrize("kw, why", [
    ({"grammar": "text"}, "needs its grammar_id"),
    ({"grammar_id": GID, "grammar_from": 9}, "lies past the context"),
    ({"grammar_id": "not-hex"}, "grammar_id"),
    ({"grammar_id": GID, "grammar": "x" * (MAX_GRAMMAR_BYTES + 1)}, "grammar"),
    ({"logprobs": 21}, "logprobs"),
], ids=["text-without-id", "from-past-context", "bad-id", "over-the-cap", "too-many-alternatives"])
def test_bad_grammar_fields_are_refused(kw, why):
    with pytest.raises(ProtocolError, match=why):
        encode(VerifyRequest("a", 1, 0, [1, 2, 3], [4], **kw), KEY)


def test_an_answer_carries_one_entry_per_committed_token():
    entries = [(-0.1, [(4, -0.1), (9, -2.5)]), (-0.7, [])]
    msg = decode(encode(VerifyResponse("a", 1, 1, 5, 10, logprobs=entries), KEY), KEY)
    assert msg.logprobs == [[-0.1, [4, 9], [-0.1, -2.5]], [-0.7, [], []]]
    with pytest.raises(ProtocolError, match="one entry per committed token"):
        encode(VerifyResponse("a", 1, 2, 5, 10, logprobs=entries), KEY)
    with pytest.raises(ProtocolError, match="log-probability"):
        encode(VerifyResponse("a", 1, 0, 5, 10, logprobs=[(0.5, [])]), KEY)
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        check_reverse_vocab(msg, 8)                     # an alternative's id 9 >= 8
