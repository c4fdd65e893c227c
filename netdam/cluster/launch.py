"""Start and stop local clusters of node processes (``netdam up``/``down``, tests, benchmarks).

Every node is ``python -m netdam node ...`` in its own process. A node prints ``ready ...``
once its socket is bound and its kernels are loaded; start-up waits for every node's line (or
its death, reported with its stderr). Foreground clusters die with their launcher (Linux
PR_SET_PDEATHSIG), so no node outlives a killed ``netdam up``.

``start_from_file`` is ``netdam up --cluster FILE`` for a FILE that already lists nodes (written
by hand, maybe for several hosts): it starts exactly the nodes whose address belongs to this
host (``is_local_address``) and fills in their entries; ``stop_cluster_file`` (``netdam down``)
likewise only stops this host's nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import random
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import netdam
from netdam import progress
from netdam.cluster.clusterfile import (
    ClusterFile,
    NodeEntry,
    SwitchEntry,
    admin_tag_key,
    load_cluster,
    load_switch_entry,
    update_cluster_file,
    with_nodes,
    write_cluster,
    write_switch_entry,
)
from netdam.cluster.forked import ForkedProcess, fork_node_process, fork_switch_process
from netdam.cluster.secrets_io import key_pipe
from netdam.core.faults import FaultSpec
from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Endpoint
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS
from netdam.shell.shm import DEFAULT_SHM_DIR, remove_memory_file
from netdam.shell.startup import CpuWatch, stall_reason
from netdam.shell.udp import MULTICAST_PORTS
from netdam.switch.state import state_path_for

#: A node process: started (``netdam node``) or forked (fork_node_processes).
NodeHandle = subprocess.Popen[bytes] | ForkedProcess

#: First node's port when not chosen: next to the protocol's default 7744, right above the
#: ports of the clusters' multicast groups (a node and a group never contend for a port).
DEFAULT_BASE_PORT = MULTICAST_PORTS.stop


class ClusterStartError(NetdamError, RuntimeError):
    """A node did not come up; the message names it and quotes its error."""


class ClusterFileError(ClusterStartError):
    """The nodes came up but their cluster file could not be written (they were stopped): the
    file's place is the user's to fix, not a failed run."""


@dataclass
class LocalCluster:
    """Running node processes and the cluster file describing them."""

    info: ClusterFile
    path: Path
    processes: list[NodeHandle] = field(default_factory=list)
    startup_seconds: float = 0.0
    #: The pool switch (SwitchHandle) when started with switch=True.
    switch: Any = None
    #: Ranks this process started; None: every node of the file (a single-host cluster).
    owned: tuple[int, ...] | None = None

    @property
    def owns_file(self) -> bool:
        """Whether stopping removes the cluster file (else it clears our nodes' entries)."""
        return self.owned is None and not self.info.keep_file

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.info.endpoints

    def process_of(self, rank: int) -> NodeHandle:
        """The process hosting *rank*'s NIC (it may host others: the cluster file's pid says)."""
        pid = next(n.pid for n in self.info.nodes if n.rank == rank)
        return next(p for p in self.processes if p.pid == pid)

    def ranks_of(self, pid: int) -> list[int]:
        """The ranks whose NICs process *pid* hosts."""
        return [n.rank for n in self.info.nodes if n.pid == pid]

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every node, wait, SIGKILL stragglers, remove memory files and the cluster file."""
        if self.switch is not None:
            self.switch.stop()
        stop_pids([p.pid for p in self.processes], timeout, processes=self.processes)
        mine = [n for n in self.info.nodes if self.owned is None or n.rank in self.owned]
        _remove_node_files(self.info.name, mine)
        if self.owns_file:
            _remove_pool_state(self.path)
            self.path.unlink(missing_ok=True)
        else:
            _clear_entries(self.path, [n.rank for n in mine])

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception):
            # Said before the nodes stop: an error inside the block ("no answer from ...") then
            # tells a dead node from a stuck one from one that dropped the request, and why.
            with contextlib.suppress(Exception):
                notes = self.health_notes()
                add_note = getattr(exc, "add_note", None)  # Python 3.11 on (PEP 678)
                for note in notes:
                    if add_note is not None:
                        add_note(note)
                    else:
                        logging.getLogger(__name__).warning("%s", note)
        self.stop()

    def health_notes(self, timeout: float = 0.5) -> list[str]:
        """One line per NIC of this cluster's node processes, for an error raised while they
        ran: an exited process's code and the end of its log; a running one's state and kernel
        wait channel (/proc: R runs, S sleeps, ``ep_poll`` waits for traffic, ``futex`` for a
        lock), and the NIC's counters that are not zero, or that it did not answer COUNTERS
        within *timeout* seconds."""
        # Imported here: the control client pulls in the codec, which stopping nodes never needs.
        from netdam.cluster.control import ControlClient, ControlError
        from netdam.protocol.counters import counters_to_dict

        notes = []
        with ControlClient.for_cluster(self.info) as client:
            for node in self.info.nodes:
                where = f"rank {node.rank} ({node.address}:{node.port}, pid {node.pid})"
                process = next((p for p in self.processes if p.pid == node.pid), None)
                code = process.poll() if process is not None else None
                if code is not None:
                    log = _log_tail(node_log(self.info.name, node.rank))
                    notes.append(f"{where}: exited with code {code}; its log ends: {log}")
                    continue
                try:
                    values = client.counters(node.control_endpoint, timeout, retries=0)
                except (ControlError, OSError) as exc:
                    answer = f"no COUNTERS answer ({exc})"
                else:
                    named = counters_to_dict(values)
                    answer = "counters " + ", ".join(
                        f"{name}={value}" for name, value in named.items() if value
                    )
                state = process_state(node.pid)
                seen = (
                    f"state {state[0]}, waiting in {state[1]}, {state[2]:.2f} s of CPU"
                    if state is not None
                    else "state unknown"
                )
                notes.append(f"{where}: running, {seen}; {answer}")
        return notes


def process_state(pid: int) -> tuple[str, str, float] | None:
    """A running process's state letter (R runs, S sleeps, T stopped), kernel wait channel and
    CPU seconds, from /proc; None without them."""
    try:
        # The state follows the name, which is in parentheses and may hold any character.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
        ticks = os.sysconf("SC_CLK_TCK")
        return fields[0], wchan, (int(fields[11]) + int(fields[12])) / ticks  # proc(5) 14-15
    except (OSError, IndexError, ValueError):
        return None


def _log_tail(path: Path, lines: int = 5) -> str:
    """The last *lines* lines of a node's log, on one line (or why there are none)."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    return " | ".join(text.splitlines()[-lines:]) if text else "(empty)"


def netdam_python(module: str = "netdam") -> list[str]:
    """The command that runs *module* as ``__main__`` in a child importing exactly this process's
    netdam package. ``python -m`` would put the current directory first on ``sys.path``, so in a
    source checkout the checkout's ``netdam/`` would hide the installed one (the issue-14 quick
    start failure), and two copies would also keep two numba caches. ``-c`` code that sets
    ``sys.path[0]`` to the directory holding our package avoids both; the word ``netdam`` stays
    in the command line, which ``is_node_process`` looks for."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(netdam.__file__)))
    code = (
        f"import sys, runpy; sys.path[0] = {root!r}; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


def node_log(cluster_name: str, rank: int) -> Path:
    """Where a node launched by us writes its stderr."""
    return Path(tempfile.gettempdir()) / f"{cluster_name}-{rank}.log"


def node_command(
    bind: Endpoint,
    name: str,
    memory: int,
    key_fd: int,
    members: list[Endpoint],
    rank: int,
    world: int,
    shm_dir: Path,
    mtu: int,
    faults: FaultSpec,
    die_with_parent: bool,
) -> list[str]:
    """The argv of a node process with one NIC; the admin key comes through inherited
    descriptor *key_fd* (a pipe, secrets_io.key_pipe), never on the command line every local
    user reads."""
    cmd = [
        *netdam_python(),
        "node",
        "--bind",
        f"{bind[0]}:{bind[1]}",
        "--name",
        name,
        "--memory",
        f"{memory}B",
        "--rank",
        str(rank),
    ]
    return cmd + _node_flags(key_fd, members, world, shm_dir, mtu, faults, die_with_parent)


def nics_command(
    nics: list[tuple[int, Endpoint, int]],
    name: str,
    key_fd: int,
    members: list[Endpoint],
    world: int,
    shm_dir: Path,
    mtu: int,
    faults: FaultSpec,
    die_with_parent: bool,
) -> list[str]:
    """The argv of a node process hosting the NICs (rank, bind, memory bytes) *nics*; memory
    files NAME-RANK.mem, the key as in node_command."""
    cmd = [*netdam_python(), "node", "--name", name]
    for rank, bind, memory in nics:
        cmd += ["--nic", f"{rank}@{bind[0]}:{bind[1]}/{memory}B"]
    return cmd + _node_flags(key_fd, members, world, shm_dir, mtu, faults, die_with_parent)


def _node_flags(
    key_fd: int,
    members: list[Endpoint],
    world: int,
    shm_dir: Path,
    mtu: int,
    faults: FaultSpec,
    die_with_parent: bool,
) -> list[str]:
    """What every NIC of a cluster is started with, whatever process hosts it."""
    cmd = [
        "--admin-key-fd",
        str(key_fd),
        "--world-size",
        str(world),
        "--shm-dir",
        str(shm_dir),
        "--mtu",
        str(mtu),
        "--members",
        ",".join(f"{ip}:{port}" for ip, port in members),
    ]
    if faults.active:
        cmd += [
            "--loss",
            str(faults.loss),
            "--dup",
            str(faults.dup),
            "--reorder",
            str(faults.reorder),
            "--delay",
            str(faults.delay),
            "--delay-ms",
            str(faults.delay_s * 1000),
            "--seed",
            str(faults.seed),
        ]
    if die_with_parent:
        cmd.append("--die-with-parent")
    return cmd


def start_cluster(nodes: int, **kwargs: object) -> LocalCluster:
    """Start *nodes* node processes, wait until all are ready, write the cluster file.

    Free ports are probed then released, so another program may take one first: then the whole
    start is retried on fresh ports (unless the caller fixed --base-port)."""
    for attempt in range(3):
        try:
            return _start_cluster(nodes, **kwargs)  # type: ignore[arg-type]  # start_cluster passes its keyword arguments on unchanged
        except ClusterStartError as exc:
            if "Address already in use" not in str(exc) or kwargs.get("base_port") or attempt == 2:
                raise
    raise AssertionError("unreachable")


def build_node_kernels() -> None:
    """Compile (or load) into this process every kernel a node reaches: its serve loop, its
    control paths, its collective clock (a scratch node, warmed up and closed); and a host's
    (its answers read, its START_COLLs stamped)."""
    # Imported here: the node process pulls in every kernel module (numba), which commands
    # that only read or stop clusters should not pay for.
    from netdam.shell.node_process import NodeProcess, NodeProcessConfig

    proc = NodeProcess(
        NodeProcessConfig(
            bind=("127.0.0.1", 0), memory_bytes=1 << 16, name=f"netdam-warm-{os.getpid()}"
        )
    )
    try:
        proc.warm_up()
        proc.core.handle_timer(0.0)
        # The hosts' own (netdam.api): what a rank's first collective would compile.
        from netdam.kernels.host_calls import warm_host_kernels

        warm_host_kernels(proc.ctrl_sock.fileno())
    finally:
        proc.close()


def warm_node_kernels(force: bool = False) -> None:
    """Compile (or load from numba's cache) the node's kernels once, in this process, before
    starting nodes: N processes compiling the same kernels at once on 2 cores take N times as
    long (a cold first `netdam demo` went from ~65 s of start-up to the time of one compile)."""
    compile_kernels_aside(switch=False)  # the engine's clock, on the other core (if cold)
    _warm("node", build_node_kernels, force)


#: Kernel modules of the switch that import nothing of the node's datapath chain (combine ->
#: collective -> datapath -> serve, each compiled after the one it calls). They compile beside
#: it, on the other core.
SWITCH_ONLY_KERNELS = ("netdam.kernels.switch_path", "netdam.kernels.pool_gen")
#: The node's one big kernel outside its datapath chain: the collective engine's clock, which
#: only the serve loop calls (netdam/kernels/serve.py compiles it, by its explicit signature,
#: just before the loop; a second process that compiled it first leaves it in the cache). Cold,
#: on this project's 2-core machine: the node's kernels took 164 s in one process, 126 s with
#: the clock compiled beside them (with the switch's own kernels after it: done in 68 s).
ASIDE_CLOCK = (
    "from netdam.kernels import collective, signatures; "
    "collective.coll_ticks.compile(signatures.COLL_TICKS)"
)

#: The process compiling kernels beside this one (compile_kernels_aside), if one was started.
_ASIDE: list[subprocess.Popen[bytes]] = []


def compile_kernels_aside(switch: bool = True) -> None:
    """On a cold kernel cache, start a second process compiling what the node's datapath chain
    does not call, while this one compiles that chain: the engine's clock (ASIDE_CLOCK), then,
    with *switch*, the switch's own kernels, so they are cached by the time this process builds
    the switch's (node and switch kernels from cold took 109.7 s one after the other and 81.8 s
    so, 2 cores). Nothing for what is cached, or when one is compiling already;
    warm_switch_kernels waits for it."""
    # A finished one is reaped (no zombie), and what it left undone is looked at again below.
    _ASIDE[:] = [aside for aside in _ASIDE if aside.poll() is None]
    if _ASIDE:
        return
    # Imported here: netdam.kernels loads numba, which commands that only read clusters skip.
    from netdam.kernels import cache_dir

    folder = cache_dir.kernel_cache_dir()
    steps = []
    if "node" not in _WARMED and not (folder / "node-kernels.built").exists():
        steps.append(ASIDE_CLOCK)
    if (
        switch
        and "switch" not in _WARMED
        and not (folder / "switch-kernels.built").exists()
        and not any(folder.glob("switch_path.*.nbi"))
    ):
        steps.append("import " + ", ".join(SWITCH_ONLY_KERNELS))
    if not steps:
        return
    code = "; ".join(
        ["from netdam.shell.startup import die_with_parent; die_with_parent()", *steps]
    )
    with contextlib.suppress(OSError):  # no second process: this one compiles them all itself
        _ASIDE.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )


def _join_aside() -> None:
    """Wait for the kernels compiling aside (a failure there costs only the time: this process
    then compiles what is missing)."""
    while _ASIDE:
        _ASIDE.pop().wait()


def warm_switch_kernels(force: bool = False) -> None:
    """As warm_node_kernels, for the switch's kernels: compiled here, with progress, before the
    switch process starts (it then loads them from the cache in a second)."""

    def build() -> None:
        # Imported here, as in warm_node_kernels: the switch process pulls in the switch's kernels.
        from netdam.switch.process import SwitchProcess, SwitchProcessConfig

        with tempfile.TemporaryDirectory(prefix="netdam-warm-") as tmp:
            node = NodeEntry(
                rank=0,
                address="127.0.0.1",
                port=_free_port_block("127.0.0.1", 1),
                memory_bytes=1 << 16,
            )
            path = Path(tmp) / "warm.toml"
            write_cluster(
                ClusterFile(
                    name="netdam-warm",
                    admin_key=1,
                    mtu=9000,
                    created="",
                    supervisor_pid=0,
                    nodes=(node,),
                ),
                path,
            )
            proc = SwitchProcess(
                SwitchProcessConfig(
                    vip=("127.0.0.1", 0), cluster_file=path, state_file=Path(tmp) / "warm.pool.json"
                )
            )
            try:
                proc.warm_up()
            finally:
                proc.close()

    _join_aside()
    _warm("switch", build, force)


#: Kernels this process has built or found built ("node", "switch").
_WARMED: set[str] = set()


def _warm(what: str, build: Callable[[], None], force: bool = False) -> None:
    """Run *build* (a warm-up that compiles or loads *what*'s kernels) and, when it is still
    busy after a second (loading from the cache takes less: it compiles), say so once and how
    long it took. No deadline: compiling takes what the machine gives it, and Ctrl-C stops it.
    Skipped when they were built before, unless *force* (to load them into this process)."""
    # Imported here: netdam.kernels loads numba, which commands that only read clusters skip.
    from netdam.kernels import cache_dir

    # Once built (this process, or any since the cache was made: its folder is named by the
    # sources' digest, so a marker there is never stale) a node loads its kernels itself in
    # a second; building them again here cost every start 0.5 s for nothing.
    marker = cache_dir.kernel_cache_dir() / f"{what}-kernels.built"
    if not force and (what in _WARMED or marker.exists()):
        _WARMED.add(what)
        return
    start = time.monotonic()
    done = threading.Event()
    noted = threading.Event()

    def tell() -> None:
        if not done.wait(1.0):
            noted.set()
            if cache_dir.cold_since is None:  # else the import already said it compiles
                progress.note(
                    f"first run: compiling the {what} kernels once (1-3 min on 2 cores, longer "
                    f"on a busy machine; cached in {cache_dir.kernel_cache_dir()} for later runs)"
                )
            progress.status(f"compiling the {what} kernels (once)")

    threading.Thread(target=tell, name="netdam-compile-note", daemon=True).start()
    try:
        build()
    finally:
        done.set()
    _WARMED.add(what)
    with contextlib.suppress(OSError):  # a read-only cache: the next start builds again, no harm
        marker.touch()
    if noted.is_set():
        # Counted from when compiling began: on a cold cache that is the import, which compiles
        # the typed kernels before any warm-up runs (the user saw "compiled in 16 s" after 77 s).
        began = min(start, cache_dir.cold_since or start)
        progress.note(
            f"{what} kernels ready {time.monotonic() - began:.0f} s after compiling began "
            "(cached from now on)"
        )


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
    guard: bool = True,
    nics_per_process: int | None = None,
    trace_records: int = DEFAULT_TRACE_RECORDS,
    scheduling: str = "batch",
) -> LocalCluster:
    if nodes < 1:
        raise ValueError("--nodes must be at least 1")
    name = f"netdam-{os.getpid()}-{secrets.token_hex(3)}"
    base = base_port or _free_port_block(address, nodes)
    endpoints = [(address, base + rank) for rank in range(nodes)]
    admin_key = secrets.randbits(32) | 1
    group_key = secrets.token_hex(16)
    faults = faults or FaultSpec()
    vip = None
    if switch:
        compile_kernels_aside()
        vip = pick_vip(address)  # nodes must trust the switch's return segments (SPEC 3.1)
        extra_members = tuple(extra_members) + (vip,)
    members = endpoints + list(extra_members)
    start = time.monotonic()
    spec = _NodeSpec(
        name,
        admin_key,
        members,
        nodes,
        shm_dir,
        mtu,
        faults,
        detach,
        guard,
        admin_tag_key=admin_tag_key(bytes.fromhex(group_key)),
        trace_records=trace_records,
        scheduling=scheduling,
    )
    procs, started = _spawn_nodes(
        spec, [(rank, ep, memory) for rank, ep in enumerate(endpoints)], nics_per_process
    )
    info = ClusterFile(
        name=name,
        admin_key=admin_key,
        group_key=group_key,
        mtu=mtu,
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        supervisor_pid=0 if detach else os.getpid(),
        nodes=tuple(
            NodeEntry(
                rank=r,
                address=ep[0],
                port=ep[1],
                pid=started[r][0],
                control_port=started[r][1],
                memory_file=str(spec.memory_file(r)),
                memory_bytes=memory,
            )
            for r, ep in enumerate(endpoints)
        ),
    )
    # Private clusters (demo, benchmarks) keep their files out of the user's directory.
    path = cluster_path or Path(tempfile.gettempdir()) / f"{name}.toml"
    try:
        write_cluster(info, path)
    except BaseException as exc:
        # Without the file nothing could find these nodes to stop them (`netdam down` reads it):
        # stop them and remove their memory and log files before reporting.
        stop_pids([p.pid for p in procs], 3.0, processes=procs)
        _remove_node_files(name, list(info.nodes))
        if isinstance(exc, OSError):
            elsewhere = (
                "give --cluster a path in a writable directory"
                if cluster_path is not None
                else "point TMPDIR at a writable directory"
            )
            fix = (
                f"free space in {path.parent} or {elsewhere}"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else elsewhere
            )
            raise ClusterFileError(
                f"cannot write the cluster file {path} ({exc.strerror or exc}); its "
                f"{nodes} nodes were stopped: {fix}"
            ) from None
        raise
    cluster = LocalCluster(info, path, procs, time.monotonic() - start)
    if vip is not None:
        try:
            cluster.switch = start_switch(
                cluster, vip, faults=switch_faults, seed=switch_seed, detach=detach, guard=guard
            )
        except BaseException:
            cluster.stop()
            raise
    return cluster


@dataclass(frozen=True)
class _NodeSpec:
    """What every node of one cluster is started with."""

    name: str
    admin_key: int
    members: list[Endpoint]
    world: int
    shm_dir: Path
    mtu: int
    faults: FaultSpec
    detach: bool
    #: Lockout and anti-amplification on (False: --no-guard, for fuzzing).
    guard: bool = True
    #: The cluster's admin tag key (ClusterFile.admin_tag_key): the nodes take control
    #: opcodes only with their control tag (SPEC.md 2.6).
    admin_tag_key: bytes = b""
    #: Records of each NIC's trace ring (SPEC.md 6.7; 0: off).
    trace_records: int = DEFAULT_TRACE_RECORDS
    #: The node processes' scheduling policy (netdam.shell.startup.SCHEDULING).
    scheduling: str = "batch"

    def memory_file(self, rank: int) -> Path:
        return self.shm_dir / f"{self.name}-{rank}.mem"


def placement(nodes: int, nics_per_process: int | None = None) -> int:
    """NICs per node process: *nics_per_process* when given, else the NICs spread over one
    process per core (each process loads the kernels once; more processes than cores only
    compete for them)."""
    if nics_per_process is not None:
        if nics_per_process < 1:
            raise ValueError(f"--nics-per-process {nics_per_process}: give at least 1")
        return nics_per_process
    processes = max(1, min(nodes, os.cpu_count() or 1))
    return -(-nodes // processes)


def _spawn_nodes(
    spec: _NodeSpec, nodes: list[tuple[int, Endpoint, int]], nics_per_process: int | None = None
) -> tuple[list[NodeHandle], dict[int, tuple[int, int]]]:
    """Start node processes hosting one NIC per (rank, bind, memory bytes), *nics_per_process*
    each (default: placement), wait until every NIC is ready; the processes and, by rank, the
    (pid, control port) of each NIC. On failure every started process is stopped and cleaned up."""
    warm_node_kernels()
    per = placement(len(nodes), nics_per_process)
    hosted = [nodes[k : k + per] for k in range(0, len(nodes), per)]
    progress.status(f"starting {len(nodes)} NICs in {len(hosted)} node processes")
    procs: list[NodeHandle] = []
    logs = [node_log(spec.name, nics[0][0]) for nics in hosted]
    for nics, log_path in zip(hosted, logs, strict=True):
        if _FORK[0] and not spec.detach:
            procs.append(fork_node_process(_host_configs(spec, nics), log_path, _verbosity()))
            continue
        key_fd = key_pipe(spec.admin_key, spec.admin_tag_key)
        try:
            # stderr goes to a file, not a pipe: nobody drains a pipe once the node runs.
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        _host_command(spec, nics, key_fd),
                        stdout=subprocess.PIPE,
                        stderr=log,
                        pass_fds=(key_fd,),
                        start_new_session=spec.detach,
                    )
                )
        finally:
            os.close(key_fd)  # the child holds its own copy
    try:
        ports = _wait_ready(
            procs, [[(rank, bind) for rank, bind, _ in nics] for nics in hosted], logs
        )
    except BaseException:
        stop_pids([p.pid for p in procs], 3.0, processes=procs)
        for rank, _, _ in nodes:
            spec.memory_file(rank).unlink(missing_ok=True)
        raise
    by_rank = {
        rank: (proc.pid, ports[rank])
        for proc, nics in zip(procs, hosted, strict=True)
        for rank, _, _ in nics
    }
    return procs, by_rank


def _host_command(spec: _NodeSpec, nics: list[tuple[int, Endpoint, int]], key_fd: int) -> list[str]:
    """The argv of the process hosting *nics*, its key on the inherited descriptor *key_fd*."""
    if len(nics) == 1:
        [(rank, bind, memory)] = nics
        cmd = node_command(
            bind,
            f"{spec.name}-{rank}",
            memory,
            key_fd,
            spec.members,
            rank,
            spec.world,
            spec.shm_dir,
            spec.mtu,
            spec.faults,
            die_with_parent=not spec.detach,
        )
    else:
        cmd = nics_command(
            nics,
            spec.name,
            key_fd,
            spec.members,
            spec.world,
            spec.shm_dir,
            spec.mtu,
            spec.faults,
            die_with_parent=not spec.detach,
        )
    if not spec.guard:
        cmd.append("--no-guard")
    if spec.trace_records != DEFAULT_TRACE_RECORDS:
        cmd += ["--trace-records", str(spec.trace_records)]
    if spec.scheduling != "batch":
        cmd += ["--scheduling", spec.scheduling]
    if logging.getLogger().isEnabledFor(logging.INFO):
        cmd.append("-v" if not logging.getLogger().isEnabledFor(logging.DEBUG) else "-vv")
    return cmd


#: Whether this process forks its (non-detached) node processes (fork_node_processes).
_FORK = [False]


def fork_node_processes(enabled: bool = True) -> None:
    """Start this process's non-detached node processes by forking it (netdam.cluster.forked)
    instead of starting ``netdam node``: a process that starts cluster after cluster (a test
    session, a benchmark sweep) loads the kernels once, here, and each start costs milliseconds
    of CPU instead of ~1.5 s per node process. Loads the node's kernels into this process now."""
    if enabled:
        warm_node_kernels(force=True)
        warm_switch_kernels(force=True)
    _FORK[0] = enabled


def forks_node_processes() -> bool:
    """Whether this process forks its non-detached node processes (fork_node_processes)."""
    return _FORK[0]


def _host_configs(spec: _NodeSpec, nics: list[tuple[int, Endpoint, int]]) -> list[Any]:
    """What `netdam node` would make of _host_command's arguments, for a forked node process."""
    # Imported here: it loads numba's compiled kernels, which fork_node_processes loaded already.
    from netdam.core.guard import GuardConfig
    from netdam.shell.node_process import NodeProcessConfig

    return [
        NodeProcessConfig(
            bind=bind,
            memory_bytes=memory,
            shm_dir=spec.shm_dir,
            name=f"{spec.name}-{rank}",
            admin_key=spec.admin_key,
            admin_tag_key=spec.admin_tag_key,
            members=tuple(spec.members),
            mtu=spec.mtu,
            rank=rank,
            world_size=spec.world,
            faults=spec.faults,
            die_with_parent=True,
            guard=GuardConfig.on() if spec.guard else GuardConfig(),
            trace_records=spec.trace_records,
            scheduling=spec.scheduling,
        )
        for rank, bind, memory in nics
    ]


def _verbosity() -> int:
    """The launcher's -v count, which its node processes get too."""
    root = logging.getLogger()
    return 2 if root.isEnabledFor(logging.DEBUG) else 1 if root.isEnabledFor(logging.INFO) else 0


def is_local_address(address: str) -> bool:
    """Whether *address* belongs to this host (in this network namespace): binding a UDP socket
    to it succeeds. With net.ipv4.ip_nonlocal_bind set every address binds, so the interface
    addresses (SIOCGIFADDR) decide then."""

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((address, 0))
    except OSError:
        return False
    finally:
        probe.close()
    if _nonlocal_bind() and not address.startswith("127."):
        return address in _interface_addresses()
    return True


def _nonlocal_bind() -> bool:
    try:
        return Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() == "1"
    except OSError:
        return False


def _interface_addresses() -> set[str]:
    """The primary IPv4 address of every interface (ioctl SIOCGIFADDR)."""

    found = set()
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, ifname in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
            except OSError:
                continue
            found.add(socket.inet_ntoa(raw[20:24]))
    finally:
        probe.close()
    return found


def start_from_file(
    path: Path,
    *,
    memory: int = 64 << 20,
    shm_dir: Path = DEFAULT_SHM_DIR,
    faults: FaultSpec | None = None,
    detach: bool = False,
    mtu: int | None = None,
    nics_per_process: int | None = None,
    trace_records: int = DEFAULT_TRACE_RECORDS,
    scheduling: str = "batch",
) -> LocalCluster:
    """``netdam up --cluster FILE`` with a FILE that lists nodes (hand-written, maybe for several
    hosts): start exactly the nodes whose address is an address of this host, with the file's
    ranks, ports, admin key and MTU (memory: the entry's ``memory_bytes``, else *memory*), every
    node of the file as members; then fill in their pid, memory_file and control_port, keep the
    other entries as written, and mark the file ``keep_file``."""
    info = load_cluster(path)
    if mtu is not None and mtu != info.mtu:
        raise ValueError(
            f"--mtu {mtu} differs from mtu = {info.mtu} in {path}: edit the file or drop --mtu"
        )
    local = [n for n in info.nodes if is_local_address(n.address)]
    if not local:
        addresses = ", ".join(sorted({n.address for n in info.nodes}))
        raise ValueError(
            f"no node of {path} has an address of this host (the file lists {addresses}): run "
            "`netdam up --cluster FILE` on the hosts that own them, or fix `address`"
        )
    for node in local:
        if node.pid and is_node_process(node.pid):
            raise ValueError(
                f"rank {node.rank} ({node.address}:{node.port}) of {path} already runs as pid "
                f"{node.pid}: stop it first with `netdam down --cluster {path}`"
            )
    start = time.monotonic()
    spec = _NodeSpec(
        info.name,
        info.admin_key,
        info.endpoints,
        len(info.nodes),
        shm_dir,
        info.mtu,
        faults or FaultSpec(),
        detach,
        admin_tag_key=info.admin_tag_key,
        trace_records=trace_records,
        scheduling=scheduling,
    )
    sizes = {n.rank: n.memory_bytes or memory for n in local}
    procs, started = _spawn_nodes(
        spec, [(n.rank, n.endpoint, sizes[n.rank]) for n in local], nics_per_process
    )
    entries = {
        n.rank: replace(
            n,
            pid=started[n.rank][0],
            control_port=started[n.rank][1],
            memory_file=str(spec.memory_file(n.rank)),
            memory_bytes=sizes[n.rank],
        )
        for n in local
    }
    all_local = len(local) == len(info.nodes)

    def fill(current: ClusterFile) -> ClusterFile:
        head = {"supervisor_pid": 0 if detach else os.getpid()} if all_local else {}
        return replace(with_nodes(current, entries), keep_file=True, **head)  # type: ignore[arg-type]  # head: checked fields by name

    try:
        updated = update_cluster_file(path, fill)
    except BaseException:
        stop_pids([p.pid for p in procs], 3.0, processes=procs)
        _remove_node_files(info.name, list(entries.values()))
        raise
    return LocalCluster(updated, path, procs, time.monotonic() - start, owned=tuple(entries))


def is_node_process(pid: int) -> bool:
    """Whether *pid* is alive and runs netdam (a stale file's pid may have been reused)."""
    if not _alive(pid, None):
        return False
    try:
        # A forked node (netdam.cluster.forked) has its launcher's command line and its own name.
        return (
            b"netdam"
            in Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes()
        )
    except OSError:
        return True  # no /proc: trust the file


def _remove_node_files(cluster_name: str, nodes: list[NodeEntry]) -> None:
    for node in nodes:
        if node.memory_file:
            remove_memory_file(Path(node.memory_file))
        node_log(cluster_name, node.rank).unlink(missing_ok=True)


def _clear_entries(path: Path, ranks: list[int]) -> None:
    """Forget the running state (pid, memory file, control port) of *ranks* in the file."""
    if not path.exists():
        return

    def clear(current: ClusterFile) -> ClusterFile:
        cleared = {n.rank: n.cleared() for n in current.nodes if n.rank in ranks}
        everyone_local = len(cleared) == len(current.nodes)
        return replace(
            with_nodes(current, cleared),
            supervisor_pid=0 if everyone_local else current.supervisor_pid,
        )

    try:
        update_cluster_file(path, clear)
    except ValueError as exc:  # edited meanwhile into something unreadable: leave it alone
        print(f"warning: could not clear ranks {ranks} in {path}: {exc}", file=sys.stderr)


def _free_port_block(address: str, count: int) -> int:
    """A base port with *count* consecutive free UDP ports (checked by binding them), below the
    kernel's ephemeral range when there is room: every socket bound to port 0 (a node's
    management port, any client) takes its port from that range, so none can take a node's port
    between this probe and the node's own bind (with 256 NICs starting at once, one in three
    starts collided when the block came from the ephemeral range)."""
    low = _ephemeral_range()[0]
    below = low - count > DEFAULT_BASE_PORT
    rng = random.SystemRandom()
    for _ in range(50):
        if below:
            base = rng.randrange(DEFAULT_BASE_PORT, low - count)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((address, 0))
                base = probe.getsockname()[1]
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


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to sockets bound to port 0 (ip(7) ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _wait_ready(
    procs: list[NodeHandle],
    hosted: list[list[tuple[int, Endpoint]]],
    logs: list[Path],
    what: str = "node",
) -> dict[int, int]:
    """Wait for the ``ready`` line of every (rank, endpoint) that each process hosts (its
    kernels loaded, its sockets bound); return each rank's control port.

    No fixed deadline: a process may take as long as it keeps using CPU (loading or compiling
    kernels on a busy machine), and fails once it has used none for STALL_S."""
    control_ports: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    waiting: dict[int, dict[Endpoint, int]] = {}
    pending = [b""] * len(procs)  # each process's output after its last newline
    for k, proc in enumerate(procs):
        assert proc.stdout is not None
        selector.register(proc.stdout, selectors.EVENT_READ, k)
        waiting[k] = {endpoint: rank for rank, endpoint in hosted[k]}
    start = time.monotonic()
    watch = {k: CpuWatch(proc.pid) for k, proc in enumerate(procs)}

    def named(k: int) -> str:
        return ", ".join(
            f"{_label(what, rank)} at {ep[0]}:{ep[1]}" for ep, rank in waiting[k].items()
        )

    while waiting:
        now = time.monotonic()
        reasons = {
            k: reason for k in waiting if (reason := stall_reason(watch[k], start, now)) is not None
        }
        if reasons:
            stalled = ", ".join(f"{named(k)} (log {logs[k]})" for k in reasons)
            raise ClusterStartError(
                f"not ready, {next(iter(reasons.values()))}: {stalled}; "
                "its log says where it stopped"
            )
        left = sorted(rank for nics in waiting.values() for rank in nics.values())
        progress.status(
            f"waiting for {len(waiting)} of {len(procs)} {what} processes to load their "
            f"kernels ({', '.join(_label(what, r) for r in left[:4])}{', ...' if len(left) > 4 else ''})"
        )
        for key, _ in selector.select(timeout=0.5):
            k = key.data
            # Raw reads: a process hosting several NICs writes their lines at once, and a
            # buffered readline would leave all but the first where select cannot see them.
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
                err = logs[k].read_text(errors="replace").strip() if logs[k].exists() else ""
                raise ClusterStartError(
                    f"{named(k)} exited during start-up: {_last_error(err)} (full log: {logs[k]})"
                )
            *lines, pending[k] = (pending[k] + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"ready") or not waiting[k]:
                    continue
                words = line.split()
                rank = waiting[k].pop(_ready_endpoint(words), None)
                if rank is None:  # bound elsewhere than asked (port 0): the next one it hosts
                    rank = waiting[k].pop(next(iter(waiting[k])))
                for word in words:
                    if word.startswith(b"control_port="):
                        control_ports[rank] = int(word.split(b"=")[1])
            if not waiting[k]:
                selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]  # registered objects are pipes, not raw descriptors
                del waiting[k]
    selector.close()
    return control_ports


def _ready_endpoint(words: list[bytes]) -> Endpoint | None:
    """The IP:PORT a ``ready`` line names (its second word), None when it names none."""
    host, _, port = (words[1] if len(words) > 1 else b"").decode(errors="replace").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _label(what: str, rank: int) -> str:
    return f"node rank {rank}" if what == "node" else what


def _last_error(log: str) -> str:
    """The line of a start-up log that says what went wrong: the last ``error``/exception line,
    else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if not lines:
        return "no message"
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line.split(":")[0] or " ERROR " in line:
            return line
    return lines[-1]


def stop_pids(pids: list[int], timeout: float, processes: list[NodeHandle] | None = None) -> None:
    """SIGTERM, wait up to *timeout*, then SIGKILL; reaps our own children. A pid listed twice
    (a process hosting several NICs) is signalled once. A child of ours already reaped (a test
    killed it) is not signalled: its pid may belong to another process by now."""
    by_pid = {p.pid: p for p in processes or []}
    pids = [pid for pid in dict.fromkeys(pids) if pid not in by_pid or by_pid[pid].poll() is None]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
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


def _alive(pid: int, proc: NodeHandle | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    return process_alive(pid)


def process_alive(pid: int) -> bool:
    """Whether *pid* runs (a zombie does not: it answers kill(0), /proc tells)."""
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
    """``netdam down``: stop the nodes of a cluster file that run on this host (address of this
    host, pid running netdam) and remove their memory files. When every node of the file is
    local and the file is not ``keep_file``, the file goes too (and the foreground ``netdam up``
    that supervises it is told to stop); otherwise the stopped nodes' pid, memory_file and
    control_port are cleared and the other entries kept. Returns the file with the local nodes."""
    info = load_cluster(path)
    local = [n for n in info.nodes if is_local_address(n.address)]
    stop_switch_from_file(path, timeout)
    stop_pids([n.pid for n in local if n.pid and is_node_process(n.pid)], timeout)
    _remove_node_files(info.name, local)
    if len(local) == len(info.nodes) and info.supervisor_pid and _alive(info.supervisor_pid, None):
        _signal(info.supervisor_pid, signal.SIGTERM)
    if len(local) == len(info.nodes) and not info.keep_file:
        _remove_pool_state(path)
        path.unlink(missing_ok=True)
    else:
        _clear_entries(path, [n.rank for n in local])
    return replace(info, nodes=tuple(local))


def _remove_pool_state(cluster_path: Path) -> None:
    """The pool's persisted state belongs to the cluster: it goes when the cluster goes (it
    survives switch restarts, not `netdam down`)."""
    state = state_path_for(cluster_path)
    for leftover in (state, state.with_name(state.name + ".lock")):
        leftover.unlink(missing_ok=True)


# ---------------------------------------------------------------- the switch of a local cluster
# The nodes must trust the switch (its VIP is in their ``members``) from the start, so the VIP is
# chosen before the nodes: ``vip = pick_vip(); start_cluster(..., extra_members=(vip,));
# start_switch(cluster, vip)``, or ``start_pool_cluster`` which does both. The switch adds a
# ``[switch]`` table to the cluster file (netdam.cluster.clusterfile.SwitchEntry).


@dataclass
class SwitchHandle:
    """A running switch process."""

    entry: SwitchEntry
    process: NodeHandle
    cluster_path: Path
    startup_seconds: float = 0.0

    @property
    def vip(self) -> Endpoint:
        return self.entry.vip

    @property
    def state_file(self) -> Path:
        return Path(self.entry.state_file)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (then SIGKILL) the switch; the state file stays (rkeys survive a restart)."""
        stop_pids([self.process.pid], timeout, processes=[self.process])
        switch_log(self.cluster_path).unlink(missing_ok=True)


def switch_log(cluster_path: Path) -> Path:
    return Path(tempfile.gettempdir()) / f"{cluster_path.stem}-switch.log"


def pick_vip(address: str = "127.0.0.1") -> Endpoint:
    """A free UDP port on *address* for the VIP (checked by binding it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((address, 0))
        return (address, int(probe.getsockname()[1]))


def switch_command(
    cluster_path: Path,
    vip: Endpoint,
    state_file: Path,
    mtu: int,
    faults: str,
    seed: int,
    die_with_parent: bool,
    guard: bool = True,
) -> list[str]:
    cmd = [
        *netdam_python("netdam.switch"),
        "--cluster",
        str(cluster_path),
        "--vip",
        f"{vip[0]}:{vip[1]}",
        "--state",
        str(state_file),
        "--mtu",
        str(mtu),
        "--seed",
        str(seed),
    ]
    if faults:
        cmd += ["--faults", faults]
    if die_with_parent:
        cmd.append("--die-with-parent")
    if not guard:
        cmd.append("--no-guard")
    if logging.getLogger().isEnabledFor(logging.INFO):  # the launcher's -v reaches the switch's log
        cmd.append("-v" if not logging.getLogger().isEnabledFor(logging.DEBUG) else "-vv")
    return cmd


def start_switch(
    cluster: LocalCluster,
    vip: Endpoint,
    *,
    state_file: Path | None = None,
    faults: str = "",
    seed: int = 0,
    detach: bool = False,
    guard: bool = True,
) -> SwitchHandle:
    """Start the switch of *cluster* on *vip* (which the nodes were started to trust), wait
    until it serves, and add ``[switch]`` to the cluster file."""
    state = state_file or state_path_for(cluster.path)
    log = switch_log(cluster.path)
    start = time.monotonic()
    warm_switch_kernels()
    progress.status("starting the switch")
    proc: NodeHandle
    if _FORK[0] and not detach:
        proc = fork_switch_process(
            _switch_config(cluster, vip, state, faults, seed, guard), log, _verbosity()
        )
    else:
        cmd = switch_command(
            cluster.path, vip, state, cluster.info.mtu, faults, seed, not detach, guard
        )
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=detach
            )
    try:
        control_port = _wait_ready([proc], [[(0, vip)]], [log], what="switch")[0]
    except ClusterStartError:
        stop_pids([proc.pid], 3.0, processes=[proc])
        raise
    except BaseException:
        stop_pids([proc.pid], 3.0, processes=[proc])
        raise
    entry = SwitchEntry(vip[0], vip[1], control_port, proc.pid, str(state))
    try:
        write_switch_entry(cluster.path, entry)
    except BaseException:
        stop_pids([proc.pid], 3.0, processes=[proc])  # not in the file: nothing else would stop it
        log.unlink(missing_ok=True)
        raise
    return SwitchHandle(entry, proc, cluster.path, time.monotonic() - start)


def _switch_config(
    cluster: LocalCluster, vip: Endpoint, state: Path, faults: str, seed: int, guard: bool
) -> Any:
    """What `python -m netdam.switch` would make of switch_command's arguments, for a forked switch."""
    # Imported here: they load the switch's kernels, which fork_node_processes loaded already.
    from netdam.switch.faults import parse_faults
    from netdam.switch.process import SwitchProcessConfig

    return SwitchProcessConfig(
        vip=vip,
        cluster_file=cluster.path,
        state_file=state,
        mtu=cluster.info.mtu,
        faults=parse_faults(faults, len(cluster.info.nodes)),
        seed=seed,
        die_with_parent=True,
        guard=guard,
    )


def start_pool_cluster(
    nodes: int,
    *,
    faults: str = "",
    seed: int = 0,
    state_file: Path | None = None,
    **cluster_kwargs: object,
) -> tuple[LocalCluster, SwitchHandle]:
    """Nodes that trust a VIP, then the switch on it: ``netdam up --switch`` in one call."""
    compile_kernels_aside()
    address = str(cluster_kwargs.get("address", "127.0.0.1"))
    vip = pick_vip(address)
    cluster = start_cluster(nodes, extra_members=(vip,), **cluster_kwargs)
    try:
        handle = start_switch(
            cluster,
            vip,
            state_file=state_file,
            faults=faults,
            seed=seed,
            detach=bool(cluster_kwargs.get("detach", False)),
            guard=bool(cluster_kwargs.get("guard", True)),
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster, handle


def stop_switch_from_file(cluster_path: Path, timeout: float = 5.0) -> SwitchEntry | None:
    """``netdam down`` for the switch: stop the pid its [switch] table names."""
    entry = load_switch_entry(cluster_path)
    if entry is not None and entry.pid:
        stop_pids([entry.pid], timeout)
        switch_log(cluster_path).unlink(missing_ok=True)
    return entry
