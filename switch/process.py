"""The switch process: the VIP socket, the SwitchCore and its compiled serve loop.

Mirrors netdam/shell/node_process.py: Python runs only between compiled calls (punted control opcodes,
the pool's ALLOC/FREE/QUERY, reloading the address map when the state file changes, persisting
JOIN/LEAVE, signals). A
management port beside the VIP answers COUNTERS/PING/JOIN even while the VIP is flooded.
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from netdam.cluster.clusterfile import ClusterFile, load_cluster
from netdam.core.faults import FaultSpec
from netdam.core.guard import GuardConfig, set_token_key
from netdam.kernels import switch_serve
from netdam.kernels.state import RxBatch, ServeIO
from netdam.kernels.udp_io import RUN_BYTES
from netdam.protocol.constants import DEFAULT_MTU, slot_bytes
from netdam.protocol.packet import Endpoint
from netdam.shell.process import (
    ServeLoop,
    record_socket_buffers,
    serve_buffers,
    serve_main,
    serve_management_port,
)
from netdam.shell.shm import prefault
from netdam.shell.udp import open_control_socket, open_udp_socket
from netdam.switch.controller import PoolService, UdpNodeAgent, tenant_table
from netdam.switch.core import HOLD_SLOTS, GroupChanged, SwitchConfig, SwitchCore
from netdam.switch.state import PoolNode, PoolState, file_stamp, load_state, locked, save_state

ROUND_DATAGRAMS = 256
RECV_RUNS = 32
ROUNDS_PER_CALL = 256
#: How often the state file is checked for a new address map, seconds.
RELOAD_CHECK_S = 0.02


@dataclass
class SwitchProcessConfig:
    vip: Endpoint
    cluster_file: Path
    state_file: Path
    mtu: int = DEFAULT_MTU
    faults: list[tuple[int, int, FaultSpec]] = field(default_factory=list)
    seed: int = 0
    rcvbuf: int = 64 << 20
    die_with_parent: bool = False
    #: Lockout and anti-amplification for clients (SPEC.md 12); --no-guard turns both off.
    guard: bool = True


def initial_state(cluster: ClusterFile) -> PoolState:
    """A fresh pool over the cluster's nodes (each places the backing of its ways itself)."""
    return PoolState(nodes=[PoolNode(n.address, n.port, n.memory_bytes) for n in cluster.nodes])


def open_state(cluster: ClusterFile, path: Path) -> PoolState:
    """Load the state file (creating it for a new pool); it must describe this cluster's nodes."""
    with locked(path):
        if file_stamp(path) is None:
            state = initial_state(cluster)
            state.token_key = secrets.token_hex(16)
            save_state(path, state)
            return state
        state = load_state(path)
        if not state.token_key:  # a state file from before address validation
            state.token_key = secrets.token_hex(16)
            save_state(path, state)
    have = [n.endpoint for n in state.nodes]
    want = [n.endpoint for n in cluster.nodes]
    if have != want:
        raise ValueError(
            f"pool state file {path} describes nodes {have}, but the cluster file names "
            f"{want}: pass the state file of this cluster (--state) or remove it"
        )
    return state


class SwitchProcess(ServeLoop):
    def __init__(self, config: SwitchProcessConfig) -> None:
        self.config = config
        self.stop = False
        cluster = load_cluster(config.cluster_file)
        state = open_state(cluster, config.state_file)
        try:
            self.sock = open_udp_socket(config.vip, rcvbuf=config.rcvbuf)
        except OSError as exc:
            raise ValueError(
                f"cannot bind the VIP {config.vip[0]}:{config.vip[1]}: {exc.strerror}; "
                "pick another --vip port"
            ) from None
        bound = self.sock.getsockname()
        self.vip: Endpoint = (bound[0], bound[1])
        self.ctrl_sock = open_control_socket(bound[0])
        self.control_port = int(self.ctrl_sock.getsockname()[1])
        self.core = SwitchCore(
            SwitchConfig(
                vip=self.vip,
                nodes=tuple(cluster.endpoints),
                admin_key=cluster.admin_key,
                admin_tag_key=cluster.admin_tag_key,
                mtu=config.mtu,
                seed=config.seed,
                tx_slots=4 * ROUND_DATAGRAMS,
                guard=GuardConfig.on() if config.guard else GuardConfig(),
                pool_bytes=state.capacity,
            ),
            state.regions,
            state.generation,
        )
        self.core.set_groups(state.groups)
        self.core.set_tenants(tenant_table(state))
        set_token_key(self.core.guard, bytes.fromhex(state.token_key))
        self.agent = UdpNodeAgent(cluster.admin_key, cluster.admin_tag_key)
        self.core.pool = PoolService(cluster, config.state_file, self.agent, self._map_changed)
        for port, direction, spec in config.faults:
            self.core.set_link_faults(port, direction, spec)
        self._stamp = file_stamp(config.state_file)
        self._next_check = 0.0
        record_socket_buffers(self.sock, self.core.counters)
        (
            self.rx_buf,
            self.rx_off,
            self.rx_len,
            self.rx_src,
            self.punt,
            self.io_state,
            self.scratch,
        ) = serve_buffers(ROUND_DATAGRAMS, RECV_RUNS, HOLD_SLOTS, slot_bytes(config.mtu))
        self.rx = RxBatch(self.rx_buf, self.rx_off, self.rx_len, self.rx_src)

    def serve_once(self, timeout_ms: int) -> int:
        core = self.core
        max_n = core.round_datagrams(ROUND_DATAGRAMS)
        core.reserve(max_n)
        io = ServeIO(
            self.sock.fileno(),
            -1,
            -1,
            RECV_RUNS * RUN_BYTES,
            max_n,
            core.max_datagram,
            timeout_ms,
            ROUNDS_PER_CALL,
            self.io_state,
            self.scratch,
        )
        reason, n_punt = switch_serve.switch_serve(
            io,
            self.rx,
            core.room_per_datagram(),
            core.switch_state(),
            core.tx_bundle(),
            core.tx_queue,
            self.punt,
        )
        if n_punt:
            core.handle_punted(
                self.rx_buf, self.rx_off, self.rx_len, self.rx_src, self.punt, int(n_punt)
            )
        self._serve_control()
        self._handle_events()
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + RELOAD_CHECK_S
            self.reload_if_changed()
        return int(reason)

    def reload_if_changed(self) -> bool:
        """Load the state file when it changed; a bad file is reported and the old map kept."""
        stamp = file_stamp(self.config.state_file)
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            state = load_state(self.config.state_file)
            self.core.set_regions(state.regions, state.generation)
            self.core.set_groups(state.groups)
            self.core.set_tenants(tenant_table(state))
        except ValueError as exc:
            print(f"switch: keeping the old address map: {exc}", file=sys.stderr, flush=True)
            return False
        return True

    def _map_changed(self, state: PoolState) -> None:
        """ALLOC or FREE changed the state file: serve the new map (and a new tenant's key)
        before the ACK leaves."""
        self.core.set_regions(state.regions, state.generation)
        self.core.set_tenants(tenant_table(state))
        self._stamp = file_stamp(self.config.state_file)

    def _serve_control(self) -> None:
        serve_management_port(self.ctrl_sock, self.core)

    def _handle_events(self) -> None:
        changes: list[GroupChanged] = []
        while (event := self.core.next_event()) is not None:
            changes.append(event)
        if not changes:
            return
        path = self.config.state_file
        with locked(path):
            state = load_state(path)
            for change in changes:
                members = [m for m in state.groups.get(change.group, []) if m != change.member]
                if change.joined:
                    members.append(change.member)
                if members:
                    state.groups[change.group] = members
                else:
                    state.groups.pop(change.group, None)
            state.generation += 1
            save_state(path, state)
            self._stamp = file_stamp(path)
        self.core.set_generation(state.generation)

    def warm_up(self) -> None:
        """Compile (or load) the kernels, make every queue and table resident (flat memory)."""
        self.serve_once(0)
        prefault(self, self.core, self.core.sendq)

    def close(self) -> None:
        self.agent.close()
        self.sock.close()
        self.ctrl_sock.close()


def main(config: SwitchProcessConfig) -> int:
    return serve_main(
        lambda: SwitchProcess(config),
        lambda proc: (
            f"ready {proc.vip[0]}:{proc.vip[1]} {config.state_file} control_port={proc.control_port}"
        ),
        config.die_with_parent,
    )
