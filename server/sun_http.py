"""An OpenAI-compatible endpoint for the hub's SUN star: "model" names the task.

`edge-hub serve --sun-http-port 8080 --sun-tokenizer smollm2-135m` runs it on
the hub. Requests become SunRequests on the hub's own link (a SunClient with
the hub's id): the router sends each to its task's prefill worker and a shared
decoder; tokens stream back and are decoded here with the base model's
tokenizer (every specialist shares it: they are tuned from one base). GET
/v1/models lists the tasks some prefill worker serves right now. Requests run
concurrently; the shared decoder batches them.

Fields: the shared rule of edge/api/request_fields.py under the SUN_HUB profile: the same
table and parser as a target's endpoint. `tools` are rendered here by the base model's chat
template and the reply parsed back into tool_calls by the target's parser (edge/api/tools.py);
a response_format or forced tool_choice grammar is compiled here (a bad one is a 400) and its
text travels with the request: the prefill worker's token 0 and each of the decoder's rows
follow it (edge/sun/token_rules.py). logprobs come from the workers' rows. Penalties and
logit_bias stay 400s. A request the star cannot take now -- no decoder online, every decoder
full, its worker lost, no answer in time -- is a 503 with Retry-After; a bad one a 400.
"""
from __future__ import annotations

import threading
from typing import Optional

from edge.api.request_fields import SUN_HUB, BadRequest
from edge.api.openai_http import OpenAIServer, Unavailable
from edge.sun.client import SunClient, SunRequestError
from edge.wire.protocol import E_BAD_REQUEST

RETRY_AFTER_S = 5         # what a 503 asks the client to wait: a decoder (re)joins within seconds


def _warm(server: OpenAIServer) -> None:
    """Compile json_object's grammar now: it builds llguidance's tokenizer (seconds for a 150k
    vocabulary) before an agent's first response_format or tool_choice waits for it."""
    try:
        server.structured.grammar_for({"response_format": {"type": "json_object"}})
    except BadRequest:
        pass                              # a tokenizer that cannot end a grammar: each such request's 400 says so


def start_sun_http(hub, tokenizer, host: str = "127.0.0.1", port: int = 8080,
                   timeout: float = 300.0, context: Optional[int] = None, warm: bool = True) -> OpenAIServer:
    """Serve the hub's SUN tasks over HTTP; stop the returned server (and its client) with .stop().
    warm: build the grammar tokenizer now, in the background (else at the first grammar)."""
    if hub.router is None:
        raise ValueError("the hub runs without SUN routing (sun=False): nothing to serve")
    client = SunClient(hub.link, hub.hub_id).start()

    def generate(ids, max_new, params, stop_ids=(), on_token=None, model=None, grammar=None, logprobs=None,
                 on_logprob=None):
        stops = set(stop_ids)

        def entry(token, lp, alts):               # as a target's: a stop token has no entry ...
            if token not in stops:
                on_logprob(token, lp, alts)

        def token(t):                             # ... nor text, nor a place in usage.completion_tokens
            if t not in stops and on_token is not None:
                on_token(t)
        try:
            return client.stream(model, ids, max_new, params, stop_ids, token, timeout=timeout,
                                 grammar=grammar.text if grammar is not None else "", logprobs=logprobs,
                                 on_logprob=entry if on_logprob is not None else None)
        except SunRequestError as e:
            if e.code == E_BAD_REQUEST:
                raise BadRequest(e.message) from None
            raise Unavailable(f"the SUN star cannot serve task {model!r} now ({e.code}): {e.message}",
                              RETRY_AFTER_S) from None
        except TimeoutError as e:
            raise Unavailable(str(e), RETRY_AFTER_S) from None

    server = OpenAIServer(generate, tokenizer, model_name="sun", host=host, port=port, context=context,
                          models=hub.router.tasks, profile=SUN_HUB)
    if warm:
        threading.Thread(target=_warm, args=(server,), name="sun-grammar-warm", daemon=True).start()
    stop = server.stop

    def stop_both() -> None:
        stop()
        client.close()
    server.stop = stop_both
    return server.start()
