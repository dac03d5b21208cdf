"""What the stars of console-script processes in network namespaces (harness/netns_star.py over
Mosquitto, harness/netns_rabbit_star.py over a RabbitMQ cluster) do alike: a bring-up that closes
what it started when a part fails, a greedy /v1/completions on one target's host, a context."""
from __future__ import annotations

import json
import time
import urllib.request

HTTP_PORT = 8000               # every target's OpenAI endpoint, on its own namespace's address


class NamespaceStarBase:
    """A subclass sets `hosts` ({name: NetLab host}) in `_start` and frees everything in `close`."""
    hosts: dict

    def start(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def complete(self, host: str, prompt: str, max_new: int, timeout: float = 60.0) -> dict:
        """A greedy /v1/completions on target `host`: {text, tokens, seconds, t0, t1}."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_new, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://{self.hosts[host].ip}:{HTTP_PORT}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            got = json.loads(r.read())
        t1 = time.monotonic()
        return {"text": got["choices"][0]["text"], "tokens": got["usage"]["completion_tokens"],
                "seconds": t1 - t0, "t0": t0, "t1": t1}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
