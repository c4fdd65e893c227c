"""Start and stop local clusters of node processes (``netdam up``/``down``, tests, benchmarks).

Every node is ``python -m netdam node ...`` in its own process. A node prints ``ready ...``
once its socket is bound and its kernels are loaded; start-up waits for every node's line (or
its death, reported with its stderr). Foreground clusters die with their launcher (Linux
PR_SET_PDEATHSIG), so no node outlives a killed ``netdam up``.
"""

from __future__ import annotations

import datetime
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netdam.cluster import ClusterFile, NodeEntry, load_cluster, write_cluster
from netdam.faults import FaultSpec
from netdam.protocol.packet import Endpoint
from netdam.shm import DEFAULT_SHM_DIR

#: First node's port when not chosen: next to the protocol's default 7744.
DEFAULT_BASE_PORT = 17744
START_TIMEOUT_S = 120.0  # a cold numba cache compiles for ~10 s on 2 cores; CI machines vary


class ClusterStartError(RuntimeError):
    """A node did not come up; the message names it and quotes its error."""


@dataclass
class LocalCluster:
    """Running node processes and the cluster file describing them."""

    info: ClusterFile
    path: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    startup_seconds: float = 0.0
    #: The pool switch (netdam.switch.launch.SwitchHandle) when started with switch=True.
    switch: Any = None

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.info.endpoints

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every node, wait, SIGKILL stragglers, remove memory files and the cluster file."""
        if self.switch is not None:
            self.switch.stop()
        stop_pids([p.pid for p in self.processes], timeout, processes=self.processes)
        for node in self.info.nodes:
            if node.memory_file:
                Path(node.memory_file).unlink(missing_ok=True)
            node_log(self.info.name, node.rank).unlink(missing_ok=True)
        _remove_pool_state(self.path)
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def node_log(cluster_name: str, rank: int) -> Path:
    """Where a node launched by us writes its stderr."""
    return Path(tempfile.gettempdir()) / f"{cluster_name}-{rank}.log"


def node_command(
    bind: Endpoint, name: str, memory: int, admin_key: int, members: list[Endpoint], rank: int,
    world: int, shm_dir: Path, mtu: int, faults: FaultSpec, die_with_parent: bool,
) -> list[str]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "netdam", "node",
        "--bind", f"{bind[0]}:{bind[1]}", "--name", name, "--memory", f"{memory}B",
        "--admin-key", hex(admin_key), "--rank", str(rank), "--world-size", str(world),
        "--shm-dir", str(shm_dir), "--mtu", str(mtu),
        "--members", ",".join(f"{ip}:{port}" for ip, port in members),
    ]  # fmt: skip
    if faults.active:
        cmd += ["--loss", str(faults.loss), "--dup", str(faults.dup), "--reorder", str(faults.reorder),
                "--delay", str(faults.delay), "--delay-ms", str(faults.delay_s * 1000), "--seed", str(faults.seed)]  # fmt: skip
    if die_with_parent:
        cmd.append("--die-with-parent")
    return cmd


def start_cluster(nodes: int, **kwargs: object) -> LocalCluster:  # type: ignore[misc]
    """Start *nodes* node processes, wait until all are ready, write the cluster file.

    Free ports are probed then released, so another program may take one first: then the whole
    start is retried on fresh ports (unless the caller fixed --base-port)."""
    for attempt in range(3):
        try:
            return _start_cluster(nodes, **kwargs)  # type: ignore[arg-type]
        except ClusterStartError as exc:
            if "Address already in use" not in str(exc) or kwargs.get("base_port") or attempt == 2:
                raise
    raise AssertionError("unreachable")


def warm_node_kernels() -> None:
    """Compile (or load from numba's cache) the node's kernels once, in this process, before
    starting nodes: N processes compiling the same kernels at once on 2 cores take N times as
    long (a cold first `netdam demo` went from ~65 s of start-up to the time of one compile)."""
    from netdam.nodeproc import NodeProcess, NodeProcessConfig

    proc = NodeProcess(NodeProcessConfig(bind=("127.0.0.1", 0), memory_bytes=1 << 16,
                                         name=f"netdam-warm-{os.getpid()}"))  # fmt: skip
    try:
        proc.warm_up()
        proc.core.handle_timer(0.0)
    finally:
        proc.close()


def _start_cluster(
    nodes: int,
    *,
    memory: int = 64 << 20,
    base_port: int = 0,
    address: str = "127.0.0.1",
    shm_dir: Path = DEFAULT_SHM_DIR,
    mtu: int = 9000,
    cluster_path: Path | None = None,
    faults: FaultSpec | None = None,
    detach: bool = False,
    extra_members: tuple[Endpoint, ...] = (),
    switch: bool = False,
    switch_faults: str = "",
    switch_seed: int = 0,
) -> LocalCluster:
    if nodes < 1:
        raise ValueError("--nodes must be at least 1")
    name = f"netdam-{os.getpid()}-{secrets.token_hex(3)}"
    base = base_port or _free_port_block(address, nodes)
    endpoints = [(address, base + rank) for rank in range(nodes)]
    admin_key = secrets.randbits(32) | 1
    faults = faults or FaultSpec()
    vip = None
    if switch:
        from netdam.switch.launch import pick_vip

        vip = pick_vip(address)  # nodes must trust the switch's return segments (SPEC 3.1)
        extra_members = tuple(extra_members) + (vip,)
    members = endpoints + list(extra_members)
    start = time.monotonic()
    warm_node_kernels()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [node_log(name, rank) for rank in range(nodes)]
    for rank, bind in enumerate(endpoints):
        cmd = node_command(bind, f"{name}-{rank}", memory, admin_key, members, rank, nodes,
                           shm_dir, mtu, faults, die_with_parent=not detach)  # fmt: skip
        # stderr goes to a file, not a pipe: nobody drains a pipe once the node runs.
        with open(logs[rank], "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                          start_new_session=detach))  # fmt: skip
    try:
        control_ports = _wait_ready(procs, endpoints, logs)
    except BaseException:
        stop_pids([p.pid for p in procs], 3.0, processes=procs)
        for rank in range(nodes):
            (shm_dir / f"{name}-{rank}.mem").unlink(missing_ok=True)
        raise
    info = ClusterFile(
        name=name,
        admin_key=admin_key,
        mtu=mtu,
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        supervisor_pid=0 if detach else os.getpid(),
        nodes=tuple(
            NodeEntry(rank=r, address=ep[0], port=ep[1], pid=p.pid, control_port=control_ports[r],
                      memory_file=str(shm_dir / f"{name}-{r}.mem"), memory_bytes=memory)
            for r, (ep, p) in enumerate(zip(endpoints, procs, strict=True))
        ),
    )  # fmt: skip
    # Private clusters (demo, benchmarks) keep their files out of the user's directory.
    path = cluster_path or Path(tempfile.gettempdir()) / f"{name}.toml"
    write_cluster(info, path)
    cluster = LocalCluster(info, path, procs, time.monotonic() - start)
    if vip is not None:
        from netdam.switch.launch import start_switch

        try:
            cluster.switch = start_switch(cluster, vip, faults=switch_faults, seed=switch_seed, detach=detach)
        except BaseException:
            cluster.stop()
            raise
    return cluster


def _free_port_block(address: str, count: int) -> int:
    """A base port with *count* consecutive free UDP ports (checked by binding them)."""
    import socket

    for _ in range(50):
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.bind((address, 0))
        base = probe.getsockname()[1]
        probe.close()
        if base + count >= 65535:
            continue
        socks = []
        try:
            for k in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind((address, base + k))
            return int(base)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterStartError(f"no block of {count} free UDP ports on {address}: pass --base-port")


def _wait_ready(
    procs: list[subprocess.Popen[bytes]], endpoints: list[Endpoint], logs: list[Path]
) -> list[int]:
    """Wait for every node's ``ready`` line; return their control ports."""
    control_ports = [0] * len(procs)
    selector = selectors.DefaultSelector()
    waiting = {}
    for rank, proc in enumerate(procs):
        assert proc.stdout is not None
        selector.register(proc.stdout, selectors.EVENT_READ, rank)
        waiting[rank] = proc
    deadline = time.monotonic() + START_TIMEOUT_S
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = ", ".join(f"{endpoints[r][0]}:{endpoints[r][1]} (rank {r})" for r in waiting)
            raise ClusterStartError(f"nodes not ready after {START_TIMEOUT_S:.0f} s: {ranks}")
        for key, _ in selector.select(timeout=min(left, 0.5)):
            rank = key.data
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if line.startswith(b"ready"):
                for word in line.split():
                    if word.startswith(b"control_port="):
                        control_ports[rank] = int(word.split(b"=")[1])
                selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                del waiting[rank]
            elif not line:
                selector.unregister(key.fileobj)
                waiting.pop(rank)
                err = logs[rank].read_text(errors="replace").strip() if logs[rank].exists() else ""
                raise ClusterStartError(
                    f"node rank {rank} ({endpoints[rank][0]}:{endpoints[rank][1]}) exited "
                    f"during start-up: {err.splitlines()[-1] if err else 'no message'}"
                )
    selector.close()
    return control_ports


def stop_pids(pids: list[int], timeout: float, processes: list[subprocess.Popen[bytes]] | None = None) -> None:
    """SIGTERM, wait up to *timeout*, then SIGKILL; reaps our own children."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    by_pid = {p.pid: p for p in processes or []}
    for pid in pids:
        while _alive(pid, by_pid.get(pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid, by_pid.get(pid)):
            _signal(pid, signal.SIGKILL)
            if pid in by_pid:
                by_pid[pid].wait(timeout=5)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int, proc: subprocess.Popen[bytes] | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (not our child) still answers kill(0); /proc tells.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def stop_cluster_file(path: Path, timeout: float = 5.0) -> ClusterFile:
    """``netdam down``: stop the nodes a cluster file lists and remove their files."""
    info = load_cluster(path)
    from netdam.switch.launch import stop_switch_from_file

    stop_switch_from_file(path, timeout)
    stop_pids([n.pid for n in info.nodes if n.pid], timeout)
    for node in info.nodes:
        if node.memory_file:
            Path(node.memory_file).unlink(missing_ok=True)
        node_log(info.name, node.rank).unlink(missing_ok=True)
    _remove_pool_state(path)
    if info.supervisor_pid and _alive(info.supervisor_pid, None):
        _signal(info.supervisor_pid, signal.SIGTERM)
    path.unlink(missing_ok=True)
    return info


def _remove_pool_state(cluster_path: Path) -> None:
    """The pool's persisted state belongs to the cluster: it goes when the cluster goes (it
    survives switch restarts, not `netdam down`)."""
    from netdam.switch.state import state_path_for

    state = state_path_for(cluster_path)
    for leftover in (state, state.with_name(state.name + ".lock")):
        leftover.unlink(missing_ok=True)
