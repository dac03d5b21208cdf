"""Every request field of /v1/chat/completions and /v1/completions, and what an endpoint does with it.

One table (FIELDS) serves both OpenAI endpoints -- a target's
(edge/api/openai_http.py) and the SUN hub's (server/sun_http.py) -- and
docs/api.md is its prose (tests/system/test_api_fields.py checks that they
agree). The rule, checked by check_fields before anything else is read:

* a field this table does not list for the API is refused with a 400 that
  names it (as OpenAI's own API does: a misspelt field never passes quietly);
* null, and a value that asks for nothing (a field's `neutral` values:
  `n: 1`, `tools: []`, `frequency_penalty: 0`), is accepted everywhere;
* HONOURED: the endpoint does what it asks -- where the field `needs` a
  feature the endpoint lacks (Profile.features), a 400 that names the field
  and says why;
* IGNORED: it cannot change the output (bookkeeping such as `user`): accepted
  and ignored, by rule and documented;
* REFUSED: a 400 naming it, "not supported yet".

Extension point: a capability that lands (tools, response_format) flips its
rows from REFUSED to HONOURED (with `needs` if only some endpoints can), and
edge/api/request.py reads the value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
CHAT, COMPLETIONS = "chat", "completions"
BOTH: FrozenSet[str] = frozenset({CHAT, COMPLETIONS})
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}

# What an endpoint's generation can do beyond text: a field that needs one is honoured only there.
LOGPROBS = "logprobs"          # the generator hands back the target's row for each token
PENALTIES = "penalties"        # the generator adjusts its logits (penalties, logit_bias)
STRUCTURED = "structured"      # the generator follows a grammar (response_format, edge/api/structured.py)
TOOLS = "tools"                # the chat template renders tools, the reply's calls are parsed (edge/api/tools.py)


class BadRequest(ValueError):
    """A request the endpoint answers with a 400; `param` names the field at fault, if one is."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Profile:
    """What one endpoint can honour: its features, and why it lacks the others (for the 400).
    logprob_entries: its generator reports each token's logprob entry (on_logprob: the SUN workers
    compute them from their rows) instead of handing over the rows (on_logits)."""
    name: str
    features: FrozenSet[str]
    lacks_because: str = ""
    logprob_entries: bool = False


TARGET = Profile("target", frozenset({LOGPROBS, PENALTIES, STRUCTURED, TOOLS}))
# the SUN workers mask each row by the request's grammar and report logprobs from it (edge/sun/token_rules.py)
SUN_HUB = Profile("SUN hub", frozenset({LOGPROBS, STRUCTURED, TOOLS}),
                  "the shared decoder samples without penalties or logit_bias", logprob_entries=True)


@dataclass(frozen=True)
class Field:
    name: str
    rule: str
    apis: FrozenSet[str] = BOTH
    needs: Optional[str] = None
    neutral: Tuple = ()
    doc: str = ""


def _f(name, rule, doc, apis=BOTH, needs=None, neutral=()) -> Field:
    return Field(name, rule, apis, needs, neutral, doc)


_CHAT_ONLY, _COMPLETIONS_ONLY = frozenset({CHAT}), frozenset({COMPLETIONS})
FIELDS: Dict[str, Field] = {f.name: f for f in (
    # the request itself
    _f("model", HONOURED, "target: any name (one model per endpoint; the answer names it). SUN hub: the task, "
                          "one of GET /v1/models, else a 400"),
    _f("messages", HONOURED, "roles system/user/assistant; content a string or a list of text parts",
       _CHAT_ONLY),
    _f("prompt", HONOURED, "a string, a one-string list, or a list of token ids", _COMPLETIONS_ONLY),
    # length and stopping
    _f("max_tokens", HONOURED, "at most the endpoint's cap (4096); default 256 (chat), 16 (completions)"),
    _f("max_completion_tokens", HONOURED, "max_tokens under its newer name; both given must agree", _CHAT_ONLY),
    _f("stop", HONOURED, "a string or up to 4; the text is cut before the first match"),
    # sampling
    _f("temperature", HONOURED, "[0, 2]; 0 is greedy"),
    _f("top_p", HONOURED, "(0, 1]"),
    _f("top_k", HONOURED, "extension (vLLM, llama.cpp): 0 is off"),
    _f("seed", HONOURED, "[0, 2**63): see docs/api.md, Seeds"),
    _f("n", HONOURED, "only 1: other values are a 400", neutral=(1,)),
    _f("presence_penalty", HONOURED, "[-2, 2], over the generated tokens", needs=PENALTIES, neutral=(0, 0.0)),
    _f("frequency_penalty", HONOURED, "[-2, 2], over the generated tokens", needs=PENALTIES, neutral=(0, 0.0)),
    _f("repetition_penalty", HONOURED, "extension (vLLM): (0, 10], over prompt and generated tokens",
       needs=PENALTIES, neutral=(1, 1.0)),
    _f("logit_bias", HONOURED, "{token id: bias in [-100, 100]}, up to 1024 entries", needs=PENALTIES,
       neutral=({},)),
    # what comes back
    _f("logprobs", HONOURED, "chat: true/false; completions: 0..20 alternatives per token", needs=LOGPROBS,
       neutral=(False,)),
    _f("top_logprobs", HONOURED, "0..20 alternatives per token; needs logprobs: true", _CHAT_ONLY,
       needs=LOGPROBS, neutral=(0,)),
    _f("stream", HONOURED, "Server-Sent Events, ending with data: [DONE]"),
    _f("stream_options", HONOURED, "include_usage: a last chunk with usage and no choices; needs stream: true"),
    # bookkeeping that cannot change the output
    _f("user", IGNORED, "an end-user id for the caller's logs"),
    _f("safety_identifier", IGNORED, "an end-user id for the caller's logs"),
    _f("metadata", IGNORED, "tags for a stored completion; nothing is stored"),
    _f("store", IGNORED, "nothing is stored"),
    _f("service_tier", IGNORED, "one tier here"),
    _f("prompt_cache_key", IGNORED, "prefix caching is per device and automatic"),
    # not here yet
    _f("tools", HONOURED, "functions rendered by the model's own chat template (a template without tool "
       "support: a 400); the reply's <tool_call> blocks become message.tool_calls, finish_reason tool_calls",
       _CHAT_ONLY, needs=TOOLS, neutral=([],)),
    _f("tool_choice", HONOURED, "auto (default), none (tools not shown), required or {type: function, function: "
       "{name}}: the reply is constrained to calls of those functions with arguments following their schemas",
       _CHAT_ONLY, needs=TOOLS, neutral=("none", "auto")),
    _f("parallel_tool_calls", HONOURED, "false: at most one call when tool_choice forces calls", _CHAT_ONLY,
       needs=TOOLS, neutral=(True,)),
    _f("functions", REFUSED, "tool calling (the deprecated form)", _CHAT_ONLY, neutral=([],)),
    _f("function_call", REFUSED, "tool calling (the deprecated form)", _CHAT_ONLY, neutral=("none",)),
    _f("response_format", HONOURED, "json_object or json_schema {name, schema, strict}: the text follows it "
       "exactly, under speculation too; a schema that cannot be compiled, or over 64 KiB as a grammar, is a 400",
       _CHAT_ONLY, needs=STRUCTURED, neutral=({"type": "text"},)),
    _f("echo", REFUSED, "echoing the prompt back", _COMPLETIONS_ONLY, neutral=(False,)),
    _f("suffix", REFUSED, "insertion after a suffix", _COMPLETIONS_ONLY, neutral=("",)),
    _f("best_of", REFUSED, "server-side best of several", _COMPLETIONS_ONLY, neutral=(1,)),
    _f("modalities", REFUSED, "text only", _CHAT_ONLY, neutral=(["text"],)),
    _f("audio", REFUSED, "text only", _CHAT_ONLY),
    _f("prediction", REFUSED, "predicted outputs", _CHAT_ONLY),
    _f("reasoning_effort", REFUSED, "reasoning models", _CHAT_ONLY),
    _f("verbosity", REFUSED, "reasoning models", _CHAT_ONLY),
    _f("web_search_options", REFUSED, "web search", _CHAT_ONLY),
)}


def _is_neutral(value, neutral: Tuple) -> bool:
    # by type too: False == 0 in Python, and logprobs: false must not pass as top_logprobs: 0
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def check_fields(body: dict, api: str, profile: Profile) -> None:
    """Raise BadRequest naming the first field that this endpoint refuses (see the module's rule)."""
    for key, value in body.items():
        f = FIELDS.get(key)
        if f is None or api not in f.apis:
            raise BadRequest(f"unknown field {str(key)[:60]!r} for {PATHS[api]} (docs/api.md lists the fields "
                             f"and what this endpoint does with each)", str(key)[:60])
        if _is_neutral(value, f.neutral) or f.rule == IGNORED:
            continue
        if f.rule == REFUSED:
            raise BadRequest(f"{key!r} is not supported yet ({f.doc}); send it as null or leave it out", key)
        if f.needs is not None and f.needs not in profile.features:
            raise BadRequest(f"{key!r} is not supported on the {profile.name} endpoint: "
                             f"{profile.lacks_because}", key)
