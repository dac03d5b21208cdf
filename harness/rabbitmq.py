"""A real RabbitMQ 3.10 cluster on loopback for the tests: N nodes, each with its MQTT listener.

Each node has its own name (rmqK@localhost), AMQP and distribution ports, mnesia and log dirs,
and its own MQTT port (TLS with a client certificate by default, the CN being the username:
`mqtt.ssl_cert_login`); all share one Erlang cookie (the cluster's HOME) and one epmd on a
port of its own (ERL_EPMD_PORT), so the cluster touches nothing else on the machine and
`close()` ends every process it started, epmd included. Nodes 2..N `join_cluster` node 1
(3 nodes: a Raft majority for the MQTT client-id registry survives one node's death).

Users get vhost permissions and per-user topic permissions (with {username}; imported as
definitions, one rabbitmqctl call for all) derived from server/acl.py's rules: RabbitMQ sees MQTT
topics as routing keys (`/` -> `.`, `+` -> `*`), and a forbidden publish closes the client's
connection.

`rabbitmq-server` comes from Debian (`make system-test` installs it).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from server.acl import CLIENT_RULES, EXTRA_RULES, HUB_RULES
from server.broker_base import find_free_port
from server.certs import make_certs

SBIN = Path("/usr/lib/rabbitmq/bin")      # the scripts themselves: /usr/sbin's wrappers su to `rabbitmq`


class RabbitError(RuntimeError):
    """The cluster could not start; the message says what to do."""


def routing_regex(rule: str) -> str:
    """An MQTT ACL rule of server/acl.py (%u: the user) as a RabbitMQ topic-permission regex."""
    out = []
    for level in rule.split("/"):
        if level == "%u":
            out.append("{username}")
        elif level == "+":
            out.append(r"[^.]+")          # also matches a subscription's own `*`
        elif level == "#":
            out.append(r".*")
        else:
            out.append(re.escape(level))
    return "^" + r"\.".join(out) + "$"


def password_hash(password: str) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256 of a password, as a definitions file carries it:
    base64(salt + sha256(salt + password)), a random 4-byte salt."""
    salt = os.urandom(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def topic_permissions(role: str) -> tuple[str, str]:
    """(write regex, read regex) for a role of server/acl.py."""
    rules = HUB_RULES if role == "hub" else EXTRA_RULES.get(role, []) + CLIENT_RULES
    write = [routing_regex(t) for a, t in rules if a in ("write", "readwrite")]
    read = [routing_regex(t) for a, t in rules if a in ("read", "readwrite")]
    return "|".join(write) or "^$", "|".join(read) or "^$"


@dataclass
class RabbitNode:
    name: str
    amqp_port: int
    dist_port: int
    mqtt_port: int
    dir: Path
    proc: Optional[subprocess.Popen] = None
    host: str = "localhost"            # an address: the node runs in a namespace (harness/netns_rabbitmq.py)
    prefix: List[str] = field(default_factory=list)    # argv prefix that runs a command on its host

    @property
    def node(self) -> str:
        return f"{self.name}@{self.host}"

    @property
    def address(self) -> str:
        return "127.0.0.1" if self.host == "localhost" else self.host

    def url(self, tls: bool) -> str:
        return f"{'mqtts' if tls else 'mqtt'}://{self.host}:{self.mqtt_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class RabbitCluster:
    size: int = 3
    tls: bool = True
    nodes: List[RabbitNode] = field(default_factory=list)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="starsun-rmq-")))
    users: Dict[str, str] = field(default_factory=dict)        # name -> role
    partition_handling: Optional[str] = None     # cluster_partition_handling; None: RabbitMQ's `ignore`
    net_ticktime: Optional[int] = None           # s until a silent peer node is down; None: Erlang's 60

    def __post_init__(self) -> None:
        if not (SBIN / "rabbitmq-server").exists():
            raise RabbitError("rabbitmq-server is not installed: run `make system-test` "
                              "(or apt-get install rabbitmq-server)")
        self.certs = self.dir / "certs"
        self.epmd_port = find_free_port()
        (self.dir / ".erlang.cookie").write_text("starsun-test-cookie-" + os.urandom(8).hex())
        os.chmod(self.dir / ".erlang.cookie", 0o400)

    # ---- environment ----
    def _env(self, node: Optional[RabbitNode] = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(HOME=str(self.dir), ERL_EPMD_PORT=str(self.epmd_port), LC_ALL="C.UTF-8")
        if any(n.host != "localhost" for n in self.nodes):
            env.update(RABBITMQ_USE_LONGNAME="true")       # node@10.x.y.z: no /etc/hosts needed
        if self.net_ticktime:
            # rabbitmqctl too: a CLI on Erlang's default (60 s) ticks every 15 s, and a node on 8 s drops
            # it as "not responding" during any call that runs past 8 s -- a `wait`, a join on a
            # loaded machine
            ticks = f"-kernel net_ticktime {self.net_ticktime}"
            env.update(RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=ticks, RABBITMQ_CTL_ERL_ARGS=ticks)
        if node is not None:
            env.update(RABBITMQ_NODENAME=node.node, RABBITMQ_NODE_PORT=str(node.amqp_port),
                       RABBITMQ_DIST_PORT=str(node.dist_port), RABBITMQ_MNESIA_BASE=str(node.dir / "mnesia"),
                       RABBITMQ_LOG_BASE=str(node.dir / "log"), RABBITMQ_CONFIG_FILE=str(node.dir / "rabbitmq.conf"),
                       RABBITMQ_ENABLED_PLUGINS_FILE=str(node.dir / "enabled_plugins"),
                       RABBITMQ_PID_FILE=str(node.dir / "pid"), RABBITMQ_LOGS=str(node.dir / "log" / "node.log"))
        return env

    def _config(self, node: RabbitNode) -> str:
        lines = ["listeners.tcp = none",          # no AMQP: the star speaks MQTT only
                 "loopback_users = none", "mqtt.allow_anonymous = false", "mqtt.vhost = /",
                 "mqtt.exchange = amq.topic", "log.console = false", "log.file.level = info"]
        if self.partition_handling:
            lines.append(f"cluster_partition_handling = {self.partition_handling}")
        if self.tls:
            lines += ["mqtt.listeners.tcp = none", f"mqtt.listeners.ssl.default = {node.mqtt_port}",
                      f"ssl_options.cacertfile = {self.certs / 'ca.crt'}",
                      f"ssl_options.certfile = {self.certs / 'broker.crt'}",
                      f"ssl_options.keyfile = {self.certs / 'broker.key'}",
                      "ssl_options.verify = verify_peer", "ssl_options.fail_if_no_peer_cert = true",
                      "mqtt.ssl_cert_login = true", "ssl_cert_login_from = common_name"]
        else:
            lines += [f"mqtt.listeners.tcp.default = {node.mqtt_port}"]
        return "\n".join(lines) + "\n"

    def ctl(self, node: RabbitNode, *args: str, timeout: float = 300.0) -> str:
        """rabbitmqctl on `node`; timeout: a hang guard (a start_app took over 60 s at load ~22)."""
        r = subprocess.run([*node.prefix, str(SBIN / "rabbitmqctl"), "-n", node.node, *args], env=self._env(),
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RabbitError(f"rabbitmqctl {' '.join(args)} on {node.node} failed: "
                              f"{(r.stderr or r.stdout).strip()[-800:]}")
        return r.stdout

    # ---- lifecycle ----
    def start(self, clients=()) -> "RabbitCluster":
        """Start every node, cluster them; `clients`: names that get client certificates."""
        try:
            for i in range(1, self.size + 1):
                d = self.dir / f"rmq{i}"
                (d / "log").mkdir(parents=True)
                self.nodes.append(self._new_node(i, d))
            if self.tls:
                make_certs(self.certs, hosts=self.cert_hosts(), clients=clients)
            for node in self.nodes:
                (node.dir / "rabbitmq.conf").write_text(self._config(node))
                (node.dir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
            for node in self.nodes:                 # boot in parallel: each takes seconds
                self._spawn(node)
            for i, node in enumerate(self.nodes):
                self._await_booted(i)
            for node in self.nodes[1:]:
                self.ctl(node, "stop_app")
                self.ctl(node, "join_cluster", self.nodes[0].node)
                self.ctl(node, "start_app")
            for node in self.nodes:
                self._await_mqtt(node)
        except BaseException:
            self.close()
            raise
        return self

    def _new_node(self, i: int, d: Path) -> RabbitNode:
        return RabbitNode(f"rmq{i}", *self._ports(3), d)

    def cert_hosts(self) -> tuple:
        """The names the broker's certificate is valid for (every node's host)."""
        return tuple(dict.fromkeys(["localhost", "127.0.0.1", *(n.host for n in self.nodes)]))

    def _ports(self, n: int) -> list:
        """n free loopback ports, none already given to a node of this cluster."""
        taken = {self.epmd_port} | {p for x in self.nodes for p in (x.amqp_port, x.dist_port, x.mqtt_port)}
        out: list = []
        while len(out) < n:
            p = find_free_port()
            if p not in taken and p not in out:
                out.append(p)
        return out

    def _spawn(self, node: RabbitNode) -> None:
        log = open(node.dir / "log" / "stdout.log", "ab")
        node.proc = subprocess.Popen([*node.prefix, str(SBIN / "rabbitmq-server")], env=self._env(node), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _await(self, node: RabbitNode, timeout: float = 300.0) -> None:
        """Until the node's app runs. `rabbitmqctl wait` follows the pid file the node writes once its
        VM is up, then waits for the app; on a starved machine the node may drop the CLI's own
        connection (a CLI VM that missed its net ticks: "not responding"), so it is asked again
        while the node lives, until `timeout` -- a hang guard, not a measure."""
        end = time.monotonic() + timeout
        while True:
            left = max(1.0, min(60.0, end - time.monotonic()))
            try:
                self.ctl(node, "wait", str(node.dir / "pid"), "--timeout", str(int(left)), timeout=left + 10)
                return
            except (RabbitError, subprocess.TimeoutExpired) as e:
                if time.monotonic() >= end or not node.alive:
                    raise RabbitError(f"{node.node} did not start: {e}; its log: {self.log_tail(node)}") from None

    def _await_booted(self, i: int, tries: int = 3) -> None:
        """_await of a first boot. A port picked free can be taken before the node listens on it (other
        tests run beside these and open ports of their own: `eaddrinuse` in the node's log): then
        the node boots again on new ports."""
        for left in range(tries - 1, -1, -1):
            node = self.nodes[i]
            try:
                return self._await(node)
            except RabbitError as e:
                if left == 0 or "eaddrinuse" not in str(e):
                    raise
            self.kill(i)
            shutil.rmtree(node.dir, ignore_errors=True)
            (node.dir / "log").mkdir(parents=True)
            taken = self.nodes[i] = replace(node, proc=None, **dict(zip(("amqp_port", "dist_port", "mqtt_port"),
                                                                          self._ports(3))))
            (taken.dir / "rabbitmq.conf").write_text(self._config(taken))
            (taken.dir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
            self._spawn(taken)

    def _await_mqtt(self, node: RabbitNode, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                socket.create_connection((node.address, node.mqtt_port), 0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RabbitError(f"{node.node}: no MQTT listener on port {node.mqtt_port}; its log: {self.log_tail(node)}")

    def log_tail(self, node: RabbitNode, n: int = 15) -> str:
        lines = []
        for f in sorted((node.dir / "log").glob("*.log")):
            lines += f.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines[-n:])

    def add_user(self, name: str, role: str = "client", password: Optional[str] = None) -> str:
        """A broker user with server/acl.py's rights for `role` as topic permissions; its password."""
        return self.add_users({name: role}, {name: password} if password else None)[name]

    def add_users(self, roles: Dict[str, str], passwords: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Users ({name: role}) as add_user makes them, all in ONE rabbitmqctl call (each call boots
        an Erlang VM: seconds apiece on a loaded machine, three per user); {name: password}."""
        pw = {n: (passwords or {}).get(n) or os.urandom(12).hex() for n in roles}
        defs: Dict[str, list] = {"users": [], "permissions": [], "topic_permissions": []}
        for name, role in roles.items():
            defs["users"].append({"name": name, "password_hash": password_hash(pw[name]), "tags": "",
                                  "hashing_algorithm": "rabbit_password_hashing_sha256"})
            defs["permissions"].append({"user": name, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"})
            write, read = topic_permissions(role)
            defs["topic_permissions"].append({"user": name, "vhost": "/", "exchange": "amq.topic",
                                              "write": write, "read": read})
        path = self.dir / f"users-{len(self.users)}-{os.urandom(3).hex()}.json"
        path.write_text(json.dumps(defs))
        self.ctl(next(n for n in self.nodes if n.alive), "import_definitions", str(path))
        self.users.update(roles)
        return pw

    def tls_files(self, name: str) -> tuple[str, str, str]:
        """(CA, certificate, key) of a client made at start (or now)."""
        make_certs(self.certs, hosts=self.cert_hosts(), clients=[name])
        return (str(self.certs / "ca.crt"), str(self.certs / "clients" / f"{name}.crt"),
                str(self.certs / "clients" / f"{name}.key"))

    def urls(self, *indexes: int) -> str:
        """A comma list of the MQTT URLs of the given nodes (0-based), in that order."""
        return ",".join(self.nodes[i].url(self.tls) for i in indexes)

    def kill(self, i: int) -> None:
        """kill -9 of node i's Erlang VM (and what it started)."""
        node = self.nodes[i]
        if node.alive:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(10)

    def suspend(self, i: int) -> None:
        """SIGSTOP node i's VM: its TCP connections stay open and go silent (clients and the other
        nodes see no reset, only silence) -- the nearest thing to a partition without a firewall."""
        os.killpg(self.nodes[i].proc.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        os.killpg(self.nodes[i].proc.pid, signal.SIGCONT)

    def running_nodes(self, i: int) -> List[str]:
        """The nodes node i's `cluster_status` lists as running ([] while it cannot answer: the tests
        poll this until the cluster is whole, and on a starved machine one CLI call may time out)."""
        try:
            out = self.ctl(self.nodes[i], "cluster_status", "--formatter", "json")
        except (RabbitError, subprocess.TimeoutExpired):
            return []
        return sorted(json.loads(out[out.index("{"):])["running_nodes"])

    def restart(self, i: int) -> None:
        """Start node i again after `kill` (its mnesia dir remembers the cluster: it rejoins by itself)."""
        node = self.nodes[i]
        if node.alive:
            raise RabbitError(f"{node.node} is still running: kill it first")
        self._spawn(node)
        self._await(node)
        self._await_mqtt(node)

    def close(self) -> None:
        """Kill every node and the cluster's epmd; remove the files."""
        for i, node in enumerate(self.nodes):
            if node.proc is not None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.proc.wait(10)
        self._kill_epmd()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_epmd(self) -> None:
        """The epmd on our own port (started by the first node, outside its process group): found
        by its ERL_EPMD_PORT in /proc, so no other epmd on the machine is touched."""
        for pid in _epmd_pids(self.epmd_port):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "RabbitCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def tls_cluster(users: Dict[str, str]) -> Iterator[RabbitCluster]:
    """A started three-node TLS cluster with a client certificate and a broker user of its role
    ({client id: role}) for each of `users`; closed after."""
    with RabbitCluster(size=3, tls=True) as c:
        c.start(clients=list(users))
        c.add_users(users)
        yield c


def _epmd_pids(port: int) -> List[int]:
    """Pids of epmd processes started with our port (from /proc: no extra tools)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            environ = (p / "environ").read_bytes()
            comm = (p / "comm").read_text().strip()
        except OSError:
            continue
        if comm == "epmd" and f"ERL_EPMD_PORT={port}".encode() in environ.split(b"\0"):
            out.append(int(p.name))
    return out
