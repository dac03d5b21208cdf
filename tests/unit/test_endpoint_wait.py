"""Provisioning's wait for a target's OpenAI endpoint (devices/endpoint_wait.py): which agents
serve one and where, and the probe itself, run here as the device would run it over ssh: it
retries a refused connection until the endpoint answers, and gives up with the last failure."""
import subprocess
import sys
import threading

import pytest

from devices.endpoint_wait import DEFAULT_HTTP_PORT, endpoint_url, wait_answers
from devices.remote import RemoteError
from harness.ssh_device import free_port


class LocalRemote:
    """Remote.sh, on this machine."""

    def sh(self, script: str) -> str:
        r = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
        if r.returncode:
            raise RemoteError((r.stderr or r.stdout).strip())
        return r.stdout


def test_only_a_serving_target_has_an_endpoint():
    assert endpoint_url({"role": "target"}) == f"http://127.0.0.1:{DEFAULT_HTTP_PORT}/v1/models"
    assert endpoint_url({"role": "target", "http_port": 8001, "http_host": "0.0.0.0"}) == \
        "http://127.0.0.1:8001/v1/models"
    assert endpoint_url({"role": "target", "http_host": "::"}) == f"http://[::1]:{DEFAULT_HTTP_PORT}/v1/models"
    for values in ({"role": "draft"}, {"role": "prefill"}, {"role": "decoder"},
                   {"role": "target", "http_port": 0}, {"role": "target", "prompt": "hi"}):
        assert endpoint_url(values) is None, values


def test_the_default_port_is_the_agents():
    from edge.cli.agent_run import run
    assert next(p.default for p in run.params if p.name == "http_port") == DEFAULT_HTTP_PORT


def test_the_probe_waits_through_refused_connections_until_the_endpoint_answers():
    from edge.api.openai_http import OpenAIServer
    port = free_port()
    servers = []
    opener = threading.Timer(1.5, lambda: servers.append(
        OpenAIServer(lambda *a, **k: None, None, "qwen2.5-coder-1.5b", port=port).start()))
    opener.start()                  # the agent opens its endpoint a moment after the probe starts
    try:
        line = wait_answers(LocalRemote(), sys.executable, f"http://127.0.0.1:{port}/v1/models", 30)
    finally:
        opener.join()
        for s in servers:
            s.stop()
    assert servers                  # it answered only once the endpoint was up: the refusals before were waited out
    assert line == f"its OpenAI endpoint answers on the device: GET http://127.0.0.1:{port}/v1/models " \
                   "lists qwen2.5-coder-1.5b"


def test_no_answer_in_time_names_the_last_failure():
    url = f"http://127.0.0.1:{free_port()}/v1/models"
    with pytest.raises(TimeoutError, match=r"did not answer in 2 s \(.*(ConnectionRefused|Connection refused)"):
        wait_answers(LocalRemote(), sys.executable, url, 2)
