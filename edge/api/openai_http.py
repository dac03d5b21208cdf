"""An OpenAI-compatible HTTP endpoint for a device's local clients.

POST /v1/completions and /v1/chat/completions (JSON, or Server-Sent Events
with "stream": true), GET /v1/models and /health. Standard library only
(ThreadingHTTPServer); generation itself is a callable with the signature of
StarTarget.generate, so the same server fronts a StarSD target or a local
engine. Up to `parallel` generations run at once (--parallel: the target batches their
engine calls, edge/engines/batched_calls.py), `queue` more wait their turn and past that a
request is answered 503 with Retry-After (edge/api/admission.py); a client
that disconnects mid-stream stops its generation. With `models` it fronts
several models -- the hub's SUN tasks: "model" names the task, generations run
concurrently (the shared decoder batches them) and generate gets model=.

Which request fields each endpoint honours is one table, edge/api/request_fields.py
(docs/api.md); `profile` says what this endpoint's generation can do. A
generate that raises Unavailable (no decoder online, overloaded) answers 503
with Retry-After -- also for a stream, whose headers wait for its first token.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from contextlib import nullcontext
from typing import Callable, List, Optional

from edge.api.admission import DEFAULT_QUEUE, Admission, Unavailable
from edge.api.request_fields import STRUCTURED, TARGET, BadRequest, Profile
from edge.api.logprobs import LogprobRecorder
from edge.api.timings import timings, timings_field, usage
from edge.speculative.constrained import NoTokenAllowed
from edge.api.request import Request, parse_request
from edge.api.stop_text import StopText
from edge.api.streamed_answer import StopGeneration, StreamedAnswer, tool_message
from edge.api.structured import StructuredOutput
from edge.api.tools import call_grammar_lark, call_stream, kept_markers

log = logging.getLogger(__name__)
MAX_BODY = 8 << 20


__all__ = ["BadRequest", "OpenAIServer", "StopText", "Unavailable"]


class BurstServer(ThreadingHTTPServer):
    """A thread per request, and a listen backlog for a burst of clients connecting at once: at
    socketserver's default of 5, 1 of 16 clients connecting together was reset (sun_vs_multilora)."""
    request_queue_size = 128
    daemon_threads = True


MODEL_SUFFIXES = (".gguf", ".onnx", ".safetensors", ".pt", ".bin")


def served_model_id(model: str) -> str:
    """The id /v1/models shows for a model given as a fetch name or a path: the name, or the
    file's stem (a client must not learn the device's paths; "qwen2.5-coder-1.5b" keeps its dots)."""
    name = str(model).rstrip("/").rsplit("/", 1)[-1]
    for suffix in MODEL_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


class OpenAIServer:
    """Serve `generate(prompt_ids, max_new, params, stop_ids, on_token[, on_logits]) -> GenResult`."""

    def __init__(self, generate: Callable, tokenizer, model_name: str, host: str = "127.0.0.1",
                 port: int = 8000, max_tokens_cap: int = 4096, context: Optional[int] = None,
                 models: Optional[Callable[[], List[str]]] = None, profile: Profile = TARGET,
                 parallel: int = 1, queue: int = DEFAULT_QUEUE):
        """profile: what generate can honour (edge/api/request_fields.py); TARGET's generate takes on_logits.
        parallel: generations at once (generate must then be safe to call from several threads);
        queue: requests waiting beyond them, past which a request gets 503 (edge/api/admission.py)."""
        self.generate, self.tok, self.model_name = generate, tokenizer, served_model_id(model_name)
        self.max_tokens_cap, self.context, self.profile = max_tokens_cap, context, profile
        self.models = models                  # None: one model, `parallel` generations at a time
        self.structured = StructuredOutput(tokenizer)   # response_format's grammars
        self.admission = Admission(parallel, queue)
        server = self

        class Handler(_Handler):
            owner = server
        self.httpd = BurstServer((host, port), Handler)
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> "OpenAIServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- request -> generation ----
    def parse(self, body, chat: bool) -> Request:
        model = self.model_name
        if self.models is not None and isinstance(body, dict):
            have = sorted(self.models())
            model = body.get("model")
            if not isinstance(model, str) or model not in have:
                raise BadRequest(f"unknown model {str(model)[:80]!r}: this endpoint serves "
                                 f"{', '.join(have) or 'nothing yet'} (GET /v1/models)", "model")
        req = parse_request(body, chat, self.tok, model, self.profile, self.max_tokens_cap, self.context)
        if STRUCTURED in self.profile.features:
            req.grammar = self.structured.grammar_for(body)
        if req.tools is not None and req.tools.forced:       # tool_choice required / named: constrained
            if req.grammar is not None:
                raise BadRequest("a forced 'tool_choice' and a 'response_format' cannot both shape the reply",
                                 "tool_choice")
            req.grammar = self.structured.grammar_for_lark(call_grammar_lark(req.tools, self.tok), "tool_choice")
        return req

    def run(self, req: Request, emit: Callable[[str, list], None],
            recorder: Optional[LogprobRecorder] = None) -> tuple:
        """Generate, calling emit(text, logprob entries) as text becomes final;
        -> (text, n_tokens, finish_reason, cached prompt tokens: what a prompt cache reused,
        the answer's timings or None: edge/api/timings.py)."""
        stream = self.tok.decode_stream(skip_special=True)
        keep = kept_markers(req.tools, self.tok)     # call markers a special-token decode would drop
        cut = StopText(req.stop)
        n = [0]

        def take() -> list:
            return recorder.take() if recorder is not None else []

        def on_token(t: int) -> None:
            n[0] += 1
            text = stream.put(t)
            if t in keep and not text.endswith(keep[t]):
                text += keep[t]
            out = cut.feed(text)
            if out:
                emit(out, take())
            if cut.hit:
                raise StopGeneration()
        finish, res = "length", None
        kw = {} if self.models is None else {"model": req.model}
        if recorder is not None and self.profile.logprob_entries:   # computed by the generator's workers
            kw.update(on_logprob=recorder.on_entry, logprobs=recorder.top_n)
        elif recorder is not None:
            kw["on_logits"] = recorder.on_logits
        if req.grammar is not None:
            kw["grammar"] = req.grammar
        with self.admission.slot() if self.models is None else nullcontext():
            try:
                res = self.generate(req.ids, req.max_new, req.params, stop_ids=tuple(self.tok.eos_ids),
                                    on_token=on_token, **kw)
                finish = "stop" if res.finish_reason == "stop" else "length"
            except StopGeneration as e:              # the generation carries what it did so far (generate.py)
                finish, res = "stop", getattr(e, "gen_result", None)
            except NoTokenAllowed as e:     # the grammar engine gave up mid-reply (its limits): the schema's doing
                param = "tool_choice" if req.tools is not None and req.tools.forced else "response_format"
                raise BadRequest(f"{param!r}: the grammar engine cannot go on here ({e}); send a simpler schema",
                                 param) from None
        rest = cut.flush()
        if rest or (recorder is not None and recorder.pending):
            emit(rest, take())
        return (cut.text, n[0], finish, int(getattr(res, "cached_tokens", 0) or 0),
                timings(res, len(req.ids), n[0]))

    def recorder(self, req: Request) -> Optional[LogprobRecorder]:
        return None if req.logprobs is None else LogprobRecorder(self.tok, req.logprobs)


def _message(req: Request, text: str, finish: str) -> tuple:
    """(the assistant message, finish_reason): with tools offered, the reply's tool calls parsed out
    by the parser the stream uses (edge/api/tools.py CallStream), so the two answers agree."""
    if req.tools is None:
        return {"role": "assistant", "content": text}, finish
    calls = call_stream(req.tools)
    calls.feed(text)
    calls.finish()
    return tool_message(calls, finish)


class _Handler(BaseHTTPRequestHandler):
    owner: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:
        log.debug("http %s", fmt % args)

    def _json(self, code: int, obj: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               headers: Optional[dict] = None) -> None:
        self._json(code, {"error": {"message": message, "type": kind, "param": param, "code": None}}, headers)

    def _unavailable(self, e: Unavailable) -> None:
        self._error(503, str(e)[:1000], "service_unavailable", headers={"Retry-After": str(e.retry_after)})

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            names = sorted(self.owner.models()) if self.owner.models else [self.owner.model_name]
            self._json(200, {"object": "list", "data": [{"id": n, "object": "model", "created": 0,
                                                          "owned_by": "starsun"} for n in names]})
        elif self.path.rstrip("/") in ("/health", ""):
            self._json(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}; try /v1/completions or /v1/chat/completions")

    def _read_body(self):
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            raise BadRequest(f"request body over {MAX_BODY} bytes")
        if size < 0:                      # read(-1) would wait for the client to close
            raise BadRequest("Content-Length must not be negative")
        data = self.rfile.read(size)
        if len(data) < size:
            raise BadRequest(f"the body ended after {len(data)} of its {size} bytes (Content-Length)")
        return json.loads(data or b"{}")

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {self.path}; try /v1/completions or /v1/chat/completions")
            return
        chat = path.endswith("chat/completions")
        try:
            req = self.owner.parse(self._read_body(), chat)
        except (BadRequest, ValueError, RecursionError) as e:   # RecursionError: JSON nested too deep
            self.close_connection = True      # what is left of the body would be read as a request
            self._error(400, str(e)[:1000] or "the JSON body is nested too deep", param=getattr(e, "param", None),
                        headers={"Connection": "close"})     # so that a client does not reuse the socket
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": req.model}
        if req.stream:
            StreamedAnswer(self, head, req).run()
        else:
            self._answer(head, req)

    def _answer(self, head: dict, req: Request) -> None:
        rec = self.owner.recorder(req)
        try:
            text, n, finish, cached, times = self.owner.run(req, lambda s, lp: None, rec)
        except Unavailable as e:
            self._unavailable(e)
            return
        except BadRequest as e:               # found out only by the generator (the SUN router)
            self._error(400, str(e)[:1000], param=e.param)
            return
        except Exception as e:  # an engine error: tell the client, keep serving
            log.exception("generation failed")
            self._error(500, f"generation failed: {e}", "server_error")
            return
        if req.chat:
            message, finish = _message(req, text, finish)
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": rec.chat(rec.entries) if rec else None}
            self._json(200, {**head, "object": "chat.completion", "choices": [choice],
                             "usage": usage(len(req.ids), n, cached), **timings_field(times)})
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": rec.completion(rec.entries) if rec else None}
            self._json(200, {**head, "object": "text_completion", "choices": [choice],
                             "usage": usage(len(req.ids), n, cached), **timings_field(times)})
