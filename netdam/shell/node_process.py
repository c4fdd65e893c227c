"""One node process: memory file, UDP socket, the NodeCore and its compiled serve loop.

The thin I/O shell of the node core (aioquic's asyncio/protocol.py, batch-shaped). Python runs
between compiled rounds only: punted datagrams (control opcodes, PING, replies), group
membership, signals and the stop flag. Nothing per data packet happens here.
"""

from __future__ import annotations

import errno
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from netdam.core.events import GroupJoined, GroupLeft
from netdam.core.faults import FaultSpec
from netdam.core.guard import GuardConfig
from netdam.core.node import NodeConfig, NodeCore
from netdam.core.rehearsal import rehearse_control_paths
from netdam.kernels import serve
from netdam.kernels.collective import EARLY_SLOTS
from netdam.kernels.serve import ServeArgs
from netdam.kernels.state import FC_NOW, FaultState, HoldTable, Kept, RxBatch, ServeIO
from netdam.kernels.udp_io import RUN_BYTES, STATE_LEN
from netdam.protocol.constants import DEFAULT_MTU, NETDAM_UDP_PORT, Status, slot_bytes
from netdam.protocol.packet import Endpoint, endpoint_to_u64
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS
from netdam.shell.process import (
    ServeLoop,
    record_socket_buffers,
    serve_buffers,
    serve_main,
    serve_management_port,
)
from netdam.shell.shm import DEFAULT_SHM_DIR, create_memory, prefault
from netdam.shell.udp import (
    join_multicast,
    open_control_socket,
    open_udp_socket,
    pin_multicast_sender,
)

#: Datagrams received per round (at most): four full GRO runs of 64.
ROUND_DATAGRAMS = 256
#: GRO runs (64 KiB receive slots) per round.
RECV_RUNS = 32
#: Bytes of the receive buffer the GRO runs take.
RECV_BYTES = RECV_RUNS * RUN_BYTES
#: The order a lone NIC's loop visits: itself.
_ONLY_NIC = np.zeros(1, np.int64)
#: Rounds per compiled call before the control plane gets a turn (bounds stats latency).
ROUNDS_PER_CALL = 32
#: Datagrams held aside by fault injection (reorder, delay) at once.
HOLD_SLOTS = 256
#: Attempt-count table of fault injection (power of two).
FAULT_TABLE = 1 << 16


@dataclass
class NodeProcessConfig:
    bind: Endpoint = ("127.0.0.1", NETDAM_UDP_PORT)
    memory_bytes: int = 64 << 20
    shm_dir: Path = DEFAULT_SHM_DIR
    name: str = "netdam-node"
    admin_key: int = 0
    #: The cluster's admin tag key (SPEC.md 2.6, "Control tags"); b"": none (v1 control).
    admin_tag_key: bytes = b""
    members: tuple[Endpoint, ...] = ()
    mtu: int = DEFAULT_MTU
    rank: int = 0
    world_size: int = 1
    rcvbuf: int = 64 << 20
    faults: FaultSpec = field(default_factory=FaultSpec)
    #: Die with the parent (netdam up in the foreground): no orphans.
    die_with_parent: bool = False
    #: Lockout and anti-amplification (SPEC.md 12); --no-guard turns both off.
    guard: GuardConfig = field(default_factory=GuardConfig.on)
    #: Records of the NIC's trace ring (SPEC.md 6.7; 0: off).
    trace_records: int = DEFAULT_TRACE_RECORDS
    #: The process's scheduling policy (netdam.shell.startup.SCHEDULING); a process hosting
    #: several NICs runs under its first NIC's.
    scheduling: str = "batch"


@dataclass
class ServeBuffers:
    """What a compiled serve call receives into and sends with (netdam.shell.process.serve_buffers).
    One NIC's call finishes, punted datagrams included, before the next NIC's starts, so the
    NICs of one process share one set (netdam.shell.nic_host)."""

    rx_buf: np.ndarray
    rx_off: np.ndarray
    rx_len: np.ndarray
    rx_src: np.ndarray
    punt: np.ndarray
    scratch: np.ndarray

    @classmethod
    def new(cls, mtu: int = DEFAULT_MTU) -> ServeBuffers:
        """The buffers of NICs whose MTU is at most *mtu*."""
        rx_buf, rx_off, rx_len, rx_src, punt, _, scratch = serve_buffers(
            ROUND_DATAGRAMS, RECV_RUNS, HOLD_SLOTS, slot_bytes(mtu)
        )
        return cls(rx_buf, rx_off, rx_len, rx_src, punt, scratch)


class NodeProcess(ServeLoop):
    """One NIC: owns its sockets, memory file and core; ``run`` serves it until stopped (a
    process hosting several NICs serves them with ``netdam.shell.nic_host.NicHost``)."""

    def __init__(self, config: NodeProcessConfig, buffers: ServeBuffers | None = None) -> None:
        self.config = config
        self.stop = False
        self.memory = create_memory(config.shm_dir, f"{config.name}.mem", config.memory_bytes)
        try:
            self.sock = open_udp_socket(config.bind, rcvbuf=config.rcvbuf)
        except OSError as exc:
            self.memory.close()
            raise ValueError(
                f"cannot bind {config.bind[0]}:{config.bind[1]}: {exc.strerror}; "
                "pick another --bind port"
            ) from None
        bound = self.sock.getsockname()
        self.endpoint: Endpoint = (bound[0], bound[1])
        # A management port beside the data port: under a flood the data socket's receive queue
        # holds ~100 ms of packets, and stats must not wait behind them (issue 3: < 100 ms).
        self.ctrl_sock = open_control_socket(bound[0])
        self.control_port = int(self.ctrl_sock.getsockname()[1])
        members = tuple(config.members) + (self.endpoint,)
        self.core = NodeCore(
            NodeConfig(
                endpoint=self.endpoint,
                memory_bytes=config.memory_bytes,
                admin_key=config.admin_key or NodeConfig(endpoint=self.endpoint).admin_key,
                admin_tag_key=config.admin_tag_key,
                members=members,
                mtu=config.mtu,
                rank=config.rank,
                world_size=config.world_size,
                tx_slots=4 * ROUND_DATAGRAMS,
                guard=config.guard,
                trace_records=config.trace_records,
            ),
            memory=self.memory.array,
        )
        record_socket_buffers(self.sock, self.core.counters)
        #: Shared with the other NICs of the process when given (their own arrays are not this
        #: NIC's to prefault).
        self.buffers = buffers or ServeBuffers.new(config.mtu)
        self.owns_buffers = buffers is None
        self.rx_buf, self.rx_off, self.rx_len = (
            self.buffers.rx_buf,
            self.buffers.rx_off,
            self.buffers.rx_len,
        )
        self.rx_src, self.punt, self.scratch = (
            self.buffers.rx_src,
            self.buffers.punt,
            self.buffers.scratch,
        )
        self.io_state = np.zeros(STATE_LEN, np.int64)  # this socket's I/O statistics
        self.group_sock: socket.socket | None = None
        self.group: Endpoint | None = None
        spec = config.faults
        # FC_ACTIVE, FC_LOSS, FC_DUP, FC_REORDER, FC_DELAY, FC_DELAY_S, FC_NOW, FC_GEN
        self.fault_cfg = np.array(
            [
                float(spec.active),
                spec.loss,
                spec.dup,
                spec.reorder,
                spec.delay,
                spec.delay_s,
                0.0,
                0.0,
            ],
            np.float64,
        )
        self.fault_keys = np.array(
            [spec.seed & (2**64 - 1), endpoint_to_u64(self.endpoint)], np.uint64
        )
        # Without fault injection nothing is counted and only early chains are held
        # (netdam.kernels.collective.EARLY_SLOTS): not 2.6 MiB per NIC (a process may host
        # hundreds).
        table, held = (FAULT_TABLE, HOLD_SLOTS) if spec.active else (1, EARLY_SLOTS)
        self.fault_table_key = np.zeros(table, np.uint64)
        self.fault_table_count = np.zeros(table, np.uint32)
        self.hold_buf = np.zeros((held, slot_bytes(config.mtu)), np.uint8)
        self.hold_len = np.zeros(held, np.int32)
        self.hold_src = np.zeros(held, np.uint64)
        self.hold_time = np.zeros(held, np.float64)
        self.hold_gen = np.zeros(held, np.int64)
        self.hold = HoldTable(
            self.hold_buf,
            self.hold_len,
            self.hold_src,
            np.zeros(held, np.int64),
            self.hold_time,
            self.hold_gen,
        )
        self.rx = RxBatch(self.rx_buf, self.rx_off, self.rx_len, self.rx_src)
        #: The serve loop's I/O bundle.
        self._io: Kept[ServeIO] = Kept()
        #: The data, group (-1: none) and management sockets' descriptors, kept as the same int
        #: objects from call to call (Kept compares parts by identity).
        self._fds = (self.sock.fileno(), -1, self.ctrl_sock.fileno())
        #: The loop of this NIC alone that serve_once runs, and its report (a NIC of a NicHost is
        #: visited by the host's loop; its serve_once only warms it up).
        self._own_loop = serve.NicLoop(self.rx, self.punt)
        self._report = np.zeros((1, serve.OUT_COLUMNS), np.int64)
        self.faults = FaultState(
            self.fault_cfg, self.fault_keys, self.fault_table_key, self.fault_table_count, self.hold
        )

    def serve_once(
        self, timeout_ms: int, rounds: int = ROUNDS_PER_CALL, control: bool = True
    ) -> int:
        """One compiled call (up to *rounds* rounds), then the slow path. Returns why.
        *control*: the management port may have requests (False: a caller that polled it saw
        none, so its read is skipped: a failed read costs an exception, ~10 us a turn)."""
        self.fault_cfg[FC_NOW] = time.monotonic()
        # Served as a loop of one NIC (serve.NicLoop): its arguments are typed once, then the
        # compiled loop is entered directly while they stay the same objects.
        self._own_loop.put(0, self.loop_args(rounds, timeout_ms))
        self._own_loop.serve(_ONLY_NIC, 0, self._report)
        reason, n_punt = self._report[0, : serve.OUT_PUNT + 1].tolist()
        # Every ended collective's key goes after every call (ended=True: a no-op without one).
        self.after_visit(reason, n_punt, control, ended=True)
        return int(reason)

    def serve_args(self, timeout_ms: int, rounds: int) -> ServeArgs:
        """The compiled serve's arguments: the same objects from call to call while nothing in
        them changed (netdam.kernels.serve.NicLoop.put tells them by identity)."""
        core = self.core
        io = self._io.of(
            ServeIO,
            self._fds[0],
            self._fds[1],
            self._fds[2],
            RECV_BYTES,
            ROUND_DATAGRAMS,
            core.max_datagram,
            timeout_ms,
            rounds,
            self.io_state,
            self.scratch,
        )
        return (
            io,
            self.rx,
            self.faults,
            core.node_state(),
            core.guard,
            core.tx_bundle(),
            core.tx_queue,
            self.punt,
        )

    def loop_args(self, rounds: int, timeout_ms: int = 0) -> ServeArgs:
        """serve_args for a visit by a compiled loop, room reserved in the send queue first
        (NicHost's visits have no time to wait; serve_once's may)."""
        self.core.reserve(2 * ROUND_DATAGRAMS + self.hold_len.shape[0] + 1)
        return self.serve_args(timeout_ms, rounds)

    def after_visit(self, reason: int, n_punt: int, control: bool, ended: bool) -> bool:
        """The control plane's part of a visit by a compiled loop (NicHost's, or serve_once's
        own): punted datagrams (*n_punt*, in the loop's shared batch), the
        management port (*control*: it has requests), the key of a collective that *ended*,
        events. Returns whether any of it ran, or the send queue needs room (*reason*): then
        the NIC's arguments may have changed, and the loop must be given them again."""
        touched = reason == serve.RETURN_QUEUE
        if n_punt:
            self.core.handle_punted(
                self.rx_buf, self.rx_off, self.rx_len, self.rx_src, self.punt, n_punt
            )
            touched = True
        if ended:
            self.core.release_collective_key()
            touched = True
        if control:
            self._serve_control()
            touched = True
        return self._handle_events() or touched

    def _serve_control(self) -> None:
        serve_management_port(self.ctrl_sock, self.core)

    def _handle_events(self) -> bool:
        """The core's events (a group joined or left); returns whether there were any."""
        any_event = False
        while (event := self.core.next_event()) is not None:
            any_event = True
            if isinstance(event, GroupJoined):
                self.core.answer_join(event, self._join(event.group))
            elif isinstance(event, GroupLeft) and self.group_sock is not None:
                self.group_sock.close()
                self.group_sock = None
                self.group = None
                self._fds = (self._fds[0], -1, self._fds[2])
        return any_event

    def _join(self, group: Endpoint) -> Status:
        """Receive the group's datagrams on a socket bound to the group address and port
        (shared by every node of this machine: SO_REUSEADDR), membership and sends pinned to
        the interface of the node's own address (loopback for local clusters, BRIEF section 3;
        the host's interface when nodes run on several hosts or network namespaces).

        IN_USE when the port cannot be bound: another socket of the machine holds it on the
        wildcard address without SO_REUSEADDR (any socket bound to port 0 may draw it from the
        ephemeral range). The node then keeps the group it had and serves on."""
        if self.group == group:
            return Status.OK
        interface = self.endpoint[0] if self.endpoint[0] != "0.0.0.0" else "127.0.0.1"
        sock = None
        try:
            sock = open_udp_socket(group, rcvbuf=self.config.rcvbuf, reuse_addr=True)
            join_multicast(sock, group[0], interface)
            pin_multicast_sender(self.sock, interface)
        except (OSError, ValueError) as exc:
            if sock is not None:
                sock.close()
            print(f"JOIN of {group[0]}:{group[1]} refused: {exc}", file=sys.stderr, flush=True)
            in_use = isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE
            return Status.IN_USE if in_use else Status.BAD_FIELD
        if self.group_sock is not None:
            self.group_sock.close()
        self.group_sock, self.group = sock, group
        self._fds = (self._fds[0], sock.fileno(), self._fds[2])
        return Status.OK

    def ready_line(self) -> str:
        """What the NIC prints once it serves: address, memory file, management port, key (the
        launcher reads it from the process's stdout, a pipe)."""
        return (
            f"ready {self.endpoint[0]}:{self.endpoint[1]} {self.memory.path} control_port={self.control_port} "
            f"admin_key={self.core.config.admin_key}"
        )

    def sockets(self) -> tuple[socket.socket, ...]:
        """The sockets whose traffic this NIC serves: data, management, joined group (a JOIN
        of another group replaces the last: compare these, not their numbers, which the new
        socket may reuse)."""
        group = (self.group_sock,) if self.group_sock is not None else ()
        return (self.sock, self.ctrl_sock, *group)

    def wants_clock(self) -> bool:
        """Whether the NIC must be served again soon without traffic: a collective's clock
        runs, a late DONE request waits, sends wait for room, or datagrams are held aside
        (by fault injection, or early chains until their collective starts here)."""
        return bool(
            self.core.collective.needs_tick or self.core.sendq.pending() or self.hold_len.any()
        )

    def warm_up(self, resident: bool = True) -> None:
        """Compile (or load from cache) every kernel and, when *resident*, make every queue and
        table resident before announcing readiness: the serve loop's, and those the control
        opcodes reach from Python (rehearsed on scratch cores, netdam.core.rehearsal). A process
        hosting many NICs warms the kernels once and leaves its NICs' pages to first use."""
        self.serve_once(0)
        if not resident:
            return
        rehearse_control_paths()
        core = self.core
        owners = (self, core, core.sendq, core.collective) + (
            (self.buffers,) if self.owns_buffers else ()
        )
        prefault(*owners, skip=(core.memory,))

    def close(self) -> None:
        self.sock.close()
        self.ctrl_sock.close()
        if self.group_sock is not None:
            self.group_sock.close()
        self.core.memory = np.zeros(0, np.uint8)
        self.memory.close(unlink=True)


def main(config: NodeProcessConfig) -> int:
    return serve_main(
        lambda: NodeProcess(config),
        NodeProcess.ready_line,
        config.die_with_parent,
        config.scheduling,
    )
