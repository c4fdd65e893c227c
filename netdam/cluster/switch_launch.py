"""Start and stop the switch of a local cluster (``netdam up --switch``, tests, benchmarks).

The nodes must trust the switch (its VIP is in their ``members``) from the start, so the VIP is
chosen before the nodes: ``vip = pick_vip(); start_cluster(..., extra_members=(vip,));
start_switch(cluster, vip)``, or ``start_pool_cluster`` which does both. The switch adds a
``[switch]`` table to the cluster file::

    [switch]
    address = "127.0.0.1"
    port = 41234          # the VIP
    control_port = 41235  # management port (COUNTERS, PING, JOIN while the VIP is busy)
    pid = 12345
    state_file = "/path/c.pool.json"
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from netdam.cluster.launch import (
    ClusterStartError,
    LocalCluster,
    _wait_ready,
    netdam_python,
    start_cluster,
    stop_pids,
)
from netdam.protocol.packet import Endpoint
from netdam.switch.state import state_path_for


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


@dataclass
class SwitchHandle:
    """A running switch process."""

    entry: SwitchEntry
    process: subprocess.Popen[bytes]
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


def switch_command(cluster_path: Path, vip: Endpoint, state_file: Path, mtu: int, faults: str,
                   seed: int, die_with_parent: bool) -> list[str]:  # fmt: skip
    cmd = [*netdam_python("netdam.switch"), "--cluster", str(cluster_path),
           "--vip", f"{vip[0]}:{vip[1]}", "--state", str(state_file), "--mtu", str(mtu),
           "--seed", str(seed)]  # fmt: skip
    if faults:
        cmd += ["--faults", faults]
    if die_with_parent:
        cmd.append("--die-with-parent")
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
) -> SwitchHandle:
    """Start the switch of *cluster* on *vip* (which the nodes were started to trust), wait
    until it serves, and add ``[switch]`` to the cluster file."""
    state = state_file or state_path_for(cluster.path)
    log = switch_log(cluster.path)
    start = time.monotonic()
    cmd = switch_command(cluster.path, vip, state, cluster.info.mtu, faults, seed, not detach)
    from netdam import progress

    progress.status("starting the switch")
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=detach)
    try:
        [control_port] = _wait_ready([proc], [vip], [log])
    except ClusterStartError as exc:
        stop_pids([proc.pid], 3.0, processes=[proc])
        raise ClusterStartError(str(exc).replace("node rank 0", "switch")) from None
    except BaseException:
        stop_pids([proc.pid], 3.0, processes=[proc])
        raise
    entry = SwitchEntry(vip[0], vip[1], control_port, proc.pid, str(state))
    write_switch_entry(cluster.path, entry)
    return SwitchHandle(entry, proc, cluster.path, time.monotonic() - start)


def start_pool_cluster(nodes: int, *, faults: str = "", seed: int = 0, state_file: Path | None = None,
                       **cluster_kwargs: object) -> tuple[LocalCluster, SwitchHandle]:  # fmt: skip
    """Nodes that trust a VIP, then the switch on it: ``netdam up --switch`` in one call."""
    address = str(cluster_kwargs.get("address", "127.0.0.1"))
    vip = pick_vip(address)
    cluster = start_cluster(nodes, extra_members=(vip,), **cluster_kwargs)  # type: ignore[arg-type]
    try:
        handle = start_switch(cluster, vip, state_file=state_file, faults=faults, seed=seed,
                              detach=bool(cluster_kwargs.get("detach", False)))  # fmt: skip
    except BaseException:
        cluster.stop()
        raise
    return cluster, handle


_SECTION = re.compile(r"\n\[switch\]\n.*?(?=\n\[|\Z)", re.S)


def dump_switch_entry(entry: SwitchEntry) -> str:
    return (f'\n[switch]\naddress = "{entry.address}"\nport = {entry.port}\n'
            f"control_port = {entry.control_port}\npid = {entry.pid}\n"
            f'state_file = "{entry.state_file}"\n')  # fmt: skip


def write_switch_entry(cluster_path: Path, entry: SwitchEntry) -> None:
    """Replace (or add) the ``[switch]`` table of a cluster file, atomically."""
    text = _SECTION.sub("", cluster_path.read_text()).rstrip("\n") + "\n"
    tmp = cluster_path.with_suffix(cluster_path.suffix + ".tmp")
    tmp.write_text(text + dump_switch_entry(entry))
    tmp.replace(cluster_path)


def load_switch_entry(cluster_path: Path) -> SwitchEntry | None:
    """The ``[switch]`` table of a cluster file, or None when it has no switch."""
    try:
        data = tomllib.loads(Path(cluster_path).read_text())
    except FileNotFoundError:
        raise ValueError(f"cluster file {cluster_path} not found: start a cluster with `netdam up --switch`") from None
    table = data.get("switch")
    if table is None:
        return None
    try:
        return SwitchEntry(str(table["address"]), int(table["port"]), int(table.get("control_port", 0)),
                           int(table.get("pid", 0)), str(table.get("state_file", "")))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"cluster file {cluster_path}: bad [switch] table: {exc}") from None


def require_switch(cluster_path: Path) -> SwitchEntry:
    entry = load_switch_entry(cluster_path)
    if entry is None:
        raise ValueError(f"cluster file {cluster_path} has no [switch]: start the cluster with "
                         "`netdam up --switch`")  # fmt: skip
    return entry


def stop_switch_from_file(cluster_path: Path, timeout: float = 5.0) -> SwitchEntry | None:
    """``netdam down`` for the switch: stop the pid its [switch] table names."""
    entry = load_switch_entry(cluster_path)
    if entry is not None and entry.pid:
        stop_pids([entry.pid], timeout)
        switch_log(cluster_path).unlink(missing_ok=True)
    return entry
