"""One request to a server's /v1/chat/completions, plain or streamed (the clients' side: stdlib
http.client, so every server is measured through the same code: benchmarks/serving/agent_workload,
benchmarks/lib/multilora_burst.py)."""
from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Optional


class ServerGone(RuntimeError):
    """The server process is not there any more (or never answered)."""


def connect(url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port.split("/")[0]), timeout=timeout)


def chat(url: str, body: dict, timeout: float) -> dict:
    """POST /v1/chat/completions: {"status", "json" or "text", "s"}."""
    conn = connect(url, timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", "replace")
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
        raise ServerGone(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
    out = {"status": resp.status, "s": time.perf_counter() - t0}
    try:
        out["json"] = json.loads(raw)
    except ValueError:
        out["text"] = raw[:500]
    return out


def chat_stream(url: str, body: dict, timeout: float, t0: Optional[float] = None) -> dict:
    """A streamed chat request: TTFT (the first chunk carrying content or a tool-call delta),
    total seconds, the content, completion / prompt / cached tokens (the final usage chunk where
    the server sends one; else the content chunks counted). t0: the perf_counter the times count
    from (a burst's start; None: this request's send)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = connect(url, timeout)
    t0 = time.perf_counter() if t0 is None else t0
    ttft, content, chunks, usage, finish, extra = None, [], 0, None, None, {}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode("utf-8", "replace")[:500],
                    "total_s": time.perf_counter() - t0}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            if "timings" in ev:                    # llama-server's own: prompt_n / cache_n
                extra = {k: ev["timings"].get(k) for k in ("prompt_n", "cache_n", "predicted_n")}
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
                    content.append(delta.get("content") or "")
                finish = ch.get("finish_reason") or finish
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError) as e:
        raise ServerGone(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
    total = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"status": 200, "ttft_s": ttft, "total_s": total, "content": "".join(content),
            "completion_tokens": (usage or {}).get("completion_tokens", chunks),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens", extra.get("cache_n")), "finish_reason": finish,
            **({"timings": extra} if extra else {})}
