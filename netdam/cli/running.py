"""Does a cluster file still describe running nodes? Checked before a command uses it.

A stale file (its nodes stopped, the machine rebooted) or a hand-edited wrong port otherwise
surfaces late and cryptically: a collective NACKed with BAD_SEGMENT, a pool request timing out,
`stats` reading counters over the control port while the data port in the file is wrong. Each
node is PINGed on the data port the file names; one that does not answer is diagnosed:

- its listed pid runs no node any more: the file is stale (every node gone: exit 2, the fix is
  `netdam down` then `netdam up`; some gone: a dead node, exit 3);
- its node runs but listens elsewhere (the node's --bind, or its control port answers): the
  file is wrong, exit 2, naming the port to write;
- nothing to tell: the node does not answer, exit 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from netdam.cli.common import CommandError, ExitCode
from netdam.cluster.clusterfile import ClusterFile, NodeEntry, load_switch_entry
from netdam.cluster.control import ControlClient, ControlError

#: Seconds a node gets to answer the PING (x2 tries): a running node answers in microseconds.
PING_TIMEOUT_S = 0.3


@dataclass(frozen=True)
class NodeFault:
    """Why one rank of a cluster file cannot be used, and whose fault it is."""

    rank: int
    message: str
    code: ExitCode
    #: Its listed pid runs no node any more.
    gone: bool = False


def restart_hint(path: Path) -> str:
    return f"clean up with `netdam down --cluster {path}`, then start a cluster with `netdam up`"


def stale_message(path: Path, info: ClusterFile) -> str | None:
    """One line when no process the file lists (nodes, switch) runs any more, else None. Reads
    /proc only (no packets): cheap enough for every command that takes --cluster."""
    pids = [n.pid for n in info.nodes]
    switch = load_switch_entry(path)
    if switch is not None:
        pids.append(switch.pid)
    if not pids or not all(pids) or not all(_local(n) for n in info.nodes):
        return None  # hand-written or several hosts: the file names no pids to check here
    if any(_runs_node(pid) for pid in pids):
        return None
    listed = ", ".join(str(pid) for pid in pids)
    return f"{path} is stale: none of its processes runs any more (pids {listed}): {restart_hint(path)}"


def check_not_stale(path: Path, info: ClusterFile) -> None:
    message = stale_message(path, info)
    if message is not None:
        raise CommandError(message, ExitCode.USAGE)


def diagnose(
    path: Path, info: ClusterFile, timeout: float = PING_TIMEOUT_S
) -> tuple[dict[int, dict[str, int]], list[NodeFault]]:
    """PING every node of *info* on the data port its entry names: the INFO fields of those that
    answer (by rank), and what is wrong with the others."""
    answers: dict[int, dict[str, int]] = {}
    faults: list[NodeFault] = []
    with ControlClient.for_cluster(info) as client:
        for node in info.nodes:
            try:
                fields, _ = client.ping(node.endpoint, timeout=timeout)
            except (ControlError, OSError):
                faults.append(_why_silent(path, node, client, timeout))
                continue
            if fields.get("rank") != node.rank:
                faults.append(
                    NodeFault(
                        node.rank,
                        f"rank {node.rank} of {path} lists {node.address}:{node.port}, "
                        f"where a node of rank {fields.get('rank')} answers: the file does not "
                        f"match the running nodes: fix `port` of rank {node.rank}, or "
                        f"{restart_hint(path)}",
                        ExitCode.USAGE,
                    )
                )
                continue
            answers[node.rank] = fields
    return answers, faults


def summarize(path: Path, info: ClusterFile, faults: list[NodeFault]) -> tuple[str, ExitCode]:
    """One line and an exit code for *faults* (not empty)."""
    if len(faults) == len(info.nodes) and all(f.gone for f in faults):
        pids = ", ".join(str(n.pid) for n in info.nodes)
        return (
            f"{path} is stale: none of its nodes runs any more (pids {pids}): {restart_hint(path)}",
            ExitCode.USAGE,
        )
    # The file's own faults first: their fix (the file) is the user's, and certain.
    ordered = sorted(faults, key=lambda f: f.code != ExitCode.USAGE)
    first = ordered[0]
    more = f" ({len(faults) - 1} more ranks fail likewise or worse)" if len(faults) > 1 else ""
    code = ExitCode.USAGE if all(f.code == ExitCode.USAGE for f in faults) else ExitCode.RUN_FAILED
    return first.message + more, code


def check_running(path: Path, info: ClusterFile) -> dict[int, dict[str, int]]:
    """The INFO fields of every node (by rank), or a CommandError naming the first rank that
    cannot be used, its address and the fix."""
    answers, faults = diagnose(path, info)
    if faults:
        message, code = summarize(path, info, faults)
        raise CommandError(message, code)
    return answers


def why_silent(path: Path, node: NodeEntry, timeout: float = PING_TIMEOUT_S) -> NodeFault:
    """What is wrong with *node* of the file at *path*, which did not answer a PING."""
    with ControlClient() as client:
        return _why_silent(path, node, client, timeout)


def _why_silent(path: Path, node: NodeEntry, client: ControlClient, timeout: float) -> NodeFault:
    where = f"rank {node.rank} ({node.address}:{node.port}) of {path}"
    if node.pid and _local(node):
        if not _runs_node(node.pid):
            return NodeFault(
                node.rank,
                f"{where} no longer runs (pid {node.pid} is gone): {restart_hint(path)}",
                ExitCode.RUN_FAILED,
                gone=True,
            )
        bound = _bound_ports(node.pid)
        if bound and node.port not in bound:
            ports = ", ".join(map(str, sorted(bound)))
            fix = (
                f"set port = {bound[0]} for rank {node.rank}" if len(bound) == 1 else "fix its port"
            )
            return NodeFault(
                node.rank,
                f"{where} does not answer: its node process (pid {node.pid}) listens on "
                f"port {ports}, the file does not match the running nodes: {fix} in {path}, or "
                f"{restart_hint(path)}",
                ExitCode.USAGE,
            )
    if node.control_port and node.control_port != node.port:
        try:
            client.ping(node.control_endpoint, timeout=timeout)
        except (ControlError, OSError):
            pass
        else:
            return NodeFault(
                node.rank,
                f"{where} does not answer, but its node answers on its control port "
                f"{node.control_port}: the file's port does not match the running node: fix `port` "
                f"of rank {node.rank} in {path}, or {restart_hint(path)}",
                ExitCode.USAGE,
            )
    return NodeFault(
        node.rank,
        f"{where} does not answer PING: check it runs (`netdam ping --node "
        f"{node.address}:{node.port}`), or {restart_hint(path)}",
        ExitCode.RUN_FAILED,
    )


def _local(node: NodeEntry) -> bool:
    if node.address.startswith("127."):  # loopback needs no probe
        return True
    # Imported here: launch loads numba's compiled kernels (~0.7 s).
    from netdam.cluster.launch import is_local_address

    return is_local_address(node.address)


def _runs_node(pid: int) -> bool:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the
    # light commands need not pay for.
    from netdam.cluster.launch import is_node_process

    return is_node_process(pid)


def _bound_ports(pid: int) -> list[int]:
    """The UDP ports a local node process was started on: its command line's ``--bind`` or
    ``--nic RANK@IP:PORT[/SIZE]`` values (as launch.node_command and nics_command write them).
    Empty when unknown."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    ports = []
    for flag, value in zip(argv, argv[1:]):
        if flag in (b"--bind", b"--nic"):
            port = value.partition(b"/")[0].rpartition(b":")[2]
            if port.isdigit():
                ports.append(int(port))
    return ports
