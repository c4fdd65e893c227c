"""The pool controller's persistent state: one JSON file next to the cluster file.

Holds the address map (regions with their rkeys, backing ranges and owners), the tenants (the
SHA-256 of each tenant credential, never the credential), their quotas, the multicast groups and
a ``generation`` that grows with every change. The file is created mode 0600: it holds every
rkey. Writers (the switch's allocator, the switch when a JOIN or LEAVE arrives, ``netdam pool
quota``) take an exclusive ``flock`` on ``<state>.lock``, read, modify and replace the file
atomically (write a temporary file, ``rename``); the switch reloads the file when it changes, so
a restarted switch serves the same map and every rkey stays valid (the nodes keep their
registrations).

```json
{"format": 1, "generation": 3, "next_gaddr": 4296015872,
 "nodes": [{"address": "127.0.0.1", "port": 17744, "memory_bytes": 67108864}],
 "regions": [{"gaddr": 4294967296, "size": 65536, "rkey": 305419896, "rights": 7,
              "stride": 8192, "tenant": "", "owner": "9f86d0...", "ways": [{"node": 0, "local": 0,
              "size": 32768}]}],
 "tenants": {"9f86d0...": "label"},
 "quotas": {"default": {"percent": 50.0, "regions": 64}, "tenants": {"9f86d0...": {"bytes": 1048576}}},
 "groups": {"239.77.0.1:7744": ["127.0.0.1:17744"]}}
```

Files written before quotas (no ``quotas``) load with the built-in default quota; files written
when the switch planned each node's memory itself carry ``heap_start``/``heap_end`` per node,
which are ignored now that nodes place regions themselves (REGISTER_ANYWHERE, SPEC.md 6.1).
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
#: The quota of a tenant without one of its own when the admin set no default (SPEC.md 11.9):
#: half the pool's bytes, 64 regions.
DEFAULT_QUOTA_PERCENT = 50.0
DEFAULT_QUOTA_REGIONS = 64
#: Hex digits of a credential digest that name a tenant in listings.
SHORT_DIGEST = 12


@dataclass
class PoolNode:
    """A node of the pool: where it listens and how much memory it has. Where a region's backing
    lies in that memory is the node's choice (REGISTER_ANYWHERE); the switch only counts."""

    address: str
    port: int
    memory_bytes: int

    @property
    def endpoint(self) -> Endpoint:
        return (self.address, self.port)


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold: bytes (absolute, or *percent* of the pool's capacity) and
    regions. None: not set here (a tenant's falls back to the default quota, the default's to
    DEFAULT_QUOTA_PERCENT and DEFAULT_QUOTA_REGIONS)."""

    bytes: int | None = None
    percent: float | None = None
    regions: int | None = None

    def __post_init__(self) -> None:
        if self.bytes is not None and self.percent is not None:
            raise ValueError("a quota has bytes or a percent of the pool, not both")
        if self.bytes is not None and self.bytes < 0:
            raise ValueError(f"quota of {self.bytes} bytes must not be negative")
        if self.percent is not None and not 0 <= self.percent <= 100:
            raise ValueError(f"quota of {self.percent}% must be 0..100")
        if self.regions is not None and self.regions < 0:
            raise ValueError(f"quota of {self.regions} regions must not be negative")

    @property
    def sets_bytes(self) -> bool:
        return self.bytes is not None or self.percent is not None

    def merged(self, other: Quota) -> Quota:
        """This quota with *other*'s settings on top (a setting left None keeps this one's)."""
        if other.sets_bytes:
            size, percent = other.bytes, other.percent
        else:
            size, percent = self.bytes, self.percent
        return Quota(size, percent, other.regions if other.regions is not None else self.regions)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {}
        if self.bytes is not None:
            data["bytes"] = self.bytes
        if self.percent is not None:
            data["percent"] = self.percent
        if self.regions is not None:
            data["regions"] = self.regions
        return data

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Quota:
        def num(key: str, kind: type) -> object:
            value = data.get(key)
            return None if value is None else kind(value)

        return cls(num("bytes", int), num("percent", float), num("regions", int))  # type: ignore[arg-type]  # num gives the field's type or None


BUILTIN_QUOTA = Quota(percent=DEFAULT_QUOTA_PERCENT, regions=DEFAULT_QUOTA_REGIONS)


@dataclass
class PoolState:
    nodes: list[PoolNode]
    regions: list[Region] = field(default_factory=list)
    groups: dict[Endpoint, list[Endpoint]] = field(default_factory=dict)
    #: Tenants: SHA-256 (hex) of the credential -> label.
    tenants: dict[str, str] = field(default_factory=dict)
    #: The admin's default quota (settings left None: BUILTIN_QUOTA's) and each tenant's own
    #: (by credential digest; settings left None: the default's).
    default_quota: Quota = field(default_factory=Quota)
    quotas: dict[str, Quota] = field(default_factory=dict)
    #: The switch's address-validation key (32 hex digits, SPEC.md 12.4): kept here so that a
    #: restarted switch accepts the tokens its clients already hold. "": not drawn yet.
    token_key: str = ""
    generation: int = 0
    next_gaddr: int = GLOBAL_BASE

    @property
    def capacity(self) -> int:
        """The pool's bytes: the sum of its nodes' memory (what quota percentages are of)."""
        return sum(n.memory_bytes for n in self.nodes)

    def quota_of(self, owner: str) -> Quota:
        """The quota in force for the tenant *owner* (a credential digest), every setting filled."""
        return BUILTIN_QUOTA.merged(self.default_quota).merged(self.quotas.get(owner, Quota()))

    def byte_limit(self, owner: str) -> int:
        quota = self.quota_of(owner)
        if quota.bytes is not None:
            return quota.bytes
        return int(self.capacity * (quota.percent or 0.0) / 100)

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes, regions) the tenant *owner* holds; bytes count each way's backing in 4 KiB
        pages, the granule nodes place regions at (so 8-byte regions cost what they take)."""
        mine = [r for r in self.regions if r.owner == owner]
        return sum(r.footprint for r in mine), len(mine)


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
        "groups": {
            f"{g[0]}:{g[1]}": [f"{m[0]}:{m[1]}" for m in ms] for g, ms in state.groups.items()
        },
        "tenants": dict(state.tenants),
        "quotas": {
            "default": state.default_quota.to_json(),
            "tenants": {k: q.to_json() for k, q in state.quotas.items()},
        },
        "token_key": state.token_key,
    }
    # One line per field and per region, each dumped without indent: json's indenting encoder
    # is pure Python, and the switch rewrites this file on every ALLOC and FREE while its
    # datapath waits (a pool of 1,000 regions: ~15 ms indented, ~1 ms like this).
    lines = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()]
    lines.append(
        ' "regions": ['
        + ",".join("\n  " + json.dumps(region_to_json(r)) for r in state.regions)
        + "\n ]"
    )
    return "{\n" + ",\n".join(lines) + "\n}\n"


def state_from_json(text: str, where: str = "state") -> PoolState:
    """Parse and check a state file's text; ValueError names the problem."""
    try:
        data = json.loads(text)
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {STATE_FORMAT}")
        quotas = data.get("quotas", {})
        state = PoolState(
            # heap_start/heap_end of files from before REGISTER_ANYWHERE are left out: unused.
            nodes=[
                PoolNode(str(n["address"]), int(n["port"]), int(n["memory_bytes"]))
                for n in data["nodes"]
            ],
            regions=[region_from_json(r) for r in data["regions"]],
            groups={_ep(g): [_ep(m) for m in ms] for g, ms in data.get("groups", {}).items()},
            tenants={str(k): str(v) for k, v in data.get("tenants", {}).items()},
            default_quota=Quota.from_json(quotas.get("default", {})),
            quotas={str(k): Quota.from_json(v) for k, v in quotas.get("tenants", {}).items()},
            token_key=str(data.get("token_key", "")),
            generation=int(data["generation"]),
            next_gaddr=int(data["next_gaddr"]),
        )
        check_regions(state.regions, len(state.nodes))
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"pool state file {where} is corrupt: {exc}; restore it or start a new "
            "pool (netdam up --switch)"
        ) from None
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


def find_tenant(state: PoolState, name: str) -> str:
    """The digest of the tenant *name* names: its label, or a prefix of its credential digest
    (at least 4 hex digits). ValueError when it names none or several."""
    by_label = [digest for digest, label in state.tenants.items() if label and label == name]
    by_digest = [
        digest for digest in state.tenants if len(name) >= 4 and digest.startswith(name.lower())
    ]
    found = sorted(set(by_label or by_digest))
    if len(found) == 1:
        return found[0]
    if not found:
        known = ", ".join(
            f"{label or '-'} ({short_digest(digest)})"
            for digest, label in sorted(state.tenants.items())
        )
        raise ValueError(
            f"no tenant {name!r}: give a label or the start of a digest (at least 4 hex digits); "
            f"tenants: {known or 'none yet'}"
        )
    raise ValueError(
        f"{name!r} names {len(found)} tenants ({', '.join(map(short_digest, found))}): "
        "give more of the digest"
    )


def short_digest(digest: str) -> str:
    """The first 12 hex digits of a credential digest: how listings name a tenant."""
    return digest[:SHORT_DIGEST]


def set_quota(path: Path, owner: str | None, quota: Quota) -> PoolState:
    """Set the quota's settings (those not None) for the tenant *owner* (a digest), or the
    default quota (None), in the state file at *path*, under its lock; the new state."""
    with locked(path):
        state = load_state(path)
        if owner is None:
            state.default_quota = state.default_quota.merged(quota)
        else:
            if owner not in state.tenants:
                raise ValueError(f"no tenant with digest {short_digest(owner)}... in {path}")
            state.quotas[owner] = state.quotas.get(owner, Quota()).merged(quota)
        state.generation += 1
        save_state(path, state)
    return state


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size): changes whenever the file is replaced."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
