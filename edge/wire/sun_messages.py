"""The SUN messages of the wire format: requests, worker hellos, prefill jobs and decode
assignments, KV chunks, streamed tokens, adapter adds (edge/wire/protocol.py re-exports them;
edge/sun/prefill_node.py has the flow).

A request may carry a grammar (`grammar`: llguidance's text, what a target's endpoint compiles
for response_format or a forced tool_choice; "" for none) that the prefill worker's token 0 and
every decoder step follow, and ask for logprobs (`logprobs`: the number of alternatives, None for
none); the workers then send each token's entry with it (SunTokens.logprobs).
"""
from __future__ import annotations

import math
from typing import Any, Optional

from edge.wire.envelope import Message, message, sampling_field, tokens_field, wire
from edge.wire.field_types import (FINGERPRINT, ID, ID_OR_EMPTY, MAX_VOCAB, MESSAGE_TEXT, SEQ, SHA256, VOCAB_SIZE,
                              ProtocolError, _short, boolean, grammar_text, id_list, integer, new_secret, one_of,
                              optional, raw_bytes, secret_bytes, text)
from edge.wire.limits import (FINISH_REASONS, MAX_APPEND, MAX_KV_CHUNKS, MAX_NEW_TOKENS, MAX_STOP,
                              MAX_STREAM_TOKENS, SUN_CHUNK_BYTES, SUN_ROLES)

MAX_TOP_LOGPROBS = 20          # alternatives per token a request may ask for (OpenAI's limit)
LOGPROBS = optional(integer(0, MAX_TOP_LOGPROBS))   # None: no logprobs; N: each token's and N alternatives


def _logprob(name: str, v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or v > 1e-6:
        raise ProtocolError(f"{name} must be a finite log-probability (<= 0), got {_short(v)}")
    return float(v)


def token_logprobs(name: str, v: Any) -> list:
    """Per token [logprob, [alternative ids], [their logprobs]] (at most MAX_TOP_LOGPROBS
    alternatives, most likely first), or [] when the request asked for none."""
    if not isinstance(v, list) or len(v) > MAX_STREAM_TOKENS:
        raise ProtocolError(f"{name} must be a list of at most {MAX_STREAM_TOKENS} entries, got {_short(v)}")
    out = []
    for i, e in enumerate(v):
        if not (isinstance(e, list) and len(e) == 3 and isinstance(e[1], list) and isinstance(e[2], list)
                and len(e[1]) == len(e[2]) <= MAX_TOP_LOGPROBS):
            raise ProtocolError(f"{name}[{i}] must be [logprob, [ids], [logprobs]] with at most "
                                f"{MAX_TOP_LOGPROBS} alternatives, got {_short(e)}")
        alts = [integer(0, MAX_VOCAB - 1)(f"{name}[{i}] id", t) for t in e[1]]
        out.append([_logprob(f"{name}[{i}]", e[0]), alts, [_logprob(f"{name}[{i}]", x) for x in e[2]]])
    return out


def wire_logprobs(v: Any) -> Any:
    """(logprob, [(id, logprob), ...]) entries, as edge/speculative/sampling.py's top_logprobs gives
    them, -> the wire's lists (lists on the wire pass as they are)."""
    if not isinstance(v, (list, tuple)):
        return v
    out = []
    for e in v:
        if isinstance(e, tuple) and len(e) == 2:
            e = [float(e[0]), [int(t) for t, _ in e[1]], [float(x) for _, x in e[1]]]
        out.append(e)
    return out


@message("sun_req")
class SunRequest(Message):
    client: str = wire(ID)
    rid: str = wire(ID)                         # request id, chosen by the client
    task: str = wire(ID)                        # names the specialist (prefill worker) to use
    prompt: list[int] = tokens_field(MAX_APPEND)
    max_new: int = wire(integer(1, MAX_NEW_TOKENS), 64)   # answer tokens, the prefill's first included
    sampling: dict = sampling_field()
    stop: list[int] = tokens_field(MAX_STOP, factory=list)
    secret: bytes = wire(secret_bytes(empty=False), factory=new_secret)   # the request's key: signs its KV and tokens
    grammar: str = wire(grammar_text, "")       # the grammar every answer token follows ("": none)
    logprobs: Optional[int] = wire(LOGPROBS, None)   # alternatives per token to report (None: no logprobs)


@message("sun_hello")
class SunHello(Message):
    worker: str = wire(ID)
    role: str = wire(one_of(SUN_ROLES))         # "prefill" or "decoder"
    task: str = wire(ID_OR_EMPTY)               # prefill: the task served; decoder: ""
    fingerprint: str = wire(FINGERPRINT)        # the decoder the KV is made for / this decoder is
    vocab_size: int = wire(VOCAB_SIZE)
    online: bool = wire(boolean, True)
    load: int = wire(integer(0, 1 << 20), 0)    # decoder: running + awaited; prefill: queued jobs
    capacity: int = wire(integer(0, 1 << 20), 64)   # decoder: max batch
    served: int = wire(SEQ, 0)                  # jobs / assignments received (in-flight accounting)
    max_load: int = wire(integer(0, 1 << 20), 0)   # the load past which it refuses (0: not said)
    tasks: list[str] = wire(id_list, factory=list)  # prefill with adapters: every task it serves ([]: `task` only)
    grammars: bool = wire(boolean, False)       # it can follow a request's grammar (it holds a tokenizer)

    def check_rules(self) -> None:
        if (self.role == "prefill") != bool(self.task or self.tasks):
            raise ProtocolError("sun_hello: a prefill worker names its task, a decoder names none")
        if self.tasks and self.task not in self.tasks:
            raise ProtocolError("sun_hello: a worker serving several tasks names one of them as its task")


@message("sun_prefill")
class PrefillJob(Message):
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    secret: bytes = wire(secret_bytes(empty=False))
    task: str = wire(ID)
    prompt: list[int] = tokens_field(MAX_APPEND)
    sampling: dict = sampling_field()
    decoder: str = wire(ID, kw_only=True)       # where the KV goes (no default: "" is no worker)
    grammar: str = wire(grammar_text, "")       # token 0 follows it ("": none)
    logprobs: Optional[int] = wire(LOGPROBS, None)


@message("sun_assign")
class DecodeAssign(Message):
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    secret: bytes = wire(secret_bytes(empty=False))
    task: str = wire(ID)
    max_new: int = wire(integer(1, MAX_NEW_TOKENS), 64)
    sampling: dict = sampling_field()
    stop: list[int] = tokens_field(MAX_STOP, factory=list)
    prefill: str = wire(ID, kw_only=True)       # who sends the KV (the decoder holds only its early KV)
    grammar: str = wire(grammar_text, "")       # tokens 1.. follow it, after token 0 ("": none)
    logprobs: Optional[int] = wire(LOGPROBS, None)
    # a copy the router sends again after its prefill worker said it is done: the KV went out, so a
    # decoder still missing any of it once the chunks before the copy are in lost it on the way
    kv_sent: bool = wire(boolean, False)


@message("sun_kv", session=True, id_field="rid")
class KVChunk(Message):
    rid: str = wire(ID)
    index: int = wire(integer(0, MAX_KV_CHUNKS - 1))
    total: int = wire(integer(1, MAX_KV_CHUNKS))
    first_token: int = wire(integer(0, MAX_VOCAB - 1))
    data: bytes = wire(raw_bytes(1, SUN_CHUNK_BYTES))

    def check_rules(self) -> None:
        if self.index >= self.total:
            raise ProtocolError(f"sun_kv: chunk {self.index} of {self.total} is out of range")


@message("sun_tokens", session=True, id_field="rid")
class SunTokens(Message):
    rid: str = wire(ID)
    seq: int = wire(SEQ)                        # per sender; the receiver accepts each once
    index: int = wire(integer(0, MAX_NEW_TOKENS))   # answer position of tokens[0] (0 = the prefill's)
    tokens: list[int] = tokens_field(MAX_STREAM_TOKENS)
    done: bool = wire(boolean, False)
    finish_reason: str = wire(one_of(FINISH_REASONS, 16, empty=True), "")   # when done
    worker: str = wire(ID_OR_EMPTY, "")         # who produced them
    logprobs: list = wire(token_logprobs, factory=list, send=wire_logprobs)   # [] or one entry per token

    def check_rules(self) -> None:
        if self.done != bool(self.finish_reason):
            raise ProtocolError("sun_tokens: a finish_reason comes with done, and only then")
        if self.logprobs and len(self.logprobs) != len(self.tokens):
            raise ProtocolError("sun_tokens: logprobs has one entry per token, or none")


@message("sun_adapter_add")
class AdapterAdd(Message):
    """operator / hub -> a prefill worker with adapters, on its ctl topic, signed with the ctl key:
    load `task`'s adapter from `path` (an adapter directory or GGUF file, or with `bundle` a bundle
    whose manifest lists `task`) after checking its weights file's sha256. The answer
    (AdapterResult, signed with the ctl key) goes to ss/sun/r/{client}/{rid}."""
    worker: str = wire(ID)
    rid: str = wire(ID)
    client: str = wire(ID)
    task: str = wire(ID)
    path: str = wire(text(None, 4096))
    sha256: str = wire(SHA256)
    bundle: bool = wire(boolean, False)

    def check_rules(self) -> None:
        if not self.path:
            raise ProtocolError("sun_adapter_add: path names the adapter file or bundle")


@message("sun_adapter_result")
class AdapterResult(Message):
    """prefill worker -> the AdapterAdd's sender: loaded (ok) or refused, with why."""
    worker: str = wire(ID)
    rid: str = wire(ID)
    task: str = wire(ID)
    ok: bool = wire(boolean)
    message: str = wire(MESSAGE_TEXT, "")
    tasks: list[str] = wire(id_list, factory=list)     # what the worker serves now
