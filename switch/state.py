"""The pool controller's persistent state: one JSON file next to the cluster file.

Holds the address map (regions with their rkeys, backing ranges and owners), the tenants (the
SHA-256 of each tenant credential, never the credential), the multicast groups and a
``generation`` that grows with every change. The file is created mode 0600: it holds every rkey. Writers (the controller, and the switch when a JOIN
or LEAVE arrives) take an exclusive ``flock`` on ``<state>.lock``, read, modify and replace the
file atomically (write a temporary file, ``rename``); the switch reloads the file when it
changes, so a restarted switch serves the same map and every rkey stays valid (the nodes keep
their registrations).

```json
{"format": 1, "generation": 3, "next_gaddr": 4296015872,
 "nodes": [{"address": "127.0.0.1", "port": 17744, "memory_bytes": 67108864,
            "heap_start": 0, "heap_end": 67108864}],
 "regions": [{"gaddr": 4294967296, "size": 65536, "rkey": 305419896, "rights": 7,
              "stride": 8192, "tenant": "", "owner": "9f86d0...", "ways": [{"node": 0, "local": 0,
              "size": 32768}]}],
 "tenants": {"9f86d0...": "label"},
 "groups": {"239.77.0.1:7744": ["127.0.0.1:17744"]}}
```
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from netdam.cluster.secrets_io import write_private
from netdam.protocol.packet import Endpoint
from netdam.switch.addrmap import (
    GLOBAL_BASE,
    Region,
    check_regions,
    region_from_json,
    region_to_json,
)

STATE_FORMAT = 1


@dataclass
class NodeHeap:
    """A node's memory the controller may hand out as pool backing: [heap_start, heap_end)."""

    address: str
    port: int
    memory_bytes: int
    heap_start: int = 0
    heap_end: int = 0

    @property
    def endpoint(self) -> Endpoint:
        return (self.address, self.port)


@dataclass
class PoolState:
    nodes: list[NodeHeap]
    regions: list[Region] = field(default_factory=list)
    groups: dict[Endpoint, list[Endpoint]] = field(default_factory=dict)
    #: Tenants: SHA-256 (hex) of the credential -> label.
    tenants: dict[str, str] = field(default_factory=dict)
    #: The switch's address-validation key (32 hex digits, SPEC.md 12.4): kept here so that a
    #: restarted switch accepts the tokens its clients already hold. "": not drawn yet.
    token_key: str = ""
    generation: int = 0
    next_gaddr: int = GLOBAL_BASE


def state_path_for(cluster_path: Path) -> Path:
    """Default state file of a cluster file: ``c.toml`` -> ``c.pool.json`` beside it."""
    return cluster_path.with_suffix(".pool.json")


def _ep(text: str) -> Endpoint:
    host, _, port = text.rpartition(":")
    return host, int(port)


def state_to_json(state: PoolState) -> str:
    data = {
        "format": STATE_FORMAT,
        "generation": state.generation,
        "next_gaddr": state.next_gaddr,
        "nodes": [vars(n) for n in state.nodes],
        "regions": [region_to_json(r) for r in state.regions],
        "groups": {
            f"{g[0]}:{g[1]}": [f"{m[0]}:{m[1]}" for m in ms] for g, ms in state.groups.items()
        },
        "tenants": dict(state.tenants),
        "token_key": state.token_key,
    }
    return json.dumps(data, indent=1)


def state_from_json(text: str, where: str = "state") -> PoolState:
    """Parse and check a state file's text; ValueError names the problem."""
    try:
        data = json.loads(text)
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {STATE_FORMAT}")
        state = PoolState(
            nodes=[NodeHeap(**n) for n in data["nodes"]],
            regions=[region_from_json(r) for r in data["regions"]],
            groups={_ep(g): [_ep(m) for m in ms] for g, ms in data.get("groups", {}).items()},
            tenants={str(k): str(v) for k, v in data.get("tenants", {}).items()},
            token_key=str(data.get("token_key", "")),
            generation=int(data["generation"]),
            next_gaddr=int(data["next_gaddr"]),
        )
        check_regions(state.regions, len(state.nodes))
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"pool state file {where} is corrupt: {exc}; restore it or start a new "
                         "pool (netdam up --switch)") from None  # fmt: skip
    return state


def load_state(path: Path) -> PoolState:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(
            f"pool state file {path} not found: start the pool with `netdam up --switch`"
        ) from None
    return state_from_json(text, str(path))


def save_state(path: Path, state: PoolState) -> None:
    """Write atomically: readers (the switch) never see half a file."""
    write_private(path, state_to_json(state))  # mode 0600: it holds every region's rkey


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Exclusive lock of the state file (``flock`` on ``<path>.lock``) for read-modify-write."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size): changes whenever the file is replaced."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
