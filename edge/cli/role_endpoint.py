"""What a target and a drafting device (edge/cli/agent_roles.py, drafter_role.py) do alike once joined:
publish telemetry while they run, answer one --prompt on stdout, or serve an OpenAI endpoint until
SIGINT / SIGTERM."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Optional

import click

from edge.cli.startup import TelemetrySettings, leave_on_sigterm, start_telemetry_for_command, wait_for_signal


@contextmanager
def telemetry_running(link, node_id, role, counters, tele: Optional[TelemetrySettings], ctl_key=None):
    """Telemetry published (when `tele` asks for it) for as long as the block runs."""
    telemetry = start_telemetry_for_command(link, node_id, role, counters, tele, ctl_key) if tele else None
    try:
        yield
    finally:
        if telemetry is not None:
            telemetry.stop()


def prompt_or_serve(target, role: str, answer_prompt, serve) -> None:
    """answer_prompt() for --prompt, else serve() on --http-port; neither: a usage error."""
    if target.prompt is not None:
        answer_prompt()
    elif not target.http_port:
        raise click.UsageError(f"a {role} needs --http-port (to serve clients) or --prompt")
    else:
        serve()


def generate_once(generate, tok, target):
    """target.prompt (as a chat turn where the model has a template) through generate, its text
    streamed to stdout as it comes; returns generate's result."""
    from edge.speculative.sampling import SamplingParams
    prompt = target.prompt
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}])
                     if tok.chat_template else prompt, add_special=not tok.chat_template)
    stream = tok.decode_stream(skip_special=True)
    return generate(ids, target.max_new, SamplingParams(temperature=target.temperature), tuple(tok.eos_ids),
                    on_token=lambda t: (sys.stdout.write(stream.put(t)), sys.stdout.flush()))


def serve_until_signal(generate, tok, engine, model, target, served: str, **server_kw) -> None:
    """An OpenAI endpoint over generate on target.http_host:http_port until SIGINT / SIGTERM.
    served: what the endpoint's model answers with, for the startup line; server_kw: OpenAIServer's
    other settings (profile)."""
    from edge.api.openai_http import OpenAIServer

    stop = leave_on_sigterm()
    server = OpenAIServer(generate, tok, model_name=str(model), host=target.http_host, port=target.http_port,
                          context=engine.max_len, parallel=target.parallel, queue=target.queue,
                          **server_kw).start()
    click.echo(f"OpenAI endpoint on http://{target.http_host}:{server.port}/v1 ({served}); Ctrl-C to stop",
               err=True)
    try:
        wait_for_signal(stop)
    finally:
        server.stop()
