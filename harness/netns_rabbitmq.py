"""A RabbitMQ cluster whose nodes each run on a host of their own (harness/netns.py): a switch
port per node, so `cut(i)` partitions ONE node for real -- its packets vanish, no process stops.

    with NetLab() as lab:
        c = NetnsRabbitCluster(lab=lab).start(clients=[...])    # hosts r1..r3 join the lab
        c.cut(2); ...; c.heal(2)

Each node is `rmqK@10.X.Y.i` (Erlang long names on the address: RABBITMQ_USE_LONGNAME, so no
/etc/hosts and no DNS), with its own epmd in its own namespace (on the cluster's epmd port) and
its MQTT listener on its address. rabbitmqctl runs inside the node's namespace: a CLI in the
root namespace would start an epmd there, outside anything we clean up. The test reaches
every node over the host's management link, which a cut leaves up: `cluster_status` of the
cut node still answers.

Partition handling is set explicitly: `pause_minority`. With three nodes the side of one node
is the minority, so the cut node stops its RabbitMQ app (closing its MQTT listener and
connections) instead of serving a diverged copy of the cluster's state, while the other two go
on; once it hears the majority again it restarts its app and rejoins by itself -- no operator.
`ignore` (RabbitMQ's default) would leave two clusters after the heal until a person restarts
one side; `autoheal` lets both sides serve clients during the split and then restarts the loser,
dropping whatever its clients did there. net_ticktime is 8 s (Erlang's default: 60), so the
cluster sees the cut node down within ~10 s and the test stays short.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from harness.netns import Host, NetLab
from harness.rabbitmq import RabbitCluster, RabbitNode

MQTT_PORT = 8883           # every node has its own address: the same ports on each
AMQP_PORT = 5672
DIST_PORT = 25672


@dataclass
class NetnsRabbitCluster(RabbitCluster):
    lab: Optional[NetLab] = None
    partition_handling: Optional[str] = "pause_minority"
    net_ticktime: Optional[int] = 8

    def __post_init__(self) -> None:
        if self.lab is None:
            raise ValueError("NetnsRabbitCluster needs lab=NetLab()")
        super().__post_init__()
        self.hosts: list[Host] = []

    def _new_node(self, i: int, d: Path) -> RabbitNode:
        h = self.lab.add(f"r{i}")
        self.hosts.append(h)
        return RabbitNode(f"rmq{i}", AMQP_PORT, DIST_PORT, MQTT_PORT, d, host=h.ip, prefix=h.cmd())

    def url_list(self, *indexes: int) -> list:
        return [self.nodes[i].url(self.tls) for i in indexes]

    # ---- a real partition of one node ----
    def cut(self, i: int) -> None:
        self.lab.cut(self.hosts[i])

    def heal(self, i: int) -> None:
        self.lab.heal(self.hosts[i])

    def app_running(self, i: int) -> Optional[bool]:
        """Whether node i's RabbitMQ app runs (pause_minority stops it on the minority side); None
        when the CLI got no answer (on a starved machine a call may time out): neither, ask again."""
        try:
            out = self.ctl(self.nodes[i], "eval", "rabbit:is_running().", timeout=60)
        except Exception:            # noqa: BLE001 -- no answer says nothing either way
            return None
        return out.strip() == "true"
