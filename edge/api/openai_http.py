"""An OpenAI-compatible HTTP endpoint for a device's local clients.

POST /v1/completions and /v1/chat/completions (JSON, or Server-Sent Events
with "stream": true), GET /v1/models and /health. Standard library only
(ThreadingHTTPServer); generation itself is a callable with the signature of
StarTarget.generate, so the same server fronts a StarSD target or a local
engine. One generation runs at a time (the target serialises them); a client
that disconnects mid-stream stops its generation. With `models` it fronts
several models -- the hub's SUN tasks: "model" names the task, generations run
concurrently (the shared decoder batches them) and generate gets model=.
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

from edge.spec.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_BODY = 8 << 20


class BadRequest(ValueError):
    pass


class _Stop(Exception):
    """Raised from the token callback to end a generation early (stop text, client gone)."""


class StopText:
    """Cuts generated text at the first stop string; holds back what may start one."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, delta: str) -> str:
        """New text that is safe to emit now."""
        self.text += delta
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text, self.hit = self.text[:i], True
        if self.hit:
            return self.flush()
        hold = 0
        for s in self.stops:                   # a suffix that is a prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _num(body: dict, key: str, default, lo, hi, kind=float):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}")
    return kind(v)


def _seed(body: dict) -> Optional[int]:
    v = body.get("seed")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63):
        raise BadRequest(f"'seed' must be an integer in [0, 2**63), got {str(v)[:40]}")
    return v


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
    """Serve `generate(prompt_ids, max_new, params, stop_ids, on_token) -> GenResult`."""

    def __init__(self, generate: Callable, tokenizer, model_name: str, host: str = "127.0.0.1",
                 port: int = 8000, max_tokens_cap: int = 4096, context: Optional[int] = None,
                 models: Optional[Callable[[], List[str]]] = None):
        self.generate, self.tok, self.model_name = generate, tokenizer, served_model_id(model_name)
        self.max_tokens_cap, self.context = max_tokens_cap, context
        self.models = models                  # None: one model, one generation at a time
        self.lock = threading.Lock()
        server = self

        class Handler(_Handler):
            owner = server
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
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
    def parse(self, body: dict, chat: bool) -> tuple:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = self.model_name
        if self.models is not None:
            have = sorted(self.models())
            model = body.get("model")
            if model not in have:
                raise BadRequest(f"unknown model {model!r}: this endpoint serves {', '.join(have) or 'nothing yet'}"
                                 " (GET /v1/models)")
        if body.get("n", 1) != 1:
            raise BadRequest("only n=1 is supported")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str)
                    and isinstance(m.get("role"), str) for m in msgs):
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
            try:
                ids = self.tok.encode(self.tok.apply_chat_template(msgs))
            except ValueError as e:
                raise BadRequest(str(e)) from None
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, str):
                ids = self.tok.encode(p, add_special=True)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = list(p)
                vocab = getattr(self.tok, "vocab_size", 0)
                if vocab and not all(0 <= t < vocab for t in ids):   # else the engine fails: a 500
                    raise BadRequest(f"'prompt' token ids must be in [0, {vocab}) (this model's vocabulary)")
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids")
        if not ids:
            raise BadRequest("the prompt encodes to no tokens")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _num({"max_tokens": mt}, "max_tokens", 256 if chat else 16, 1, self.max_tokens_cap, int)
        if self.context and len(ids) + max_new > self.context:
            raise BadRequest(f"the prompt has {len(ids)} tokens; with max_tokens={max_new} it exceeds the "
                             f"context of {self.context}")
        params = SamplingParams(temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                                top_p=_num(body, "top_p", 1.0, 1e-6, 1.0),
                                top_k=_num(body, "top_k", 0, 0, 4096, int),
                                seed=_seed(body))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of at most 4 strings")
        return ids, max_new, params, stop, model

    def run(self, ids, max_new, params, stop, emit: Callable[[str], None], model: Optional[str] = None) -> tuple:
        """Generate, calling emit(text) as text becomes final; -> (text, n_tokens, finish_reason)."""
        stream = self.tok.decode_stream(skip_special=True)
        cut = StopText(stop)
        n = [0]

        def on_token(t: int) -> None:
            n[0] += 1
            out = cut.feed(stream.put(t))
            if out:
                emit(out)
            if cut.hit:
                raise _Stop()
        finish = "length"
        kw = {} if self.models is None else {"model": model}
        with self.lock if self.models is None else nullcontext():
            try:
                res = self.generate(ids, max_new, params, stop_ids=tuple(self.tok.eos_ids), on_token=on_token,
                                    **kw)
                finish = "stop" if res.finish_reason == "stop" else "length"
            except _Stop:
                finish = "stop"
        rest = cut.flush()
        if rest:
            emit(rest)
        return cut.text, n[0], finish


class _Handler(BaseHTTPRequestHandler):
    owner: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:
        log.debug("http %s", fmt % args)

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
        self._json(code, {"error": {"message": message, "type": kind, "param": None, "code": None}})

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            names = sorted(self.owner.models()) if self.owner.models else [self.owner.model_name]
            self._json(200, {"object": "list", "data": [{"id": n, "object": "model", "created": 0,
                                                          "owned_by": "starsun"} for n in names]})
        elif self.path.rstrip("/") in ("/health", ""):
            self._json(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}; try /v1/completions or /v1/chat/completions")

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {self.path}; try /v1/completions or /v1/chat/completions")
            return
        chat = path.endswith("chat/completions")
        try:
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                raise BadRequest(f"request body over {MAX_BODY} bytes")
            if size < 0:                      # read(-1) would wait for the client to close
                raise BadRequest("Content-Length must not be negative")
            data = self.rfile.read(size)
            if len(data) < size:
                raise BadRequest(f"the body ended after {len(data)} of its {size} bytes (Content-Length)")
            body = json.loads(data or b"{}")
            ids, max_new, params, stop, model = self.owner.parse(body, chat)
        except (BadRequest, ValueError, RecursionError) as e:   # RecursionError: JSON nested too deep
            self.close_connection = True      # what is left of the body would be read as a request
            self._error(400, str(e)[:1000] or "the JSON body is nested too deep")
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": model}
        if body.get("stream"):
            self._stream(head, chat, ids, max_new, params, stop, model)
            return
        try:
            text, n, finish = self.owner.run(ids, max_new, params, stop, lambda s: None, model)
        except Exception as e:  # an engine error: tell the client, keep serving
            log.exception("generation failed")
            self._error(500, f"generation failed: {e}", "server_error")
            return
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            self._json(200, {**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            self._json(200, {**head, "object": "text_completion", "choices": [choice], "usage": usage})

    def _stream(self, head, chat, ids, max_new, params, stop, model=None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        obj = "chat.completion.chunk" if chat else "text_completion"

        def send(choice: dict) -> None:
            data = json.dumps({**head, "object": obj, "choices": [choice]})
            try:
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()
            except OSError:
                raise _Stop() from None              # the client left: stop generating

        def delta(text: str, finish=None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        try:
            if chat:
                send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            _, _, finish = self.owner.run(ids, max_new, params, stop, lambda s: send(delta(s)), model)
            send(delta("", finish))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except _Stop:
            return
        except OSError:
            return
        except Exception as e:
            log.exception("generation failed")
            try:
                self.wfile.write(f"data: {json.dumps({'error': {'message': str(e)}})}\n\n".encode())
            except OSError:
                pass
