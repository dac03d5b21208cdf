"""Does the provisioned agent's OpenAI endpoint answer? Provisioning's last step waits for it after
the join (devices/steps.py): a target joins the hub and only then opens its endpoint (edge-agent
run prints "OpenAI endpoint on ..."), so a client that came at "joined" could be refused; under
qemu that gap was long enough to happen.

Only a target serves HTTP (edge/cli/agent_roles.py: run_target; a draft service and the SUN
workers speak MQTT only), and not with --prompt (it generates once and exits) or http_port = 0.
It listens on the device's loopback by default (http_host 127.0.0.1), so the probe runs ON the
device over the same ssh: its venv's Python GETs /v1/models (edge/api/openai_http.py serves it
and /health) until it answers or the time is up, retrying a refused connection every second.
"""
from __future__ import annotations

import shlex
from typing import Optional

DEFAULT_HTTP_PORT = 8000          # `edge-agent run --http-port`'s default (edge/cli/agent_run.py)
HTTP_ROLES = ("target",)          # the roles that serve the OpenAI endpoint

# argv: URL SECONDS. Prints the model ids on success (exit 0), the last failure otherwise (exit 1).
PROBE = r'''
import json, sys, time, urllib.request
url, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the loopback: never a proxy
while True:
    try:
        with opener.open(url, timeout=max(1.0, min(10.0, end - time.monotonic()))) as r:
            ids = [str(m.get("id")) for m in json.load(r).get("data", [])]
        print(", ".join(ids) or "no model listed")
        sys.exit(0)
    except Exception as e:
        last = "%s: %s" % (type(e).__name__, getattr(e, "reason", None) or e)
    if time.monotonic() >= end:
        print(last)
        sys.exit(1)
    time.sleep(1.0)
'''


def endpoint_url(values: dict) -> Optional[str]:
    """The /v1/models URL, on the device, of the agent that agent.toml's `values` configure; None
    when it serves no endpoint (not a target, --prompt, http_port 0)."""
    if values.get("role") not in HTTP_ROLES or values.get("prompt") is not None:
        return None
    port = int(values.get("http_port", DEFAULT_HTTP_PORT))
    if not port:
        return None
    host = str(values.get("http_host", "127.0.0.1"))
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)   # any address: its loopback
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1/models"


def probe_command(python: str, url: str, seconds: float) -> str:
    """The sh command that runs the probe on the device."""
    return f"{shlex.quote(python)} -c {shlex.quote(PROBE)} {shlex.quote(url)} {max(1.0, seconds):.0f}"


def wait_answers(remote, python: str, url: str, seconds: float) -> str:
    """Wait on the device until GET `url` answers; the line that says so. TimeoutError with the last
    failure (e.g. connection refused) when it has not in `seconds`."""
    from devices.remote import RemoteError
    try:
        models = remote.sh(probe_command(python, url, seconds)).strip()
    except RemoteError as e:
        raise TimeoutError(f"the agent joined, but its OpenAI endpoint {url} on the device did not answer in "
                           f"{seconds:.0f} s ({e}): look at the agent's log on the device (journalctl [--user] "
                           "-u starsun-agent) and its http_port / http_host in agent.toml") from None
    return f"its OpenAI endpoint answers on the device: GET {url} lists {models}"
