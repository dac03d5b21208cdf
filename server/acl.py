"""Who may touch which topic on the star's broker (`Acl`), for both brokers in server/broker.py.

With `acl=True` the hub may do anything; a client (username = its client id) may only

    write ss/hub/join/{me}          its join request
    read  ss/c/{me}/joined          the hub's answer (it carries the session secret)
    write ss/s/{me}/+/+/up          draft requests and bye of its own sessions
    read  ss/s/{me}/+/+/down        draft responses for its own sessions
    read  ss/hub/status             hub presence
    read  ss/hubs/+                 each hub's presence, where there are several

    write ss/sun/req/{me}           its SUN requests
    read  ss/sun/r/{me}/+           the token streams of its own SUN requests
    write ss/dev/{me}/telemetry     its own telemetry (retained; the hub reads every device's)

and a remote draft service additionally reads the up topics and writes the
down topics of the sessions assigned to it (`ss/s/+/+/{me}/up|down`: the
session topics name their service, so it never sees another service's
traffic), announces itself on ss/hub/drafts/{me} and reads its assignments
on ss/d/{me}/#. Draft services and SUN workers read ss/discover (the hub's
Discover: answer with a hello). A SUN worker (role `sun`: prefill worker or
shared decoder) announces itself on ss/sun/workers/{me}, reads its jobs and
incoming KV on ss/sun/w/{me}/#, sends KV to any decoder under its own name
(ss/sun/w/+/kv/{me}: the decoder holds early KV per sender, edge/sun/early_kv.py) and
tokens to any client (ss/sun/r/#). Mosquitto gets these as an ACL file
(patterns with %u) plus a password file; amqtt gets them as in-process plugins.
"""
from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Optional

from paho.mqtt.client import topic_matches_sub

ROLES = ("hub", "client", "draft", "sun")
CLIENT_RULES = [("write", "ss/hub/join/%u"), ("read", "ss/c/%u/joined"),
                ("write", "ss/s/%u/+/+/up"), ("read", "ss/s/%u/+/+/down"), ("read", "ss/hub/status"),
                ("read", "ss/hubs/+"),
                ("write", "ss/sun/req/%u"), ("read", "ss/sun/r/%u/+"), ("write", "ss/dev/%u/telemetry")]
DRAFT_RULES = [("read", "ss/s/+/+/%u/up"), ("write", "ss/s/+/+/%u/down"), ("write", "ss/hub/drafts/%u"),
               ("read", "ss/d/%u/#"), ("read", "ss/discover")]
SUN_RULES = [("write", "ss/sun/workers/%u"), ("read", "ss/sun/w/%u/#"), ("write", "ss/sun/w/+/kv/%u"),
             ("write", "ss/sun/r/#"), ("read", "ss/discover")]
HUB_RULES = [("readwrite", "#")]
EXTRA_RULES = {"hub": HUB_RULES, "draft": DRAFT_RULES, "sun": SUN_RULES}   # beyond CLIENT_RULES


class AclError(ValueError):
    """A user or role the access table cannot take."""


def _covers(rule: str, sub: str) -> bool:
    """Every topic matching filter `sub` also matches filter `rule`."""
    r, s = rule.split("/"), sub.split("/")
    for i, level in enumerate(r):
        if level == "#":
            return True
        if i >= len(s) or s[i] == "#" or (s[i] == "+" and level != "+") or (level not in ("+", s[i])):
            return False
    return len(r) == len(s)


@dataclass
class Acl:
    """Users, passwords and roles; answers 'may user do action on topic'."""
    users: dict[str, tuple[str, str]] = field(default_factory=dict)   # name -> (role, password)

    def add(self, name: str, role: str = "client", password: Optional[str] = None) -> str:
        if role not in ROLES:
            raise AclError(f"role must be one of {ROLES}, got {role!r}")
        if not name or any(c in name for c in "/+#:% \n"):
            raise AclError(f"user name {name!r} may not contain / + # : % or spaces")
        password = password or secrets.token_urlsafe(18)
        self.users[name] = (role, password)
        return password

    def rules(self, name: str) -> list[tuple[str, str]]:
        role = self.users.get(name, ("", ""))[0]
        if role not in ROLES:
            return []
        table = HUB_RULES if role == "hub" else EXTRA_RULES.get(role, []) + CLIENT_RULES
        return [(a, t.replace("%u", name)) for a, t in table]

    def check_password(self, name: Optional[str], password: Optional[str]) -> bool:
        if not name or name not in self.users:
            return False
        return hmac.compare_digest(self.users[name][1].encode(), (password or "").encode())

    def allows(self, name: Optional[str], topic: str, action: str) -> bool:
        """action: 'write' (publish), 'read' (receive) or 'subscribe'."""
        for access, rule in self.rules(name or ""):
            if action == "subscribe":
                if access != "write" and _covers(rule, topic):
                    return True
            elif access in (action, "readwrite") and topic_matches_sub(rule, topic):
                return True
        return False

    def mosquitto_acl(self) -> str:
        lines = ["# written by StarSun: clients connect with username = client id"]
        lines += [f"pattern {a} {t}" for a, t in CLIENT_RULES]
        for name, (role, _) in sorted(self.users.items()):
            extra = EXTRA_RULES.get(role, [])
            if extra:
                lines.append(f"\nuser {name}")
                lines += [f"topic {a} {t.replace('%u', name)}" for a, t in extra]
        return "\n".join(lines) + "\n"
