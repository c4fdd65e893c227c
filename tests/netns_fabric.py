"""Several hosts on one machine: Linux network namespaces on a bridge (issue 9).

``netns_fabric(["n0", "n1", "sw", "cl"], mtu=1500)`` creates one network namespace per host
(``ndt<pid>-<seq>-<host>``), each with a veth ``nd0`` into a bridge that lives in a namespace of
its own (``ndt<pid>-<seq>-br``), so nothing is added to the caller's namespace and deleting the
namespaces removes every link. The bridge and both ends of every veth get the MTU; hosts get
10.77.X.10, .11, ... on a random 10.77.X.0/24, loopback up, and a multicast route
(224.0.0.0/4 dev nd0). The bridge floods multicast (``mcast_snooping 0``: no IGMP querier here).
Processes started with ``Fabric.popen`` run in a host's namespace (``ip netns exec``) and are
stopped on exit, also when the body raised; namespaces left by a dead test process are removed
by ``cleanup_stale``.

``Capture(fabric)`` records, from inside the bridge's namespace, every IPv4/UDP frame on every
bridge port (an AF_PACKET socket with PACKET_VNET_HDR, so a GSO super-frame reports the size of
the datagrams it stands for): what crossed the bridge, and how large each datagram was.

Run as a script, this module is the host side the tests start inside namespaces:
``python tests/netns_fabric.py rank ...`` (one rank's host: netdam.init, all_reduce,
all_gather), ``... alloc ...`` (the pool's controller) and ``... client ...`` (a pool client).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import random
import secrets
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from netdam.cluster.forked import ForkedProcess, fork_process
from netdam.cluster.launch import process_alive

if TYPE_CHECKING:
    from netdam.cluster.clusterfile import ClusterFile

#: Every namespace this module creates starts with this (then the creating pid).
PREFIX = "ndt"
NETNS_DIR = Path("/run/netns")
#: The interface name inside every host namespace.
IFNAME = "nd0"
CLONE_NEWNET = 0x40000000
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
VNET_HDR = struct.Struct(
    "=BBHHHH"
)  # struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, ...
START_TIMEOUT_S = (
    120.0  # as netdam.cluster.launch: a cold numba cache compiles for a while on 2 cores
)
#: Every node (and the switch VIP) listens on the protocol's port in its own namespace.
NODE_PORT = 7744

_seq = iter(range(1 << 30))
_probe_result: list[str | None] = []


class FabricError(RuntimeError):
    """Setting up the fabric failed; the message quotes the ``ip`` command and its error."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; FabricError with the command and its stderr when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise FabricError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can). Probes once: creates a namespace
    with a bridge and a veth, then deletes it."""
    if _probe_result:
        return _probe_result[0]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create network namespaces"
    elif shutil.which("ip") is None:
        reason = "`ip` (iproute2) not found: apt-get install iproute2"
    else:
        probe = f"{PREFIX}{os.getpid()}-probe"
        try:
            ip("netns", "add", probe)
            ip("-n", probe, "link", "add", "ndbprobe", "type", "bridge")
            ip("-n", probe, "link", "add", "ndvprobe", "type", "veth", "peer", "name", "ndwprobe")
        except (FabricError, OSError, subprocess.TimeoutExpired) as exc:
            reason = f"cannot create network namespaces here ({exc}); an unprivileged container?"
        finally:
            ip("netns", "del", probe, check=False)
    _probe_result.append(reason)
    return reason


def list_netns(prefix: str = PREFIX) -> list[str]:
    """Names of the namespaces starting with *prefix*."""
    done = ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(prefix)]


def delete_netns(name: str) -> None:
    """Kill what still runs in namespace *name* (SIGKILL), then delete it."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", name, check=False)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix><pid>-...`` whose creating process is gone (a test run
    killed before its cleanup); returns their names."""
    removed = []
    for name in list_netns(prefix):
        owner = name[len(prefix) :].split("-", 1)[0]
        if owner.isdigit() and not process_alive(int(owner)):
            delete_netns(name)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    #: The bridge port (in the bridge's namespace) this host's veth plugs into.
    port: str


class ForkedInNetns(ForkedProcess):
    """A node or switch forked into a host's namespace (Fabric.fork): its stderr is its log,
    read back as a started process's stderr pipe would be, and removed with the process."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, log: Path) -> None:
        assert stdout is not None
        super().__init__(pid, stdout)
        self.log = log
        self.stderr: IO[bytes] | None = open(log, "rb")  # noqa: SIM115 (closed by stop_processes)


@dataclass
class Fabric:
    tag: str
    mtu: int
    subnet: str
    bridge: str
    bridge_netns: str
    hosts: dict[str, Host]
    processes: list[subprocess.Popen[bytes] | ForkedInNetns] = field(default_factory=list)

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start *argv* in *host*'s namespace; stopped when the fabric goes."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(self.argv(host, argv), **kwargs)
        self.processes.append(proc)
        return proc

    def fork(self, host: str, run: Callable[[], int], log: Path, name: bytes) -> ForkedInNetns:
        """Fork this process into *host*'s namespace to run *run* (a node's or the switch's
        main, whose kernels this process has loaded: fork_node_processes); stopped when the
        fabric goes. ~1.5 s of CPU less per process than ``ip netns exec netdam node``."""
        netns = NETNS_DIR / self.hosts[host].netns

        def in_namespace() -> int:
            _setns(netns)  # the child has one thread: the whole process moves
            return run()

        forked = fork_process(in_namespace, log, 0, name)
        proc = ForkedInNetns(forked.pid, forked.stdout, log)
        self.processes.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run *argv* in *host*'s namespace to completion (stdout, stderr captured as text)."""
        return subprocess.run(
            self.argv(host, argv), capture_output=True, text=True, timeout=timeout
        )

    def stop_processes(self, timeout: float = 1.0) -> None:
        """SIGTERM every process started here, SIGKILL what is left after *timeout* (a node has
        closed its socket and removed its memory file within a few serve rounds; what takes
        ~1 s more is the interpreter's exit)."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            if isinstance(proc, ForkedInNetns):
                proc.log.unlink(missing_ok=True)  # as a started process's stderr pipe goes
        self.processes.clear()

    def netns_names(self) -> list[str]:
        return [h.netns for h in self.hosts.values()] + [self.bridge_netns]


def _free_subnet() -> str:
    """A 10.77.X prefix no address or route of this namespace uses (the fabric is isolated
    anyway; this keeps addresses unambiguous for whoever reads a capture)."""
    used = ip("-4", "addr").stdout + ip("-4", "route").stdout
    for _ in range(100):
        subnet = f"10.77.{random.randrange(1, 255)}"
        if f"{subnet}." not in used:
            return subnet
    raise FabricError("no free 10.77.X.0/24")


@contextlib.contextmanager
def netns_fabric(hosts: Sequence[str], mtu: int = 9000) -> Iterator[Fabric]:
    """One namespace per name in *hosts* on a bridge at *mtu*; everything removed on exit."""
    if len(set(hosts)) != len(hosts) or not hosts:
        raise ValueError(f"host names must be distinct and not empty: {hosts}")
    cleanup_stale()
    pid, seq = os.getpid(), next(_seq)
    tag = f"{PREFIX}{pid}-{seq}"
    bridge = f"ndbr{pid}-{seq % 100}"  # <= 15 characters (IFNAMSIZ)
    subnet = _free_subnet()
    fabric = Fabric(
        tag,
        mtu,
        subnet,
        bridge,
        f"{tag}-br",
        {
            name: Host(name, f"{tag}-{name}", f"{subnet}.{10 + k}", f"ndp{k}")
            for k, name in enumerate(hosts)
        },
    )
    try:
        brns = fabric.bridge_netns
        ip("netns", "add", brns)
        ip("-n", brns, "link", "set", "lo", "up")
        ip(
            "-n",
            brns,
            "link",
            "add",
            bridge,
            "mtu",
            str(mtu),
            "type",
            "bridge",
            "mcast_snooping",
            "0",
        )
        for host in fabric.hosts.values():
            ip("netns", "add", host.netns)
            # Both ends created inside the namespaces: nothing ever appears in ours.
            ip(
                "-n",
                brns,
                "link",
                "add",
                host.port,
                "mtu",
                str(mtu),
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "mtu",
                str(mtu),
                "netns",
                host.netns,
            )
            ip("-n", brns, "link", "set", host.port, "master", bridge, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", IFNAME)
            ip("-n", host.netns, "link", "set", IFNAME, "up")
            ip("-n", host.netns, "route", "add", "224.0.0.0/4", "dev", IFNAME)
        ip("-n", brns, "link", "set", bridge, "mtu", str(mtu), "up")
        yield fabric
    finally:
        fabric.stop_processes()
        for leftover in Path("/dev/shm").glob(f"{tag}-*"):  # memory files of killed nodes
            leftover.unlink(missing_ok=True)
        for name in fabric.netns_names():
            if (NETNS_DIR / name).exists():
                delete_netns(name)


def link_mtus(fabric: Fabric) -> dict[str, int]:
    """MTU of the bridge, of every bridge port and of every host's nd0, as the kernel reports."""
    out: dict[str, int] = {}
    for ns, label in [(fabric.bridge_netns, "")] + [
        (h.netns, f"{h.name}:") for h in fabric.hosts.values()
    ]:
        for line in ip("-n", ns, "-o", "link", "show").stdout.splitlines():
            words = line.split()
            name = words[1].rstrip(":").split("@")[0]
            if name != "lo" and "mtu" in words:
                out[label + name] = int(words[words.index("mtu") + 1])
    return out


# --------------------------------------------------------------------------- node processes


def wait_ready(
    started: Sequence[subprocess.Popen[bytes] | ForkedInNetns],
    what: list[str],
    timeout: float = START_TIMEOUT_S,
) -> list[int]:
    """Wait for every process's ``ready`` line; return the control ports. A process that exits
    first raises FabricError with the last line of its stderr."""
    ports = [0] * len(started)
    selector = selectors.DefaultSelector()
    for k, proc in enumerate(started):
        assert proc.stdout is not None
        selector.register(proc.stdout, selectors.EVENT_READ, k)
    waiting = set(range(len(started)))
    deadline = time.monotonic() + timeout
    try:
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FabricError(
                    f"not ready after {timeout:.0f} s: {', '.join(what[k] for k in sorted(waiting))}"
                )
            for key, _ in selector.select(timeout=min(left, 0.5)):
                k = key.data
                line = key.fileobj.readline()
                if line.startswith(b"ready"):
                    ports[k] = next(
                        (
                            int(w.split(b"=")[1])
                            for w in line.split()
                            if w.startswith(b"control_port=")
                        ),
                        0,
                    )
                    selector.unregister(key.fileobj)
                    waiting.discard(k)
                elif not line:
                    selector.unregister(key.fileobj)
                    started[k].wait(timeout=5)
                    err = (
                        started[k].stderr.read().decode(errors="replace").strip()
                        if started[k].stderr
                        else ""
                    )
                    raise FabricError(
                        f"{what[k]} exited during start-up (code {started[k].returncode}): "
                        f"{err.splitlines()[-1] if err else 'no message'}"
                    )
    finally:
        selector.close()
    return ports


@dataclass(frozen=True)
class NetnsCluster:
    """Nodes (one per namespace), optionally a switch, and the cluster file naming them."""

    fabric: Fabric
    path: Path
    info: ClusterFile
    nodes: tuple[str, ...]
    switch: str | None = None
    vip: tuple[str, int] | None = None

    def dead_nodes(self) -> list[str]:
        """Every node process that has exited: rank, exit status and the end of its stderr (a
        failure elsewhere then names its cause instead of a silent peer)."""
        by_pid = {proc.pid: proc for proc in self.fabric.processes}
        dead = []
        for entry in self.info.nodes:
            proc = by_pid.get(entry.pid)
            if proc is None or proc.poll() is None:
                continue
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            lines = err.strip().splitlines()
            # A crash in a kernel: faulthandler's first line names it, its stack follows.
            fatal = [line for line in lines if line.startswith("Fatal Python error")]
            tail = " | ".join(fatal[:1] + lines[-12:])
            dead.append(f"node rank {entry.rank} exited {proc.returncode}: {tail}")
        return dead


def start_netns_cluster(
    fabric: Fabric,
    nodes: Sequence[str],
    path: Path,
    *,
    switch: str | None = None,
    memory: int = 4 << 20,
    port: int = NODE_PORT,
) -> NetnsCluster:
    """``netdam node`` in each of *nodes* (rank = position), bound to the host's address, all
    at the fabric's MTU; then, with *switch*, ``netdam switch`` in that host with its VIP in
    every node's members (nodes relay only to members and trust only their return segments).
    Writes the cluster file by hand (netdam/cluster/clusterfile.py format, plus [switch])."""
    from netdam.cluster.clusterfile import (
        ClusterFile,
        NodeEntry,
        SwitchEntry,
        admin_tag_key,
        write_cluster,
        write_switch_entry,
    )
    from netdam.cluster.launch import (
        forks_node_processes,
        node_command,
        node_log,
        switch_command,
        switch_log,
        warm_node_kernels,
    )
    from netdam.cluster.secrets_io import key_pipe
    from netdam.core.faults import FaultSpec
    from netdam.shell.nic_host import main as nic_host_main
    from netdam.shell.node_process import NodeProcessConfig
    from netdam.switch.faults import parse_faults
    from netdam.switch.process import SwitchProcessConfig
    from netdam.switch.process import main as switch_main
    from netdam.switch.state import state_path_for

    warm_node_kernels()  # compile once here, not in every node at once
    admin_key = random.getrandbits(32) | 1
    group_key = secrets.token_hex(16)
    tag_key = admin_tag_key(bytes.fromhex(group_key))
    endpoints = [(fabric.host(n).ip, port) for n in nodes]
    vip = (fabric.host(switch).ip, port) if switch else None
    members = endpoints + ([vip] if vip else [])
    name = f"{fabric.tag}-node"
    shm = Path("/dev/shm")
    procs: list[subprocess.Popen[bytes] | ForkedInNetns] = []
    forking = forks_node_processes()  # the suite's session does (tests/conftest.py)
    for rank, host in enumerate(nodes):
        if forking:
            config = NodeProcessConfig(
                bind=endpoints[rank],
                memory_bytes=memory,
                shm_dir=shm,
                name=f"{name}{rank}",
                admin_key=admin_key,
                admin_tag_key=tag_key,
                members=tuple(members),
                mtu=fabric.mtu,
                rank=rank,
                world_size=len(nodes),
                die_with_parent=True,
            )  # what node_command's flags make of these, below
            run = functools.partial(nic_host_main, [config])
            procs.append(fabric.fork(host, run, node_log(name, rank), b"netdam-node"))
            continue
        key_fd = key_pipe(
            admin_key, tag_key
        )  # through `ip netns exec` too: an inherited descriptor
        cmd = node_command(
            endpoints[rank],
            f"{name}{rank}",
            memory,
            key_fd,
            members,
            rank,
            len(nodes),
            shm,
            fabric.mtu,
            FaultSpec(),
            die_with_parent=True,
        )
        try:
            procs.append(
                fabric.popen(
                    host, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(key_fd,)
                )
            )
        finally:
            os.close(key_fd)
    ports = wait_ready(procs, [f"node {n} ({ip}:{p})" for n, (ip, p) in zip(nodes, endpoints)])
    info = ClusterFile(
        name=name,
        admin_key=admin_key,
        group_key=group_key,
        mtu=fabric.mtu,
        nodes=tuple(
            NodeEntry(
                rank=r,
                address=ep[0],
                port=ep[1],
                pid=p.pid,
                control_port=ports[r],
                memory_file=str(shm / f"{name}{r}.mem"),
                memory_bytes=memory,
            )
            for r, (ep, p) in enumerate(zip(endpoints, procs))
        ),
    )
    write_cluster(info, path)
    if switch and vip:
        state = state_path_for(path)
        proc: subprocess.Popen[bytes] | ForkedInNetns
        if forking:
            switch_config = SwitchProcessConfig(
                vip=vip,
                cluster_file=path,
                state_file=state,
                mtu=fabric.mtu,
                faults=parse_faults("", len(nodes)),
                seed=0,
                die_with_parent=True,
            )  # what switch_command's flags make of these, below
            run_switch = functools.partial(switch_main, switch_config)
            proc = fabric.fork(switch, run_switch, switch_log(path), b"netdam-switch")
        else:
            cmd = switch_command(path, vip, state, fabric.mtu, "", 0, die_with_parent=True)
            proc = fabric.popen(switch, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        [control] = wait_ready([proc], [f"switch {switch} ({vip[0]}:{vip[1]})"])
        write_switch_entry(path, SwitchEntry(vip[0], vip[1], control, proc.pid, str(state)))
    return NetnsCluster(fabric, path, info, tuple(nodes), switch, vip)


# --------------------------------------------------------------------------- capture


@dataclass(frozen=True)
class Frame:
    """One IPv4/UDP frame seen on a bridge port (a GSO super-frame counts its segments)."""

    port: str
    outgoing: bool  # leaving the bridge through *port* (else: entering from it)
    src: str
    dst: str
    sport: int
    dport: int
    opcode: int  # byte 1 of the UDP payload (the NetDAM opcode), -1 if none
    fragment: bool  # an IP fragment (MF set or a non-zero offset): the sender did not fit the MTU
    datagram_bytes: int  # largest IP datagram this frame stands for (IP header + UDP + payload)
    segments: int  # datagrams this frame stands for


def _setns(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def parse_frame(data: bytes, port: str, pkttype: int) -> Frame | None:
    """A Frame from virtio_net_hdr + Ethernet frame, None when not IPv4/UDP."""
    if len(data) < VNET_HDR.size + 14 + 20:
        return None
    _flags, gso_type, _hdr_len, gso_size, _cs, _co = VNET_HDR.unpack_from(data)
    eth = data[VNET_HDR.size :]
    if eth[12:14] != b"\x08\x00":
        return None
    ihl = (eth[14] & 0x0F) * 4
    if eth[14 + 9] != 17:
        return None
    fragment = int.from_bytes(eth[20:22], "big") & 0x3FFF != 0
    udp = 14 + ihl
    payload = len(eth) - udp - 8
    if gso_type != 0 and gso_size:
        segments = -(-payload // gso_size)
        datagram = ihl + 8 + min(gso_size, payload)
    else:
        segments = 1
        datagram = int.from_bytes(eth[16:18], "big")
    opcode = eth[udp + 9] if payload >= 2 else -1
    return Frame(
        port,
        pkttype == PACKET_OUTGOING,
        socket.inet_ntoa(eth[26:30]),
        socket.inet_ntoa(eth[30:34]),
        int.from_bytes(eth[udp : udp + 2], "big"),
        int.from_bytes(eth[udp + 2 : udp + 4], "big"),
        opcode,
        fragment,
        datagram,
        segments,
    )


class Capture:
    """Every IPv4/UDP frame on the bridge's ports while the ``with`` block runs."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.frames: list[Frame] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netns-capture", daemon=True)

    def __enter__(self) -> Capture:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None:
            raise FabricError(f"capture on the bridge failed: {self.error}")
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.05)  # frames still in flight on the veths
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            _setns(NETNS_DIR / self.fabric.bridge_netns)  # this thread only (CLONE_NEWNET)
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except BaseException as exc:  # reported by __enter__
            self.error = exc
            self._ready.set()
            return
        with sock:
            sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE
            sock.settimeout(0.02)
            self._ready.set()
            while True:
                try:
                    data, addr = sock.recvfrom(1 << 17)
                except TimeoutError:
                    if self._stop.is_set():
                        return
                    continue
                frame = parse_frame(data, addr[0], addr[2])
                if frame is not None:
                    self.frames.append(frame)


# --------------------------------------------------------------------------- host-side drivers


def _rank_main(args: list[str]) -> int:
    """One rank's host, inside its node's namespace: init, all_reduce, all_gather; writes the
    results (and the Work stats) to OUT.npz."""
    import argparse
    import json

    import numpy as np

    import netdam

    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(args)
    group = netdam.init(opts.cluster, opts.rank)
    world = group.world_size
    # Rendezvous (files beside OUT) before the first collective, as torch's init_process_group
    # is: nodes answer BUSY to chains of a collective their host has not started, but a rank
    # that starts seconds late (imports on a loaded machine) outlasts the others' 2.5 s watchdog.
    meeting = Path(opts.out).parent
    (meeting / f"rank{opts.rank}.ready").touch()
    deadline = time.monotonic() + 60
    while not all((meeting / f"rank{r}.ready").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {opts.rank}: not every rank reached netdam.init within 60 s")
        time.sleep(0.01)
    x = rank_input(opts.seed, opts.rank, opts.count)
    work = netdam.all_reduce(x, async_op=True)
    assert work is not None
    work.wait()
    lo, hi = opts.rank * opts.count // world, (opts.rank + 1) * opts.count // world
    gathered = np.zeros(opts.count, np.float32)
    gwork = netdam.all_gather(gathered, gather_input(opts.seed, opts.rank, hi - lo), async_op=True)
    assert gwork is not None
    gwork.wait()
    from netdam.protocol import counters as C

    counters = C.counters_to_dict(group.client.counters(group.node))
    stats = {"all_reduce": work.stats, "all_gather": gwork.stats, "counters": counters}
    np.savez(
        opts.out,
        all_reduce=x,
        all_gather=gathered,
        stats=np.frombuffer(json.dumps(stats).encode(), np.uint8),
    )
    netdam.destroy_process_group()
    return 0


def rank_input(seed: int, rank: int, count: int):
    import numpy as np

    return np.random.default_rng([seed, rank]).standard_normal(count).astype(np.float32)


def gather_input(seed: int, rank: int, count: int):
    import numpy as np

    return np.random.default_rng([seed, rank, 7]).standard_normal(count).astype(np.float32)


def _alloc_main(args: list[str]) -> int:
    """The pool's controller on some host: alloc a 64 KiB region interleaved over every node
    (8 KiB stride); prints it as one JSON object (or ``error``)."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    opts = parser.parse_args(args)
    from netdam.switch.controller import PoolController

    try:
        region = PoolController(Path(opts.cluster)).alloc(64 << 10, interleave=8192)
        result: dict[str, object] = {
            "gaddr": region.gaddr,
            "rkey": region.rkey,
            "stride": region.stride,
            "size": region.size,
            "ways": len(region.ways),
            "tag_key": region.tag_key.hex(),
        }
    except Exception as exc:  # reported to the test as JSON
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
    return 0


def _client_main(args: list[str]) -> int:
    """A pool client host: first alloc a region from here (the controller), then, on the region
    given by ``--region``, WRITE ``--size`` bytes, READ them back and FETCH_ADD a counter, once
    in requests of at most ``--piece`` bytes ("fitted") and once as PoolClient splits them
    itself for the cluster file's MTU ("default"), each with its own socket (its port is
    reported). Prints one JSON object."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--bind", required=True, help="this host's address")
    parser.add_argument("--region", type=json.loads, required=True, help="what `alloc` printed")
    parser.add_argument(
        "--piece", type=int, required=True, help="largest request payload, fitted run"
    )
    parser.add_argument("--size", type=int, default=20000)
    parser.add_argument("--adds", type=int, default=16)
    opts = parser.parse_args(args)
    from netdam.clients.pool import PoolClient, split
    from netdam.cluster.clusterfile import load_cluster, require_switch
    from netdam.switch.controller import PoolController

    vip = require_switch(Path(opts.cluster)).vip
    mtu = load_cluster(opts.cluster).mtu  # as `netdam pool` does: requests sized for the cluster
    result: dict[str, object] = {}
    try:
        region = PoolController(Path(opts.cluster), timeout=0.3).alloc(64 << 10, interleave=8192)
        result["alloc"] = {"gaddr": region.gaddr, "ways": len(region.ways)}
    except Exception as exc:  # reported to the test as JSON
        result["alloc"] = {"error": f"{type(exc).__name__}: {exc}"}
    gaddr, rkey, stride = (int(opts.region[k]) for k in ("gaddr", "rkey", "stride"))
    data = random.Random(opts.size).randbytes(opts.size)
    for mode, piece in (("fitted", opts.piece), ("default", 0)):
        run: dict[str, object] = {"ok": False}
        try:
            with PoolClient(
                vip,
                bind=opts.bind,
                timeout=0.05,
                retries=8,
                mtu=mtu,
                tag_keys={rkey: bytes.fromhex(opts.region.get("tag_key", ""))},
            ) as pool:
                run["port"] = pool.sock.getsockname()[1]
                if piece:
                    pieces = split(gaddr, len(data), stride, limit=piece)
                    pool.write_many([(a, data[a - gaddr : a - gaddr + n], rkey) for a, n in pieces])
                    back = b"".join(pool.read_many([(a, n, rkey) for a, n in pieces]))
                else:
                    pool.write(gaddr, data, rkey, stride=stride)
                    back = pool.read(gaddr, len(data), rkey, stride=stride)
                counter = gaddr + (32 << 10) + (8 if piece else 16)
                olds = [pool.fetch_add(counter, 1, rkey) for _ in range(opts.adds)]
                run.update(
                    read_back_equal=back == data,
                    fetch_add_olds_ok=olds == list(range(opts.adds)),
                    retransmits=pool.retransmits,
                    ok=back == data and olds == list(range(opts.adds)),
                )
        except Exception as exc:  # reported to the test as JSON
            run["error"] = f"{type(exc).__name__}: {exc}"
        result[mode] = run
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"rank": _rank_main, "alloc": _alloc_main, "client": _client_main}[command](rest))
