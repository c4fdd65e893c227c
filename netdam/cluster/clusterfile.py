"""Cluster files (BRIEF section 7): TOML describing running nodes, written by ``netdam up``.

```toml
[cluster]
name = "c1a2b3"
admin_key = 3735928559
group_key = "5b0c0d3e9a8f41c2b7e6d5c4b3a29180"  # the collectives' 128-bit secret
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

The file can also be written by hand for several hosts (only ``[cluster] admin_key`` and each
node's ``rank``, ``address`` and ``port`` are required): ``netdam up --cluster FILE`` on each host
starts the nodes whose address belongs to that host and fills in their ``pid``,
``memory_file`` and ``control_port``; those are only meaningful on the host that runs the node.
Such a file gets ``keep_file = true``: ``netdam down`` then clears the fields it filled in
instead of deleting the file.

Errors name the line, the field and the fix (hand-written files are the common case).
"""

from __future__ import annotations

import difflib
import fcntl
import functools
import hashlib
import ipaddress
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from netdam.cluster.secrets_io import write_private
from netdam.protocol.constants import DEFAULT_MTU, MIN_MTU
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

    def cleared(self) -> NodeEntry:
        """This entry without what a running node fills in (pid, memory file, control port)."""
        return replace(self, pid=0, memory_file="", control_port=0)


@dataclass(frozen=True)
class ClusterFile:
    name: str
    admin_key: int
    mtu: int
    nodes: tuple[NodeEntry, ...]
    created: str = ""
    supervisor_pid: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    #: Written by hand (or for several hosts): `netdam down` clears the running nodes' fields
    #: instead of deleting the file.
    keep_file: bool = False
    #: The collectives' secret (32 hex digits, 128 bits from a CSPRNG): every collective's key
    #: derives from it (netdam.api.collective_key), so a key seen on the wire gives nothing for
    #: the next. "": a hand-written file without one; keys then derive from the admin key.
    group_key: str = ""

    @property
    def endpoints(self) -> list[Endpoint]:
        return [n.endpoint for n in self.nodes]

    @property
    def admin_tag_key(self) -> bytes:
        """The 128-bit key of the control tags (SPEC.md 2.6, "Control tags"), derived from the
        group key: every node and the switch of this cluster take control opcodes only sealed
        under it, and the admin's tools seal them."""
        return admin_tag_key(group_secret(self))


_CLUSTER_KEYS = ("name", "admin_key", "group_key", "mtu", "created", "supervisor_pid", "keep_file")
_NODE_KEYS = ("rank", "address", "port", "control_port", "pid", "memory_file", "memory_bytes")


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
    for key in _CLUSTER_KEYS:
        if (key != "keep_file" or cluster.keep_file) and (key != "group_key" or cluster.group_key):
            lines.append(f"{key} = {_toml_value(getattr(cluster, key))}")
    for node in cluster.nodes:
        lines += ["", "[[nodes]]"]
        for key in _NODE_KEYS:
            lines.append(f"{key} = {_toml_value(getattr(node, key))}")
    return "\n".join(lines) + "\n"


def write_cluster(cluster: ClusterFile, path: Path) -> None:
    """Atomically (readers never see half a file), mode 0600: it holds the admin key."""
    write_private(path, dump_cluster(cluster))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on *path*'s directory while reading, merging and rewriting it:
    several `netdam up --cluster FILE` (one per network namespace of a machine) may fill in the
    same file. (The file itself is replaced on every write, so it cannot carry the lock; the
    directory leaves no lock file behind.)"""
    fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_cluster_file(path: Path, change: Callable[[ClusterFile], ClusterFile]) -> ClusterFile:
    """Re-read *path* under its lock, apply *change*, write it back atomically; returns it."""
    with locked(path):
        updated = change(load_cluster(path))
        write_cluster(updated, path)
    return updated


def with_nodes(cluster: ClusterFile, entries: Mapping[int, NodeEntry]) -> ClusterFile:
    """*cluster* with the nodes of the given ranks replaced (the others kept as they are)."""
    return replace(cluster, nodes=tuple(entries.get(n.rank, n) for n in cluster.nodes))


def lists_nodes(path: Path) -> bool:
    """Whether *path* exists and has a ``[[nodes]]`` table (a cluster to start, not a file to
    write). A file that is not valid TOML counts: loading it names the error."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        raise ValueError(
            f"cluster file {path} is a directory: give a file path, e.g. {path}/cluster.toml"
        ) from None
    return re.search(r"^\s*\[\[\s*nodes\s*\]\]", text, re.M) is not None


# ------------------------------------------------------------------------------------ reading


class _Where:
    """Line numbers of the ``[cluster]`` table and of each ``[[nodes]]`` table and its keys."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.node_starts = [
            i + 1 for i, line in enumerate(self.lines) if re.match(r"\s*\[\[\s*nodes\s*\]\]", line)
        ]
        self.cluster_start = next(
            (i + 1 for i, line in enumerate(self.lines) if re.match(r"\s*\[\s*cluster\s*\]", line)),
            0,
        )

    def _block_end(self, start: int) -> int:
        for i in range(start, len(self.lines)):
            if re.match(r"\s*\[", self.lines[i]):
                return i
        return len(self.lines)

    def line_of(self, table_start: int, key: str | None) -> int:
        if key is None or not table_start:
            return table_start
        for i in range(table_start, self._block_end(table_start)):
            if re.match(rf"\s*{re.escape(key)}\s*=", self.lines[i]):
                return i + 1
        return table_start

    def error(self, table: str, table_start: int, key: str | None, message: str) -> ValueError:
        line = self.line_of(table_start, key)
        where = f", line {line}" if line else ""
        return ValueError(f"cluster file {self.path}{where} ({table}): {message}")


def _suggest(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return f"unknown field `{key}`: {hint}known fields are {', '.join(known)}"


def _show(value: object) -> str:
    """A value as TOML would spell it (strings in double quotes), for error messages."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _int_field(
    table: Mapping[str, object],
    key: str,
    low: int,
    high: int,
    example: str,
    default: int | None = None,
) -> int:
    """An integer field in [low, high]; ValueError names the problem and the fix (raised bare,
    the caller adds the line)."""
    if key not in table:
        if default is None:
            raise KeyError(key)
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"`{key} = {_show(value)}` must be an integer: write e.g. `{key} = {example}` (no quotes)"
        )
    if not low <= value <= high:
        raise ValueError(f"`{key} = {value}` is out of range: give {low}..{high}")
    return value


def _str_field(
    table: Mapping[str, object], key: str, example: str, default: str | None = None
) -> str:
    if key not in table:
        if default is None:
            raise KeyError(key)
        return default
    value = table[key]
    if not isinstance(value, str):
        raise ValueError(
            f'`{key} = {_show(value)}` must be a string: write e.g. `{key} = "{example}"`'
        )
    return value


def _address(value: str) -> str:
    try:
        ip = ipaddress.IPv4Address(value)
    except ValueError:
        raise ValueError(
            f'`address = "{value}"` is not an IPv4 address: write the node\'s IP, e.g. '
            '`address = "10.0.0.2"` (host names are not resolved)'
        ) from None
    if ip.is_unspecified or ip.is_multicast or value == "255.255.255.255":
        raise ValueError(
            f'`address = "{value}"` cannot be a node\'s address: give the unicast IP the '
            "other nodes reach it at"
        )
    return value


def _parse_node(table: Mapping[str, object]) -> NodeEntry:
    for key in table:
        if key not in _NODE_KEYS:
            raise ValueError(_suggest(key, _NODE_KEYS))
    return NodeEntry(
        rank=_int_field(table, "rank", 0, 1 << 20, "0"),
        address=_address(_str_field(table, "address", "10.0.0.2")),
        port=_int_field(table, "port", 1, 65535, "7744"),
        control_port=_int_field(table, "control_port", 0, 65535, "7745", default=0),
        pid=_int_field(table, "pid", 0, 1 << 31, "12345", default=0),
        memory_file=_str_field(table, "memory_file", "/dev/shm/netdam-0.mem", default=""),
        memory_bytes=_int_field(table, "memory_bytes", 0, 1 << 50, "67108864", default=0),
    )


def _missing(key: str, table: str) -> str:
    examples = {
        "rank": "rank = 0",
        "address": 'address = "10.0.0.2"',
        "port": "port = 7744",
        "admin_key": "admin_key = 3735928559  # any nonzero 32-bit number, the same on every host",
    }
    return f"missing field `{key}`: add `{examples.get(key, key + ' = ...')}` to the {table} table"


def _parse_head(data: Mapping[str, object], where: _Where, default_name: str) -> dict[str, object]:
    head = data.get("cluster")
    if not isinstance(head, dict):
        raise where.error(
            "[cluster]",
            0,
            None,
            "no [cluster] table: start the file with `[cluster]` and "
            "`admin_key = 3735928559` (any nonzero 32-bit number, the same on every host)",
        )
    start = where.cluster_start
    for key in head:
        if key not in _CLUSTER_KEYS:
            raise where.error("[cluster]", start, key, _suggest(key, _CLUSTER_KEYS))
    key = ""
    try:
        key = "admin_key"
        admin_key = _int_field(head, key, 1, 2**32 - 1, "3735928559")
        key = "mtu"
        mtu = _int_field(head, key, MIN_MTU, 65535, "9000", default=DEFAULT_MTU)
        key = "supervisor_pid"
        supervisor = _int_field(head, key, 0, 1 << 31, "0", default=0)
        key = "name"
        name = _str_field(head, key, "c1", default=default_name)
        key = "created"
        created = _str_field(head, key, "2026-11-22T05:00:00Z", default="")
        key = "group_key"
        group_key = _str_field(head, key, "3f2a...(32 hex digits)", default="")
        if group_key and not re.fullmatch(r"[0-9a-f]{32}", group_key):
            raise ValueError(
                "`group_key` must be 32 lowercase hex digits (128 bits): "
                "`python -c 'import secrets; print(secrets.token_hex(16))'` makes one"
            )
    except KeyError:
        raise where.error("[cluster]", start, None, _missing(key, "[cluster]")) from None
    except ValueError as exc:
        raise where.error("[cluster]", start, key, str(exc)) from None
    keep = head.get("keep_file", False)
    if not isinstance(keep, bool):
        raise where.error(
            "[cluster]", start, "keep_file", f"`keep_file = {keep!r}` must be true or false"
        )
    return {
        "name": name,
        "admin_key": admin_key,
        "mtu": mtu,
        "supervisor_pid": supervisor,
        "created": created,
        "keep_file": keep,
        "group_key": group_key,
    }


def _parse_nodes(data: Mapping[str, object], where: _Where) -> tuple[NodeEntry, ...]:
    tables = data.get("nodes", [])
    if not isinstance(tables, list) or not tables:
        raise ValueError(
            f"cluster file {where.path} lists no [[nodes]]: add one `[[nodes]]` table per node "
            "with `rank`, `address` and `port`"
        )
    nodes = []
    for k, table in enumerate(tables):
        start = where.node_starts[k] if k < len(where.node_starts) else 0
        label = f"[[nodes]] #{k + 1}"
        try:
            nodes.append(_parse_node(table))
        except KeyError as exc:
            raise where.error(label, start, None, _missing(str(exc.args[0]), "[[nodes]]")) from None
        except ValueError as exc:
            bad = re.search(r"`(\w+)", str(exc))
            raise where.error(label, start, bad.group(1) if bad else None, str(exc)) from None
    _check_ranks(nodes, where)
    return tuple(sorted(nodes, key=lambda n: n.rank))


def _check_ranks(nodes: list[NodeEntry], where: _Where) -> None:
    """Ranks 0..N-1, each once; no two nodes on one address and port."""
    seen_rank: dict[int, int] = {}
    seen_ep: dict[Endpoint, int] = {}
    for k, node in enumerate(nodes):
        start = where.node_starts[k] if k < len(where.node_starts) else 0
        label = f"[[nodes]] #{k + 1}"
        if node.rank in seen_rank:
            other = seen_rank[node.rank]
            raise where.error(
                label,
                start,
                "rank",
                f"rank {node.rank} is also [[nodes]] #{other + 1}'s "
                f"(line {where.line_of(where.node_starts[other], 'rank')}): give every node its own rank 0..{len(nodes) - 1}",
            )
        if node.endpoint in seen_ep:
            other = seen_ep[node.endpoint]
            raise where.error(
                label,
                start,
                "port",
                f"{node.address}:{node.port} is also [[nodes]] "
                f"#{other + 1}'s address and port: give each node on one address its own port",
            )
        seen_rank[node.rank] = k
        seen_ep[node.endpoint] = k
    missing = sorted(set(range(len(nodes))) - set(seen_rank))
    if missing:
        raise ValueError(
            f"cluster file {where.path}: ranks must be 0..{len(nodes) - 1}, each once; got "
            f"{', '.join(map(str, sorted(seen_rank)))} ({len(nodes)} nodes, rank "
            f"{missing[0]} missing): renumber the nodes 0..{len(nodes) - 1}"
        )


def parse_cluster(text: str, path: Path) -> ClusterFile:
    """A cluster file's text; ValueError names the line, the field and the fix."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(
            f"cluster file {path} is not valid TOML: {exc}: fix that line (strings in double "
            'quotes, e.g. `address = "10.0.0.2"`; one `key = value` per line)'
        ) from None
    where = _Where(path, text)
    head = _parse_head(data, where, path.stem)
    nodes = _parse_nodes(data, where)
    return ClusterFile(nodes=nodes, **head)  # type: ignore[arg-type]  # head: the parsed, checked fields by name


def load_cluster(path: str | Path) -> ClusterFile:
    """Read a cluster file; ValueError names what is wrong and how to fix it."""
    target = Path(path)
    try:
        text = target.read_text()
    except FileNotFoundError:
        raise ValueError(
            f"cluster file {target} not found: start a cluster with `netdam up`"
        ) from None
    return parse_cluster(text, target)


# ---------------------------------------------------------------- the [switch] table


@dataclass(frozen=True)
class SwitchEntry:
    """The ``[switch]`` table of a cluster file."""

    address: str
    port: int
    control_port: int = 0
    pid: int = 0
    state_file: str = ""

    @property
    def vip(self) -> Endpoint:
        return (self.address, self.port)

    @property
    def control_endpoint(self) -> Endpoint:
        return (self.address, self.control_port or self.port)


_SECTION = re.compile(r"\n\[switch\]\n.*?(?=\n\[|\Z)", re.S)


def dump_switch_entry(entry: SwitchEntry) -> str:
    return (
        f'\n[switch]\naddress = "{entry.address}"\nport = {entry.port}\n'
        f"control_port = {entry.control_port}\npid = {entry.pid}\n"
        f'state_file = "{entry.state_file}"\n'
    )


def write_switch_entry(cluster_path: Path, entry: SwitchEntry) -> None:
    """Replace (or add) the ``[switch]`` table of a cluster file, atomically."""
    text = _SECTION.sub("", cluster_path.read_text()).rstrip("\n") + "\n"
    write_private(cluster_path, text + dump_switch_entry(entry))


def load_switch_entry(cluster_path: Path) -> SwitchEntry | None:
    """The ``[switch]`` table of a cluster file, or None when it has no switch."""
    try:
        data = tomllib.loads(Path(cluster_path).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"cluster file {cluster_path} not found: start a cluster with `netdam up --switch`"
        ) from None
    table = data.get("switch")
    if table is None:
        return None
    try:
        return SwitchEntry(
            str(table["address"]),
            int(table["port"]),
            int(table.get("control_port", 0)),
            int(table.get("pid", 0)),
            str(table.get("state_file", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cluster file {cluster_path}: bad [switch] table: {exc}") from None


def require_switch(cluster_path: Path) -> SwitchEntry:
    entry = load_switch_entry(cluster_path)
    if entry is None:
        raise ValueError(
            f"cluster file {cluster_path} has no [switch]: start the cluster with "
            "`netdam up --switch`"
        )
    return entry


def group_secret(cluster: ClusterFile) -> bytes:
    """The collectives' secret: the cluster file's 128-bit ``group_key``. A hand-written file
    without one falls back to a hash of the cluster's name and admin key, which is only as hard
    to guess as the 32-bit admin key (SPEC.md 12.2)."""
    if cluster.group_key:
        return bytes.fromhex(cluster.group_key)
    return hashlib.sha256(f"{cluster.name}:{cluster.admin_key}".encode()).digest()


def derive(secret: bytes, *parts: int | str) -> bytes:
    """SHA-256 of *secret*, a zero byte and *parts* joined by ":" (so one derived value, seen on
    the wire, tells nothing of the secret or of any other)."""
    if not parts:
        return hashlib.sha256(secret + b"\x00").digest()
    return hashlib.sha256(_derive_prefix(secret, *parts[:-1]) + str(parts[-1]).encode()).digest()


@functools.lru_cache(maxsize=1024, typed=True)  # typed: True and 1 are not one part ("True", "1")
def _derive_prefix(secret: bytes, *head: int | str) -> bytes:
    """What derive hashes before its last part, built once per secret and leading parts: a
    group's calls derive their two keys each from the same parts but the epoch (the joining
    took ~1 us of each derivation's ~1.5, twice a rank's call)."""
    return secret + b"\x00" + "".join(f"{p}:" for p in head).encode()


def derived_key(secret: bytes, *parts: int | str) -> int:
    """A 32-bit key (never 0) derived from *secret* and *parts*."""
    return int.from_bytes(derive(secret, *parts)[:4], "big") or 1


def admin_tag_key(secret: bytes) -> bytes:
    """The admin tag key of the cluster whose group secret is *secret* (ClusterFile.admin_tag_key)."""
    return derive(secret, "admin-tag")[:16]
