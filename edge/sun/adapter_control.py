"""Add an adapter to a running prefill worker: send AdapterAdd, wait for its AdapterResult.

The sender holds the deployment's ctl key (the hub, or an operator's tool): the AdapterAdd is
signed with it, and so is the answer, which the worker publishes on ss/sun/r/{client}/{rid}
(a topic the sender, as `client`, may read). A worker without a ctl key refuses every AdapterAdd.
"""
from __future__ import annotations

import queue
import secrets
from typing import Optional

from edge.wire.link import Link
from edge.wire.protocol import (AdapterAdd, AdapterResult, ProtocolError, decode, encode, sun_ctl_topic,
                                sun_stream_topic)


class AdapterAddTimeout(TimeoutError):
    """No answer: the worker is not running, not on this broker, or does not share the ctl key."""


def add_adapter(link: Link, worker: str, task: str, path: str, sha256: str, ctl_key: bytes,
                client: str, bundle: bool = False, timeout: float = 60.0) -> AdapterResult:
    """Ask `worker` to load `task`'s adapter from `path` (a bundle with bundle=True), sha256-checked;
    returns its AdapterResult (ok, or refused with why). `client`: the sender's id on the star."""
    rid = f"adapter-{secrets.token_hex(6)}"
    topic = sun_stream_topic(client, rid)
    answers: "queue.Queue[AdapterResult]" = queue.Queue()

    def on_answer(_topic: str, payload: bytes) -> None:
        try:
            msg = decode(payload, ctl_key)
        except ProtocolError:
            return                                        # not signed with our key: not the worker's answer
        if isinstance(msg, AdapterResult) and msg.rid == rid and msg.worker == worker:
            answers.put(msg)

    link.subscribe(topic, on_answer)
    try:
        link.publish(sun_ctl_topic(worker), encode(AdapterAdd(worker, rid, client, task, str(path), sha256, bundle),
                                                   ctl_key), kind="control")
        try:
            return answers.get(timeout=timeout)
        except queue.Empty:
            raise AdapterAddTimeout(f"prefill worker {worker} did not answer within {timeout:g} s: is it running "
                                    "on this broker, with the same ctl key?") from None
    finally:
        link.unsubscribe(topic)


def result_text(r: Optional[AdapterResult]) -> str:
    """One line for a person."""
    if r is None:
        return "no answer"
    state = "loaded" if r.ok else "REFUSED"
    return f"{r.worker}: {state}: {r.message} (serves: {', '.join(r.tasks) or 'none'})"
