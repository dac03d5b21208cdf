"""A chat or completions request body -> what to generate (Request), or a 400 naming the field.

check_fields (edge/api/request_fields.py) runs first: every field left is one this
endpoint honours, and each is read and range-checked here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from edge.api.request_fields import CHAT, COMPLETIONS, TOOLS, BadRequest, Profile, check_fields
from edge.api.tools import ToolRequest, read_tools, render, template_messages
from edge.speculative.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


@dataclass
class Request:
    chat: bool
    model: str
    ids: List[int]                     # the prompt, tokenised (chat: through the chat template)
    max_new: int
    params: SamplingParams
    stop: List[str]
    stream: bool = False
    include_usage: bool = False        # stream_options.include_usage: a last chunk with the usage
    logprobs: Optional[int] = None     # None: not asked; N: the token's logprob and N alternatives
    grammar: Optional[object] = None   # response_format's (edge/api/structured.py), set by the endpoint
    tools: Optional[ToolRequest] = None   # the tools offered and what tool_choice asks (edge/api/tools.py)


def number(body: dict, key: str, default, lo, hi, kind=float):
    """body[key] (default when absent or null), a number in [lo, hi], as `kind`."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"{key!r} must be a number in [{lo}, {hi}], got {str(v)[:40]}", key)
    if kind is int and v != int(v):
        raise BadRequest(f"{key!r} must be an integer, got {v!r}", key)
    return kind(v)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{key!r} must be true or false, got {str(v)[:40]}", key)
    return bool(v)


def _seed(body: dict) -> Optional[int]:
    v = body.get("seed")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63):
        raise BadRequest(f"'seed' must be an integer in [0, 2**63), got {str(v)[:40]}", "seed")
    return v


def chat_messages(body: dict) -> List[dict]:
    """The messages as {role, content: str} for the chat template; text parts are joined. An
    assistant's tool_calls (its content may then be null) and a tool message's tool_call_id pass on."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         for m in msgs):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for m in msgs:
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""
        if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest("'messages' content parts must be {type: text, text: ...}: this endpoint "
                                 "takes text only", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        out.append({"role": m["role"], "content": content,
                    **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}})
    return out


def prompt_ids(body: dict, tok) -> List[int]:
    """A completions prompt: a string, a one-string list, or token ids inside the vocabulary."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return tok.encode(p, add_special=True)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = getattr(tok, "vocab_size", 0)
        if vocab and not all(0 <= t < vocab for t in p):   # else the engine fails: a 500
            raise BadRequest(f"'prompt' token ids must be in [0, {vocab}) (this model's vocabulary)", "prompt")
        return list(p)
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def _max_tokens(body: dict, chat: bool, cap: int) -> int:
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise BadRequest(f"'max_tokens' ({str(mt)[:20]}) and 'max_completion_tokens' ({str(mct)[:20]}) differ: "
                         "send one", "max_completion_tokens")
    key = "max_completion_tokens" if mct is not None else "max_tokens"
    return number(body, key, 256 if chat else 16, 1, cap, int)


def _logit_bias(body: dict, vocab: int) -> tuple:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    out = []
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit() and (not vocab or int(k) < vocab)) or isinstance(v, bool) \
                or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias' maps token ids in [0, {vocab or 'vocab'}) to biases in [-100, 100]; "
                             f"got {str(k)[:20]!r}: {str(v)[:20]}", "logit_bias")
        out.append((int(k), float(v)))
    return tuple(sorted(out))


def sampling_params(body: dict, vocab: int) -> SamplingParams:
    if number(body, "n", 1, 1, 1 << 30, int) != 1:
        raise BadRequest("only n=1 is supported (send several requests: each is served at once)", "n")
    return SamplingParams(temperature=number(body, "temperature", 1.0, 0.0, 2.0),
                          top_p=number(body, "top_p", 1.0, 1e-6, 1.0),
                          top_k=number(body, "top_k", 0, 0, 4096, int),
                          seed=_seed(body),
                          presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
                          frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                          repetition_penalty=_repetition(body),
                          logit_bias=_logit_bias(body, vocab))


def _repetition(body: dict) -> float:
    r = number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if r <= 0:
        raise BadRequest("'repetition_penalty' must be in (0, 10] (1 is off)", "repetition_penalty")
    return r


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """How many alternatives per token to report, or None when logprobs are not asked for."""
    if chat:
        want = _flag(body, "logprobs")
        top = number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, int)
        if top and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return top if want else None
    n = body.get("logprobs")
    return None if n is None else number(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS, int)


def _stream(body: dict) -> tuple:
    """(stream, include_usage)."""
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object such as {\"include_usage\": true}", "stream_options")
    for k, v in opts.items():
        if k != "include_usage" and v not in (None, False):
            raise BadRequest(f"'stream_options.{str(k)[:40]}' is not supported (only include_usage is)",
                             "stream_options")
    return stream, _flag(opts, "include_usage")


def parse_request(body, chat: bool, tok, model: str, profile: Profile, max_tokens_cap: int,
                  context: Optional[int] = None) -> Request:
    """Validate `body` against this endpoint's rule and read it; raises BadRequest (a 400)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body, CHAT if chat else COMPLETIONS, profile)
    tools = read_tools(body, tok) if chat and TOOLS in profile.features else None
    if chat:
        try:
            ids = tok.encode(render(tok, template_messages(chat_messages(body)), tools))
        except BadRequest:
            raise
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
    else:
        ids = prompt_ids(body, tok)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens")
    max_new = _max_tokens(body, chat, max_tokens_cap)
    if context and len(ids) + max_new > context:
        raise BadRequest(f"the prompt has {len(ids)} tokens; with max_tokens={max_new} it exceeds the "
                         f"context of {context}", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", "stop")
    stream, include_usage = _stream(body)
    return Request(chat, model, ids, max_new, sampling_params(body, getattr(tok, "vocab_size", 0)), stop,
                   stream, include_usage, _logprobs(body, chat), tools=tools)
