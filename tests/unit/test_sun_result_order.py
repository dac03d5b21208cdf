"""A SUN result names its workers in pipeline order (prefill, then decoder), whatever order their
messages arrive in: the prefill's token 0 and the decoder's first tokens travel on two links."""
from edge.sun.client import SunHandle
from edge.wire.protocol import SunRequest, SunTokens


def _handle() -> SunHandle:
    return SunHandle(SunRequest(client="c1", rid="r1", task="code", prompt=[1, 2], max_new=3), None)


def test_the_decoders_tokens_first_still_name_the_prefill_first():
    h = _handle()
    h._take(SunTokens(rid="r1", seq=1, index=1, tokens=[7, 8], done=True, finish_reason="length", worker="dec"))
    h._take(SunTokens(rid="r1", seq=0, index=0, tokens=[5], worker="pre"))
    r = h.wait(1)
    assert r.tokens == [5, 7, 8] and r.workers == ["pre", "dec"]


def test_in_order_and_a_decoders_done_echo_of_token_0():
    h = _handle()
    h._take(SunTokens(rid="r1", seq=0, index=0, tokens=[5], worker="pre"))
    h._take(SunTokens(rid="r1", seq=1, index=0, tokens=[5], done=True, finish_reason="stop", worker="dec"))
    r = h.wait(1)
    assert r.tokens == [5] and r.workers == ["pre", "dec"]
