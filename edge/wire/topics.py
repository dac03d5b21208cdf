"""The topic table of the star: one grammar that builds, wildcards and parses every topic.

MQTT 3.1.1 topics; each {id} is checked (1-64 chars of [A-Za-z0-9_.-]: no / + # $), so no id
can reach into another's topics or smuggle in a wildcard.
"""
from __future__ import annotations

from typing import Callable

from edge.wire.field_types import ProtocolError, check_id

TOPICS = {
    "join":        "ss/hub/join/{client}",         # target -> hub: Join (the ACL: a client writes only its own)
    "joined":      "ss/c/{client}/joined",         # hub -> target: Joined
    "up":          "ss/s/{client}/{sid}/{service}/up",    # target -> draft service: DraftRequest, Bye
    "down":        "ss/s/{client}/{sid}/{service}/down",  # draft service -> target: DraftResponse, Error
    "status":      "ss/hub/status",                # hub, retained: HubStatus (last will: online=False)
    "hub_hello":   "ss/hubs/{hub}",                # each hub of several, retained + periodic: HubStatus (will: offline)
    "draft_hello": "ss/hub/drafts/{service}",      # draft service -> hub, retained: DraftHello
    "draft_ctl":   "ss/d/{service}/ctl",           # hub -> draft service: SessionAssign, SessionRelease
    "verify_hello": "ss/hub/verifiers/{service}",  # verify service (reverse star) -> hub, retained: DraftHello
    "sun_req":     "ss/sun/req/{client}",          # client -> router: SunRequest
    "sun_hello":   "ss/sun/workers/{worker}",      # SUN worker -> router, retained: SunHello
    "sun_ctl":     "ss/sun/w/{worker}/ctl",        # router -> worker: PrefillJob, DecodeAssign
    "sun_kv":      "ss/sun/w/{worker}/kv/{sender}",   # prefill -> decoder: KVChunk, Error (the ACL:
                                                      # a worker writes only as its own sender)
    "sun_stream":  "ss/sun/r/{client}/{rid}",      # workers -> client: SunTokens, Error
    "discover":    "ss/discover",                  # hub / router -> every service and worker: Discover
    "telemetry":   "ss/dev/{client}/telemetry",    # every agent and the hub, retained: Telemetry
}
_ID_NAMES = {"client": "client id", "sid": "session id", "service": "service id", "worker": "worker id",
             "rid": "request id", "sender": "sender id", "hub": "hub id"}
_PATTERNS = {kind: pat.split("/") for kind, pat in TOPICS.items()}
SUN_PREFIX = "ss/sun"                     # reserved: SUN prefill/decoder routing


def _slots(kind: str) -> list[str]:
    return [p[1:-1] for p in _PATTERNS[kind] if p.startswith("{")]


def topic(kind: str, *ids: str) -> str:
    """The topic of `kind` with its ids in the table's order, each checked."""
    names = _slots(kind)
    if len(ids) != len(names):
        raise TypeError(f"topic {kind!r} takes {names}, got {len(ids)} ids")
    vals = {n: check_id(v, _ID_NAMES[n]) for n, v in zip(names, ids)}
    return TOPICS[kind].format(**vals)


def subscription(kind: str, **ids: str) -> str:
    """The topic of `kind` with the ids not given as MQTT's single-level wildcard."""
    vals = {n: check_id(ids[n], _ID_NAMES[n]) if n in ids else "+" for n in _slots(kind)}
    return TOPICS[kind].format(**vals)


def parse_topic(name: str) -> tuple[str, dict[str, str]]:
    """(kind, ids) of a StarSD / SUN topic; raises ProtocolError for anything else."""
    parts = name.split("/")
    for kind, pat in _PATTERNS.items():
        if len(pat) != len(parts):
            continue
        ids = {}
        for p, v in zip(pat, parts):
            if p.startswith("{"):
                ids[p[1:-1]] = v
            elif p != v:
                break
        else:
            try:
                return kind, {k: check_id(v) for k, v in ids.items()}
            except ProtocolError:
                break
    raise ProtocolError(f"not a StarSD topic: {name!r}", "format")


def _builder(kind: str) -> Callable[..., str]:
    def build(*ids: str) -> str:
        return topic(kind, *ids)
    build.__name__ = f"{kind}_topic"
    build.__doc__ = f"{TOPICS[kind]}"
    return build


join_topic, joined_topic = _builder("join"), _builder("joined")
up_topic, down_topic = _builder("up"), _builder("down")
draft_hello_topic, draft_ctl_topic = _builder("draft_hello"), _builder("draft_ctl")
verify_hello_topic = _builder("verify_hello")
sun_req_topic, sun_stream_topic = _builder("sun_req"), _builder("sun_stream")
sun_hello_topic, sun_ctl_topic, sun_kv_topic = _builder("sun_hello"), _builder("sun_ctl"), _builder("sun_kv")
telemetry_topic = _builder("telemetry")
hub_hello_topic = _builder("hub_hello")         # a hub's own announcement when there are several
HUBS_SUB = subscription("hub_hello")            # every hub's (live copies only on brokers without wildcard retained)
TELEMETRY_SUB = subscription("telemetry")       # edge-hub top and the hub's /metrics read every device here
STATUS_TOPIC = TOPICS["status"]
JOIN_SUB = subscription("join")                 # the hub subscribes here
DRAFTS_SUB = subscription("draft_hello")        # the hub watches draft services here
VERIFIERS_SUB = subscription("verify_hello")    # ... and verify services (the reverse star) here
SUN_REQ_SUB = subscription("sun_req")           # the router subscribes here
SUN_WORKERS_SUB = subscription("sun_hello")     # the router watches SUN workers here
DISCOVER_TOPIC = TOPICS["discover"]             # every draft service and SUN worker listens here


def session_up_sub(service: str) -> str:
    """What a draft service subscribes to: the up topics of the sessions assigned to it."""
    return subscription("up", service=service)


def sun_kv_sub(worker: str) -> str:
    """What a decoder subscribes to: its KV from every sender (the topic names the sender)."""
    return subscription("sun_kv", worker=worker)


def sun_stream_sub(client: str) -> str:
    return subscription("sun_stream", client=client)
