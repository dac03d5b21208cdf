"""The reverse star's messages (since protocol version 10): a drafting device sends its drafts, the
hub's verify service answers what its target accepted (edge/wire/protocol.py re-exports them;
edge/star/verify_service.py has the flow, docs/protocol.md the tables).

Both travel on the session topics StarSD already has (ss/s/{client}/{sid}/{service}/up|down), signed
with the session secret the hub drew at the join (a Join with role "drafter"); the verify service's
hello is a DraftHello on ss/hub/verifiers/{service}.

Since version 12 a request may name a grammar (a response_format's or a forced tool_choice's,
llguidance's text, as DraftRequest names one) that the hub masks every verify row with, and ask for
logprobs: the answer then carries an entry per committed token, read from the target's (masked) rows.
"""
from __future__ import annotations

from typing import Optional

from edge.wire.envelope import Message, message, sampling_field, tokens_field, wire
from edge.wire.field_types import (GAMMA, GRAMMAR_ID, ID, MAX_GAMMA, MAX_VOCAB, SEQ, ProtocolError, QEntry, boolean,
                                   grammar_text, integer, sparse_q, split_q, wire_q)
from edge.wire.limits import MAX_APPEND, MAX_KEEP
from edge.wire.sun_messages import LOGPROBS, token_logprobs, wire_logprobs


@message("verify_req", session=True)
class VerifyRequest(Message):
    """device -> verify service: keep the first `keep` committed tokens the session holds, append
    `append` (the committed tokens it lacks: the whole prompt at first), then verify `drafts` after
    them with the target -- sampled against q, the exact top-k q each draft was drawn from."""
    sid: str = wire(ID)
    seq: int = wire(SEQ)
    keep: int = wire(integer(0, MAX_KEEP))
    append: list[int] = tokens_field(MAX_APPEND)
    drafts: list[int] = tokens_field(MAX_GAMMA, factory=list)     # none: the hub decodes one token
    q: Optional[list[QEntry]] = wire(sparse_q, None, send=wire_q)   # None: greedy
    sampling: dict = sampling_field()
    # the first request of a generation: the target's sampling stream starts from the seed again
    # (a seeded generation replays); any other request of a new session draws a fresh stream
    start: bool = wire(boolean, False)
    # constrained output (since version 12): the grammar the TARGET's rows are masked with, named by its
    # id on every request, its text sent until an answer to a request carrying it came; it governs the
    # context from position grammar_from on (the generated part)
    grammar_id: str = wire(GRAMMAR_ID, "")
    grammar: str = wire(grammar_text, "")
    grammar_from: int = wire(integer(0, MAX_KEEP), 0)
    logprobs: Optional[int] = wire(LOGPROBS, None)     # alternatives per committed token (None: no logprobs)

    def check_rules(self) -> None:
        if self.keep + len(self.append) == 0:
            raise ProtocolError("verify_req names no context: keep=0 and an empty append")
        if self.grammar and not self.grammar_id:
            raise ProtocolError("verify_req.grammar needs its grammar_id")
        if self.grammar_id and self.grammar_from > self.keep + len(self.append):
            raise ProtocolError("verify_req.grammar_from lies past the context it names")
        greedy = self.sampling["temperature"] == 0.0
        if greedy and self.q is not None:
            raise ProtocolError("verify_req: a greedy request carries no q")
        if not greedy and self.drafts and self.q is None:
            raise ProtocolError("verify_req: a sampled request carries the q of its drafts")
        if self.q is not None:
            self.q = split_q(self.q, self.drafts)


@message("verify_resp", session=True)
class VerifyResponse(Message):
    """verify service -> device: the first `n_accepted` drafts stand, then `token` (the target's
    correction at the first rejection, or its bonus after them all). After it the session holds
    `held` committed tokens: the request's context + drafts[:n_accepted] + [token]. The device's next
    request keeps the request's context and appends that round's tokens itself (edge/star/drafting_device.py)."""
    sid: str = wire(ID)
    seq: int = wire(SEQ)
    n_accepted: int = wire(GAMMA)
    token: int = wire(integer(0, MAX_VOCAB - 1))
    held: int = wire(integer(1, MAX_KEEP))
    compute_us: int = wire(integer(0, 1 << 40), 0)  # the hub's time on it: round trip - this = network
    batch: int = wire(integer(0, 1 << 20), 0)        # sessions verified in the same engine call
    # since version 12, when the request asked for logprobs: one [logprob, [ids], [logprobs]] per
    # committed token (the accepted drafts, then `token`), from the target's rows after the grammar's mask
    logprobs: list = wire(token_logprobs, factory=list, send=wire_logprobs)

    def check_rules(self) -> None:
        if self.logprobs and len(self.logprobs) != self.n_accepted + 1:
            raise ProtocolError("verify_resp.logprobs has one entry per committed token (n_accepted + 1), or none")


def check_reverse_vocab(msg: Message, vocab_size: int) -> None:
    """Raise if a reverse-star message names a token outside the receiver's vocabulary."""
    ids: list = []
    if isinstance(msg, VerifyRequest):
        ids = list(msg.append) + list(msg.drafts) + [int(i.max()) for i, _ in (msg.q or [])]
    elif isinstance(msg, VerifyResponse):
        ids = [msg.token] + [t for e in msg.logprobs for t in e[1]]
    if ids and max(ids) >= vocab_size:
        raise ProtocolError(f"token id {max(ids)} is outside the vocabulary of {vocab_size}")
