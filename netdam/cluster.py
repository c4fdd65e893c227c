"""Cluster files (BRIEF section 7): TOML describing running nodes, written by ``netdam up``.

```toml
[cluster]
name = "c1a2b3"
admin_key = 3735928559
mtu = 9000
created = "2026-11-22T05:00:00Z"

[[nodes]]
rank = 0
address = "127.0.0.1"
port = 7744
control_port = 40001  # management port: stats, ping, control (0 = the data port)
pid = 12345
memory_file = "/dev/shm/netdam-c1a2b3-0.mem"
memory_bytes = 67108864
```

The file can also be written by hand for several hosts: ``pid`` and ``memory_file`` are then
only meaningful on the host that runs the node.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from netdam.protocol.packet import Endpoint


@dataclass(frozen=True)
class NodeEntry:
    rank: int
    address: str
    port: int
    pid: int = 0
    memory_file: str = ""
    memory_bytes: int = 0
    #: Management port (stats, ping, control) beside the data port; 0: use the data port.
    control_port: int = 0

    @property
    def endpoint(self) -> Endpoint:
        return (self.address, self.port)

    @property
    def control_endpoint(self) -> Endpoint:
        return (self.address, self.control_port or self.port)


@dataclass(frozen=True)
class ClusterFile:
    name: str
    admin_key: int
    mtu: int
    nodes: tuple[NodeEntry, ...]
    created: str = ""
    supervisor_pid: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def endpoints(self) -> list[Endpoint]:
        return [n.endpoint for n in self.nodes]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def dump_cluster(cluster: ClusterFile) -> str:
    """TOML text of *cluster* (stdlib has no TOML writer; the format is flat)."""
    lines = ["[cluster]"]
    for key in ("name", "admin_key", "mtu", "created", "supervisor_pid"):
        lines.append(f"{key} = {_toml_value(getattr(cluster, key))}")
    for node in cluster.nodes:
        lines += ["", "[[nodes]]"]
        for key in ("rank", "address", "port", "control_port", "pid", "memory_file", "memory_bytes"):
            lines.append(f"{key} = {_toml_value(getattr(node, key))}")
    return "\n".join(lines) + "\n"


def write_cluster(cluster: ClusterFile, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dump_cluster(cluster))
    tmp.replace(path)  # atomic: readers never see half a file


def load_cluster(path: str | Path) -> ClusterFile:
    """Read a cluster file; ValueError names what is wrong and how to fix it."""
    target = Path(path)
    try:
        data = tomllib.loads(target.read_text())
    except FileNotFoundError:
        raise ValueError(f"cluster file {target} not found: start a cluster with `netdam up`") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"cluster file {target} is not valid TOML: {exc}") from None
    try:
        head = data["cluster"]
        nodes = tuple(
            NodeEntry(
                rank=int(n["rank"]),
                address=str(n["address"]),
                port=int(n["port"]),
                pid=int(n.get("pid", 0)),
                memory_file=str(n.get("memory_file", "")),
                memory_bytes=int(n.get("memory_bytes", 0)),
                control_port=int(n.get("control_port", 0)),
            )
            for n in data.get("nodes", [])
        )
        cluster = ClusterFile(
            name=str(head.get("name", target.stem)),
            admin_key=int(head["admin_key"]),
            mtu=int(head.get("mtu", 9000)),
            created=str(head.get("created", "")),
            supervisor_pid=int(head.get("supervisor_pid", 0)),
            nodes=nodes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cluster file {target} is missing or has a bad field: {exc}") from None
    if not cluster.nodes:
        raise ValueError(f"cluster file {target} lists no [[nodes]]")
    if sorted(n.rank for n in cluster.nodes) != list(range(len(cluster.nodes))):
        raise ValueError(f"cluster file {target}: ranks must be 0..{len(cluster.nodes) - 1}")
    return cluster
