"""A single RabbitMQ 3.10 node with its MQTT plugin, in a temp dir on loopback ports, for
broker_costs' load points (harness/ had no cluster starter when this was written).

Its own node name, ports, mnesia and log dirs and Erlang cookie (HOME), so it touches no system
RabbitMQ. Erlang's port mapper (epmd) is started by the first node on the machine and outlives
it: `stop` ends the epmd this node started, and only when no other node is registered there.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

from server.broker_base import find_free_port

RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def available() -> Optional[str]:
    """None when a node can start here, else why not."""
    if not os.path.exists(RABBIT_SERVER):
        return "rabbitmq-server is not installed (sudo apt-get install -y rabbitmq-server)"
    if os.geteuid() != 0:
        return "the node runs as root here (its Debian scripts otherwise switch to the rabbitmq user)"
    return None


def _epmd_names() -> list:
    exe = shutil.which("epmd") or "/usr/lib/erlang/erts-13.1.5/bin/epmd"
    try:
        out = subprocess.run([exe, "-names"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln for ln in out.splitlines() if ln.startswith("name ")]


def _epmd_running() -> bool:
    return any(p.info["name"] == "epmd" for p in psutil.process_iter(["name"]))


class RabbitNode:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="fleet-rabbit-"))
        self.mqtt_port, self.amqp_port = find_free_port("127.0.0.1"), find_free_port("127.0.0.1")
        self.dist_port = find_free_port("127.0.0.1")
        self.node = f"fleet{self.mqtt_port}@localhost"
        self.proc: Optional[subprocess.Popen] = None
        self.epmd_was_running = _epmd_running()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    def _env(self) -> dict:
        d = self.dir
        (d / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.mqtt_port}\n"
            "mqtt.allow_anonymous = true\nloopback_users = none\n")
        (d / "rabbitmq-env.conf").write_text("")
        return {**os.environ, "HOME": str(d), "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_PORT": str(self.amqp_port), "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"), "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
                "RABBITMQ_PID_FILE": str(d / "pid")}

    def start(self, timeout: float = 90.0) -> "RabbitNode":
        self.proc = subprocess.Popen([RABBIT_SERVER], env=self._env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited {self.proc.returncode}; logs in {self.dir / 'log'}")
            try:
                socket.create_connection(("127.0.0.1", self.mqtt_port), 1).close()
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"RabbitMQ's MQTT listener did not open in {timeout:.0f} s")

    def beam_pid(self) -> Optional[int]:
        """The Erlang VM's pid: where the broker's CPU goes."""
        if self.proc is None:
            return None
        procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        beams = [p.pid for p in procs if "beam" in p.name()]
        return beams[0] if beams else self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        if not self.epmd_was_running and not _epmd_names():
            for p in psutil.process_iter(["name"]):
                if p.info["name"] == "epmd":
                    p.terminate()
        shutil.rmtree(self.dir, ignore_errors=True)
