"""`edge-agent run --role drafter`: a device too small for the target drafts with its small model and
the hub's verify service verifies (the reverse star, edge/star/drafting_device.py). Its OpenAI
endpoint serves the TARGET's output; when the hub cannot verify it answers 503 with the reason,
never draft-only text."""
from __future__ import annotations

from typing import Optional

import click

from edge.api.admission import Unavailable
from edge.api.request_fields import LOGPROBS, STRUCTURED, TOOLS, BadRequest, Profile
from edge.cli.role_endpoint import generate_once, prompt_or_serve, serve_until_signal, telemetry_running
from edge.cli.startup import TelemetrySettings

# what the endpoint honours: the hub masks its target's rows by a request's grammar (response_format,
# a forced tool_choice) and reports logprobs from them (edge/star/verify_rules.py); tools are rendered
# and parsed here, as on a target's endpoint. Penalties and logit_bias are not applied by the hub yet.
DRAFTER = Profile("drafting device", frozenset({LOGPROBS, STRUCTURED, TOOLS}),
                  "the hub's target verifies this device's drafts and applies no penalties or logit_bias yet",
                  logprob_entries=True)


def endpoint_generate(device):
    """The OpenAI endpoint's generate: the device's, a hub that cannot verify a 503 (Unavailable)."""
    from edge.speculative.constrained import NoTokenAllowed
    from edge.star.drafting_device import HubUnavailable

    def generate(prompt_ids, max_new, params, stop_ids=(), on_token=None, grammar=None, logprobs=None,
                 on_logprob=None):
        try:
            return device.generate(prompt_ids, max_new, params, stop_ids, on_token, grammar=grammar,
                                   logprobs=logprobs, on_logprob=on_logprob)
        except HubUnavailable as e:
            raise Unavailable(f"the hub cannot serve the target's output now: {e}") from None
        except NoTokenAllowed:
            raise                               # the endpoint names the field whose grammar gave up
        except ValueError as e:
            raise BadRequest(str(e)) from None
    return generate


def run_drafter(engine, tok, link, client_id, model, target, tele: Optional[TelemetrySettings] = None,
                ctl_key=None) -> None:
    """Join the hub's verify service, then --prompt once or serve (target: the TargetSettings)."""
    from edge.engines.batched_calls import shared_engine
    from edge.star.drafting_device import DraftingDevice, HubUnavailable
    from edge.star.hub_client import HubClient

    engine = shared_engine(engine, target.parallel)     # concurrent generations: their drafts batched
    hub = HubClient(link, client_id, tok.fingerprint(), engine.vocab_size, hubs=target.hubs, role="drafter")
    device = DraftingDevice(engine, hub, gamma=target.gamma, adaptive=target.adaptive)
    try:
        device.check_join()
        click.echo(f"drafter {client_id} joined the hub's verify service at {link.url}", err=True)
    except HubUnavailable as e:
        click.echo(f"warning: {e}; answering 503 until the hub can verify", err=True)
    try:
        with telemetry_running(link, client_id, "drafter", device.telemetry, tele, ctl_key):
            prompt_or_serve(target, "drafter", lambda: _generate_once(device, tok, target),
                            lambda: serve_until_signal(endpoint_generate(device), tok, engine, model, target,
                                                       f"the hub's target, drafted here by {model}", profile=DRAFTER))
    finally:
        device.close()
        hub.close()
        link.close()


def _generate_once(device, tok, target) -> None:
    from edge.star.drafting_device import HubUnavailable
    try:
        res = generate_once(device.generate, tok, target)
    except HubUnavailable as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"\n{len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s, accepted {res.n_accepted}/"
               f"{res.n_drafted} in {res.n_verify_calls} round trips to the hub", err=True)
