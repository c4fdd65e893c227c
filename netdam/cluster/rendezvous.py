"""Rendezvous of launched nodes: every rank reports its address to rank 0, which answers the
member list (and writes the cluster file). Used by ``netdam node`` under torchrun, mpirun, srun.

Sans-I/O core: ``Member`` (what a rank reports), ``Gathering`` (rank 0's state: checks, missing
ranks, the deadline against a given ``now``), ``LineReader`` and the message codec (one JSON
object per line, ``{"protocol": "netdam-rendezvous/1", ...}``). Thin TCP shell: ``gather`` (rank
0 listens on all interfaces at the master port), ``join`` (the others connect, retrying until rank
0 listens), and ``run_launched_node``, which binds the node's socket first, warms it up, meets
the others, then serves with ``members`` set and rank 0's admin key.

A rank whose connection closes before everyone has reported is withdrawn (a restarted rank may
report again); the same report twice is harmless; two different processes claiming one rank,
one address and port, a different world size or MTU end the rendezvous for everyone with an
error naming both (exit 2). Missing ranks at the deadline end it too, named (exit 3).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import selectors
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from netdam.cluster.clusterfile import ClusterFile, NodeEntry, write_cluster
from netdam.cluster.launcher_env import AUTO, LaunchSpec
from netdam.protocol.constants import DEFAULT_MTU
from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Endpoint

if TYPE_CHECKING:
    from netdam.shell.node_process import NodeProcess, NodeProcessConfig

PROTOCOL = "netdam-rendezvous/1"
#: Longest message accepted (a member list of thousands of ranks fits).
MAX_LINE = 1 << 22
#: Seconds a rank waits beyond the rendezvous timeout for rank 0's answer (its error included).
ANSWER_GRACE_S = 10.0
#: How often the shells check the stop flag, seconds.
POLL_S = 0.2


class RendezvousError(NetdamError):
    """The rendezvous failed; ``code`` is the exit code (3: timeout, unreachable; 2: conflict)."""

    code = 3


class RendezvousConflict(RendezvousError):
    """Ranks disagree (duplicate rank or address, world size, MTU): a usage error."""

    code = 2


class RendezvousStopped(RendezvousError):
    """The node was asked to stop (SIGTERM/SIGINT) while waiting."""

    code = 0


# --------------------------------------------------------------------------- sans-I/O core


@dataclass(frozen=True)
class Member:
    """What one rank reports: where its node listens and what a host needs to attach to it."""

    rank: int
    world_size: int
    address: str
    port: int
    control_port: int = 0
    pid: int = 0
    memory_file: str = ""
    memory_bytes: int = 0
    mtu: int = DEFAULT_MTU
    host: str = ""

    @property
    def endpoint(self) -> Endpoint:
        return (self.address, self.port)

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port} (pid {self.pid} on {self.host or '?'})"

    def entry(self) -> NodeEntry:
        return NodeEntry(
            rank=self.rank,
            address=self.address,
            port=self.port,
            pid=self.pid,
            memory_file=self.memory_file,
            memory_bytes=self.memory_bytes,
            control_port=self.control_port,
        )


_MEMBER_TYPES = {
    "rank": int,
    "world_size": int,
    "address": str,
    "port": int,
    "control_port": int,
    "pid": int,
    "memory_file": str,
    "memory_bytes": int,
    "mtu": int,
    "host": str,
}


def encode_message(obj: dict[str, Any]) -> bytes:
    """One message: a JSON object on one line."""
    return (json.dumps({"protocol": PROTOCOL, **obj}, separators=(",", ":")) + "\n").encode()


def member_message(member: Member) -> bytes:
    return encode_message({"member": asdict(member)})


def decode_message(line: bytes) -> dict[str, Any]:
    """A message's object; RendezvousError when it is not ours or not JSON."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RendezvousError(f"not a rendezvous message: {line[:60]!r}") from None
    if not isinstance(obj, dict) or obj.get("protocol") != PROTOCOL:
        raise RendezvousError(
            f"not a {PROTOCOL} message (another program on the master port?): {line[:60]!r}"
        )
    return obj


def parse_member(obj: dict[str, Any]) -> Member:
    """The member a report carries; RendezvousError names the bad field."""
    fields = obj.get("member")
    if not isinstance(fields, dict):
        raise RendezvousError("a report without a `member` object")
    for key, kind in _MEMBER_TYPES.items():
        if key not in fields or not isinstance(fields[key], kind) or isinstance(fields[key], bool):
            raise RendezvousError(
                f"report field {key!r} missing or not {kind.__name__}: {fields.get(key)!r}"
            )
    return Member(**{key: fields[key] for key in _MEMBER_TYPES})


@dataclass(frozen=True)
class Answer:
    """Rank 0's answer: the cluster's name, admin key, MTU and every member by rank."""

    name: str
    admin_key: int
    mtu: int
    members: tuple[Member, ...]
    #: The collectives' 128-bit secret, drawn by rank 0 (clusterfile.ClusterFile.group_key).
    group_key: str = ""

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(m.endpoint for m in self.members)

    def cluster_file(self, created: str = "") -> ClusterFile:
        return ClusterFile(
            name=self.name,
            admin_key=self.admin_key,
            mtu=self.mtu,
            group_key=self.group_key,
            nodes=tuple(m.entry() for m in self.members),
            created=created,
        )


def answer_message(answer: Answer) -> bytes:
    return encode_message(
        {
            "ok": True,
            "name": answer.name,
            "admin_key": answer.admin_key,
            "mtu": answer.mtu,
            "group_key": answer.group_key,
            "members": [asdict(m) for m in answer.members],
        }
    )


def error_message(text: str, code: int) -> bytes:
    return encode_message({"ok": False, "error": text, "code": code})


def parse_answer(line: bytes) -> Answer:
    """Rank 0's answer; its error (or a malformed answer) raises RendezvousError."""
    obj = decode_message(line)
    if obj.get("ok") is not True:
        error = (
            RendezvousConflict if obj.get("code") == RendezvousConflict.code else RendezvousError
        )
        raise error(f"rank 0 ended the rendezvous: {obj.get('error', 'no reason given')}")
    try:
        members = tuple(parse_member({"member": m}) for m in obj["members"])
        return Answer(
            str(obj["name"]),
            int(obj["admin_key"]),
            int(obj["mtu"]),
            members,
            str(obj.get("group_key", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"malformed answer from rank 0: {exc!r}") from None


class LineReader:
    """Bytes from a stream in, complete lines out."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_LINE:
            raise RendezvousError(f"a rendezvous message over {MAX_LINE} bytes")
        return lines


@dataclass
class Gathering:
    """Rank 0's view: who reported, what is missing, whether time is up. No I/O, no clock."""

    world_size: int
    deadline: float
    #: rank 0's MTU: every node of a cluster uses one.
    mtu: int = DEFAULT_MTU
    #: For messages: where rank 0 listens.
    master: str = ""
    timeout_s: float = 0.0
    members: dict[int, Member] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.members]

    def add(self, member: Member) -> None:
        """Record a report; RendezvousConflict when it contradicts the others."""
        if member.world_size != self.world_size:
            raise RendezvousConflict(
                f"rank {member.rank} at {member.where} has world size {member.world_size}, "
                f"rank 0 has {self.world_size}: start every rank with the same world size"
            )
        if not 0 <= member.rank < self.world_size:
            raise RendezvousConflict(
                f"rank {member.rank} at {member.where} is outside 0..{self.world_size - 1}"
            )
        if member.mtu != self.mtu:
            raise RendezvousConflict(
                f"rank {member.rank} at {member.where} has --mtu {member.mtu}, rank 0 has "
                f"{self.mtu}: give every node the same --mtu"
            )
        known = self.members.get(member.rank)
        if known is not None and known != member:
            raise RendezvousConflict(
                f"rank {member.rank} reported twice: by {known.where} and by {member.where}: "
                "every process needs its own rank (was --rank given to all of them, or "
                "are two jobs using one master port?)"
            )
        self._check_reachable(member)
        other = next(
            (
                m
                for m in self.members.values()
                if m.endpoint == member.endpoint and m.rank != member.rank
            ),
            None,
        )
        if other is not None:
            raise RendezvousConflict(
                f"ranks {other.rank} and {member.rank} both report {member.address}:{member.port}: "
                "give each node its own --bind port (or port 0)"
            )
        self.members[member.rank] = member

    def _check_reachable(self, member: Member) -> None:
        """A loopback address is unreachable from another host: with ranks on several hosts,
        nobody may report one (``--bind auto`` picks loopback when the master's name resolves to
        it, e.g. a host name mapped to 127.0.1.1 in /etc/hosts)."""
        for other in self.members.values():
            if other.host == member.host or other.rank == member.rank:
                continue
            loop = next((m for m in (member, other) if m.address.startswith("127.")), None)
            if loop is not None:
                raise RendezvousConflict(
                    f"rank {loop.rank} reports loopback address {loop.address} but ranks run on "
                    f"several hosts ({other.host}, {member.host}): give it --bind with its "
                    "host's IP, or a master address that is not loopback (NETDAM_MASTER_ADDR=IP)"
                )

    def withdraw(self, rank: int) -> None:
        """A reporter went away before the answer: it may report again."""
        if rank != 0:
            self.members.pop(rank, None)

    def check(self, now: float) -> None:
        """RendezvousError naming the missing ranks once *now* is past the deadline."""
        if self.complete or now < self.deadline:
            return
        missing = self.missing()
        shown = ", ".join(map(str, missing[:32])) + (", ..." if len(missing) > 32 else "")
        raise RendezvousError(
            f"rendezvous at {self.master or 'rank 0'} timed out after {self.timeout_s:g} s: {len(missing)} of "
            f"{self.world_size} ranks never reported (ranks {shown}): are they running, with the same "
            "master address, port and world size? (raise --rendezvous-timeout if they start slowly)"
        )

    def answer(self, name: str, admin_key: int) -> Answer:
        assert self.complete, self.missing()
        return Answer(
            name,
            admin_key,
            self.mtu,
            tuple(self.members[r] for r in range(self.world_size)),
            secrets.token_hex(16),
        )


# ---------------------------------------------------------------------------- TCP shell

StopCheck = Callable[[], bool]


def _never() -> bool:
    return False


def _listen(port: int) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", port))
    except OSError as exc:
        server.close()
        raise RendezvousConflict(
            f"rank 0 cannot listen on port {port} for the rendezvous: {exc.strerror}: pick "
            "a free port with --master HOST:PORT or NETDAM_MASTER_PORT"
        ) from None
    server.listen(256)
    server.setblocking(False)
    return server


def gather(
    port: int,
    own: Member | list[Member],
    timeout: float,
    *,
    name: str,
    admin_key: int,
    should_stop: StopCheck = _never,
) -> Answer:
    """Rank 0's process: listen on *port* (all interfaces), collect every rank's report, answer
    everyone. *own*: the NICs this process hosts (rank 0 among them)."""
    mine = own if isinstance(own, list) else [own]
    first = mine[0]
    core = Gathering(
        first.world_size, time.monotonic() + timeout, first.mtu, f"port {port}", timeout
    )
    for member in mine:
        core.add(member)
    if core.complete:
        return core.answer(name, admin_key)
    server = _listen(port)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    readers: dict[socket.socket, LineReader] = {}
    reported: dict[socket.socket, list[Member]] = {}
    try:
        while not core.complete:
            if should_stop():
                raise RendezvousStopped("rank 0 was stopped before every rank reported")
            core.check(time.monotonic())
            for key, _ in selector.select(POLL_S):
                if key.fileobj is server:
                    _accept(server, selector, readers)
                else:
                    _read_report(key.fileobj, selector, readers, reported, core)  # type: ignore[arg-type]  # registered objects are sockets, not raw descriptors
        answer = core.answer(name, admin_key)
        _send_all(reported, answer_message(answer))
        return answer
    except RendezvousError as exc:
        _send_all(readers, error_message(str(exc), exc.code))
        raise
    finally:
        for conn in readers:
            conn.close()
        selector.close()
        server.close()


def _accept(
    server: socket.socket,
    selector: selectors.BaseSelector,
    readers: dict[socket.socket, LineReader],
) -> None:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return
    conn.setblocking(False)
    selector.register(conn, selectors.EVENT_READ)
    readers[conn] = LineReader()


def _read_report(
    conn: socket.socket,
    selector: selectors.BaseSelector,
    readers: dict[socket.socket, LineReader],
    reported: dict[socket.socket, list[Member]],
    core: Gathering,
) -> None:
    """Feed one connection's bytes to the core (a process hosting several NICs reports each on
    its line); a closed or foreign connection is dropped, and the ranks it reported with it."""
    try:
        data = conn.recv(65536)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        data = b""
    try:
        lines = readers[conn].feed(data) if data else []
        for line in lines:
            member = parse_member(decode_message(line))
            core.add(member)  # a conflict propagates: it ends the rendezvous for everyone
            reported.setdefault(conn, []).append(member)
    except RendezvousConflict:
        raise
    except RendezvousError as exc:
        _send_all({conn: None}, error_message(str(exc), exc.code))
        print(f"rendezvous: dropped a connection: {exc}", file=sys.stderr)
        data = b""
    if not data:
        selector.unregister(conn)
        readers.pop(conn)
        for gone in reported.pop(conn, []):
            if all(m.rank != gone.rank for ms in reported.values() for m in ms):
                core.withdraw(gone.rank)
        conn.close()


def _send_all(conns: dict[socket.socket, Any], message: bytes) -> None:
    for conn in conns:
        try:
            conn.setblocking(True)
            conn.settimeout(5.0)
            conn.sendall(message)
        except OSError:
            pass  # that rank is gone; the others still get the message


def join(
    master: Endpoint, own: Member | list[Member], timeout: float, should_stop: StopCheck = _never
) -> Answer:
    """Other processes: report their NICs to rank 0 (retrying until it listens), wait for its
    answer."""
    mine = own if isinstance(own, list) else [own]
    first = mine[0]
    start = time.monotonic()
    deadline = start + timeout + ANSWER_GRACE_S
    where = f"{master[0]}:{master[1]}"
    sock = _connect(master, start + timeout, should_stop)
    try:
        sock.sendall(b"".join(member_message(m) for m in mine))
        reader = LineReader()
        while True:
            if should_stop():
                raise RendezvousStopped(f"rank {first.rank} was stopped while waiting for rank 0")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank {first.rank}: no member list from rank 0's rendezvous at {where} within "
                    f"{timeout + ANSWER_GRACE_S:g} s: rank 0 is waiting for other ranks or hung (see its output)"
                )
            sock.settimeout(min(POLL_S, left))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise RendezvousError(
                    f"rank {first.rank}: rank 0's rendezvous at {where} closed the connection without "
                    "an answer: rank 0 failed or was stopped (see its output)"
                )
            for line in reader.feed(data):
                return parse_answer(line)
    finally:
        sock.close()


def _connect(master: Endpoint, deadline: float, should_stop: StopCheck) -> socket.socket:
    last = "no attempt"
    while time.monotonic() < deadline:
        if should_stop():
            raise RendezvousStopped("stopped while connecting to rank 0")
        try:
            return socket.create_connection(master, timeout=1.0)
        except socket.gaierror as exc:
            raise RendezvousConflict(
                f"cannot resolve the rendezvous host {master[0]!r}: {exc.strerror}: "
                "check MASTER_ADDR / NETDAM_MASTER_ADDR / --master"
            ) from None
        except OSError as exc:
            last = exc.strerror or str(exc)
            time.sleep(0.1)
    raise RendezvousError(
        f"could not reach rank 0's rendezvous at {master[0]}:{master[1]} ({last}): is rank 0 "
        "running, and is that its address and port (MASTER_ADDR/MASTER_PORT, NETDAM_MASTER_*, --master)?"
    )


def route_address(master: Endpoint | None) -> str:
    """The local address this host uses to reach *master* (``--bind auto``): a UDP connect, no
    packet sent. 127.0.0.1 without a master (a world of one)."""
    if master is None:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master[0], master[1] or 9))
        return str(probe.getsockname()[0])
    except socket.gaierror as exc:
        raise RendezvousConflict(
            f"cannot resolve the rendezvous host {master[0]!r}: {exc.strerror}: check "
            "MASTER_ADDR / NETDAM_MASTER_ADDR / --master"
        ) from None
    except OSError as exc:
        raise RendezvousError(
            f"no route to the rendezvous host {master[0]}: {exc.strerror}: pass --bind IP:PORT"
        ) from None
    finally:
        probe.close()


# ------------------------------------------------------------------------ the launched node


def rendezvous(
    nics: list[NodeProcess],
    spec: LaunchSpec,
    timeout: float,
    admin_key: int,
    should_stop: StopCheck = _never,
) -> Answer:
    """Report the NICs of this process (bound, warmed up; their configs carry their ranks and
    the NICs' world) and get the member list: the process hosting rank 0 gathers, others join."""
    own = [
        Member(
            rank=proc.config.rank,
            world_size=proc.config.world_size,
            address=proc.endpoint[0],
            port=proc.endpoint[1],
            control_port=proc.control_port,
            pid=os.getpid(),
            memory_file=str(proc.memory.path),
            memory_bytes=proc.config.memory_bytes,
            mtu=proc.config.mtu,
            host=socket.gethostname(),
        )
        for proc in nics
    ]
    if spec.rank == 0:
        name = f"netdam-{os.getpid()}-{secrets.token_hex(3)}"
        port = spec.master[1] if spec.master is not None else 0
        return gather(port, own, timeout, name=name, admin_key=admin_key, should_stop=should_stop)
    assert spec.master is not None  # resolve_launch requires it when world_size > 1
    return join(spec.master, own, timeout, should_stop)


def adopt(proc: NodeProcess, answer: Answer) -> None:
    """Serve with the cluster's members, rank 0's admin key and the admin tag key of rank 0's
    group key (SPEC.md 2.6, "Control tags")."""
    members = answer.endpoints
    proc.config.members = members
    proc.core.config.members = members
    proc.core.set_admin_keys(answer.admin_key, answer.cluster_file().admin_tag_key)
    proc.core.set_members(members)


def run_launched_node(
    configs: list[NodeProcessConfig],
    spec: LaunchSpec,
    *,
    cluster_path: Path | None,
    timeout: float,
    admin_key: int,
) -> int:
    """``netdam node`` under a launcher: bind, warm up, rendezvous, (rank 0) write the cluster
    file, announce, serve; the NICs of *configs* (one, or this process's share: their configs
    carry their ranks) in one process. RendezvousError propagates (its ``code`` is the exit
    code)."""
    # Imported here: the node process pulls in the kernels (numba), which the rendezvous's own
    # users (tests, the launcher's parent) do not need.
    from netdam.shell.nic_host import NicHost

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.shell.process import serve_main, stop_requested

    def should_stop() -> bool:
        return stop_requested()

    def create() -> NicHost:
        host = NicHost(configs)
        try:
            host.warm_up()
            answer = rendezvous(
                host.nics, spec, timeout, admin_key or (secrets.randbits(32) | 1), should_stop
            )
            for nic in host.nics:
                adopt(nic, answer)
            if spec.rank == 0 and cluster_path is not None:
                created = datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                )
                write_cluster(answer.cluster_file(created), cluster_path)
        except RendezvousStopped:
            return host  # serve_main sees the stop request and closes it
        except BaseException:
            host.close()
            raise
        return host

    def ready(host: NicHost) -> str:
        return "\n".join(
            f"{nic.ready_line()} rank={nic.config.rank} world_size={nic.config.world_size}"
            for nic in host.nics
        )

    return serve_main(create, ready, any(c.die_with_parent for c in configs))


def resolve_bind(bind: Endpoint, master: Endpoint | None) -> Endpoint:
    """``auto`` replaced by the route's local address."""
    return (route_address(master) if bind[0] == AUTO else bind[0], bind[1])
