"""Rank, world size and rendezvous address from a launcher's environment (no I/O).

``netdam node`` under torchrun, OpenMPI's mpirun or Slurm's srun finds its rank and the world
size in the variables these launchers set, and the address of rank 0's rendezvous (see
``netdam.cluster.rendezvous``) in the launcher's master address or ours. The rules (also in
``netdam node --help``, ``LAUNCHER_HELP``):

Rank and world size: ``--rank``/``--world-size`` when given (each overrides its variable);
otherwise the first launcher found of torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
OpenMPI (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``) and
Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``). torchrun and OpenMPI values that
disagree are an error; Slurm's are ignored when either is set, since both launchers run inside
Slurm allocations (srun starting one torchrun per host, mpirun starting its daemons with srun).
A launcher with only one of its two variables set is an error.

Rendezvous address, host then port, each from the first source that has it:
host: ``--master HOST[:PORT]``, ``NETDAM_MASTER_ADDR``, ``MASTER_ADDR``, the first host of
``SLURM_JOB_NODELIST`` (plain lists ``a,b`` and one bracket range ``node[01-04]`` only);
port: ``--master``'s port, ``NETDAM_MASTER_PORT``, ``MASTER_PORT`` (+1 under torchrun, whose own
store holds ``MASTER_PORT``: ``TORCHELASTIC_USE_AGENT_STORE=True``), 20000 + SLURM_JOB_ID mod
10000 under Slurm, else 29544. mpirun sets no master address: pass ``--master`` or export
``NETDAM_MASTER_ADDR`` (``mpirun -x NETDAM_MASTER_ADDR``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Endpoint

#: Rendezvous port when no source gives one.
DEFAULT_RENDEZVOUS_PORT = 29544
#: A launched node's UDP port when --bind gives none: this + its local rank.
DEFAULT_NODE_BASE_PORT = 7744
#: --bind host meaning "the local address of the route to the master".
AUTO = "auto"


class LaunchError(NetdamError, ValueError):
    """The launcher's environment or the flags are inconsistent; the message names the fix."""


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets."""

    name: str
    rank: str
    size: str
    local_rank: str


TORCHRUN = Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK")
OPENMPI = Launcher(
    "OpenMPI mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"
)
SLURM = Launcher("Slurm srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
LAUNCHERS = (TORCHRUN, OPENMPI, SLURM)


@dataclass(frozen=True)
class LaunchSpec:
    """Who this node is in a launched job, and where rank 0's rendezvous listens."""

    rank: int
    world_size: int
    local_rank: int
    #: Where rank and world size came from, e.g. "torchrun (RANK, WORLD_SIZE)" or "--rank/--world-size".
    source: str
    #: (host, port) of rank 0's rendezvous; None only when world_size == 1.
    master: Endpoint | None
    master_source: str = ""


@dataclass(frozen=True)
class _Found:
    launcher: Launcher
    rank: int
    size: int
    local_rank: int

    @property
    def text(self) -> str:
        return f"{self.launcher.rank}={self.rank}, {self.launcher.size}={self.size} ({self.launcher.name})"


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not re.fullmatch(r"\d+", text):
        raise LaunchError(f"{name}={env[name]!r} is not a non-negative integer: fix or unset it")
    return int(text)


def _found(env: Mapping[str, str], launcher: Launcher) -> _Found | None:
    """The launcher's values when its variables are set; an error when only one of the two is."""
    has_rank, has_size = launcher.rank in env, launcher.size in env
    if not has_rank and not has_size:
        return None
    if has_rank != has_size:
        there, absent = (
            (launcher.rank, launcher.size) if has_rank else (launcher.size, launcher.rank)
        )
        raise LaunchError(
            f"{there} is set but {absent} is not ({launcher.name} sets both): set {absent}, "
            f"unset {there}, or pass --rank and --world-size"
        )
    local = _int_var(env, launcher.local_rank) if launcher.local_rank in env else 0
    return _Found(launcher, _int_var(env, launcher.rank), _int_var(env, launcher.size), local)


def detect_launcher(env: Mapping[str, str]) -> _Found | None:
    """The launcher whose variables decide (see the module doc), or None."""
    found = [f for f in (_found(env, launcher) for launcher in LAUNCHERS) if f is not None]
    outer = [f for f in found if f.launcher is not SLURM]
    if outer:
        found = outer  # srun around torchrun or mpirun: the inner launcher numbers the ranks
    if len(found) > 1 and (found[0].rank, found[0].size) != (found[1].rank, found[1].size):
        raise LaunchError(
            f"{found[0].text} disagrees with {found[1].text}: unset the variables of the "
            "launcher you are not using, or pass --rank and --world-size"
        )
    return found[0] if found else None


def wants_rendezvous(env: Mapping[str, str], master: str | None, members_given: bool) -> bool:
    """A node joins a rendezvous when no --members are given and a launcher's variables, --master
    or NETDAM_MASTER_ADDR are; otherwise it runs as before (MASTER_ADDR alone, often left set in
    a torch shell, does not count)."""
    if members_given:
        return False
    launcher_set = any(v in env for launcher in LAUNCHERS for v in (launcher.rank, launcher.size))
    return launcher_set or master is not None or "NETDAM_MASTER_ADDR" in env


def resolve_launch(
    env: Mapping[str, str], *, rank: int | None, world_size: int | None, master: str | None
) -> LaunchSpec:
    """Rank, world size, local rank and rendezvous address from flags and environment."""
    found = None if rank is not None and world_size is not None else detect_launcher(env)
    if found is None and (rank is None or world_size is None):
        raise LaunchError(
            "no rank and world size: run under torchrun, mpirun or srun, or pass --rank "
            "and --world-size (with --master HOST:PORT)"
        )
    final_rank = rank if rank is not None else found.rank  # type: ignore[union-attr]  # found is set whenever rank is None (checked above)
    final_world = world_size if world_size is not None else found.size  # type: ignore[union-attr]  # found is set whenever world_size is None (checked above)
    if final_world < 1 or not 0 <= final_rank < final_world:
        raise LaunchError(
            f"rank {final_rank} with world size {final_world}: need world size >= 1 and "
            f"0 <= rank < world size (check --rank/--world-size and the launcher's -n/-np)"
        )
    source = _source(found, rank, world_size)
    endpoint, master_source = resolve_master(env, master)
    if endpoint is None and final_world > 1:
        raise LaunchError(
            f"no rendezvous address for rank {final_rank} of {final_world} ({source}): pass "
            "--master HOST:PORT (rank 0's host) or export NETDAM_MASTER_ADDR=HOST and "
            "NETDAM_MASTER_PORT=PORT (with mpirun: -x NETDAM_MASTER_ADDR -x NETDAM_MASTER_PORT)"
        )
    local = found.local_rank if found is not None else 0
    return LaunchSpec(final_rank, final_world, local, source, endpoint, master_source)


def _source(found: _Found | None, rank: int | None, world_size: int | None) -> str:
    if found is None:
        return "--rank/--world-size"
    names = f"{found.launcher.name} ({found.launcher.rank}, {found.launcher.size})"
    if rank is None and world_size is None:
        return names
    return f"{names} and {'--rank' if rank is not None else '--world-size'}"


def parse_master(text: str) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:PORT`` (the --master flag)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, ""
    if not host or (port and (not port.isdigit() or not 0 < int(port) <= 65535)):
        raise LaunchError(f"--master {text!r}: write HOST or HOST:PORT, e.g. 10.0.0.1:29544")
    return host, int(port) if port else None


def _port_var(env: Mapping[str, str], name: str) -> int:
    value = _int_var(env, name)
    if not 0 < value <= 65535:
        raise LaunchError(f"{name}={value} is not a port: give 1..65535")
    return value


def resolve_master(env: Mapping[str, str], master: str | None) -> tuple[Endpoint | None, str]:
    """(host, port) of the rendezvous and where they came from; (None, "") when nothing names a host."""
    host, port = parse_master(master) if master is not None else (None, None)
    host_source = "--master" if host else ""
    port_source = "--master" if port else ""
    for var in ("NETDAM_MASTER_ADDR", "MASTER_ADDR"):
        if host is None and env.get(var):
            host, host_source = env[var], var
    if host is None:
        host = slurm_first_host(env)
        host_source = "SLURM_JOB_NODELIST" if host else ""
    if host is None:
        return None, ""
    if port is None:
        port, port_source = _master_port(env)
    return (host, port), f"{host_source}, port from {port_source}"


def _master_port(env: Mapping[str, str]) -> tuple[int, str]:
    if "NETDAM_MASTER_PORT" in env:
        return _port_var(env, "NETDAM_MASTER_PORT"), "NETDAM_MASTER_PORT"
    if "MASTER_PORT" in env:
        port = _port_var(env, "MASTER_PORT")
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return port + 1, "MASTER_PORT + 1 (torchrun's store holds MASTER_PORT)"
        return port, "MASTER_PORT"
    job = env.get("SLURM_JOB_ID", "")
    if job.isdigit() and ("SLURM_JOB_NODELIST" in env or "SLURM_NODELIST" in env):
        return 20000 + int(job) % 10000, "SLURM_JOB_ID (20000 + id mod 10000)"
    return DEFAULT_RENDEZVOUS_PORT, f"the default {DEFAULT_RENDEZVOUS_PORT}"


_NODELIST = re.compile(r"^([A-Za-z0-9._-]+?)(?:\[([0-9]+)[^\]]*\])?(?:,.*)?$")


def slurm_first_host(env: Mapping[str, str]) -> str | None:
    """The first host of SLURM_JOB_NODELIST (or SLURM_NODELIST) when the list is simple:
    ``a,b,c`` or ``prefix[01-04,07]`` with one bracket group ending the first item. Anything
    else raises, naming NETDAM_MASTER_ADDR as the fix."""
    text = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not text:
        return None
    first = re.split(r",(?![^\[]*\])", text.strip())[0]
    match = _NODELIST.match(first)
    if match is None or first.count("[") > 1 or (first.count("[") == 1 and not first.endswith("]")):
        raise LaunchError(
            f"SLURM_JOB_NODELIST={text!r} is not a simple list: export NETDAM_MASTER_ADDR="
            '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'
        )
    prefix, number = match.group(1), match.group(2)
    return prefix + (number or "")


def node_bind(bind: Endpoint | None, local_rank: int) -> Endpoint:
    """Where a launched node binds: --bind's host (``auto`` when not given: the local address of
    the route to the master), port = --bind's port (default 7744) + local rank; port 0: any
    free port."""
    host, port = bind if bind is not None else (AUTO, DEFAULT_NODE_BASE_PORT)
    if port == 0:
        return host, 0
    if port + local_rank > 65535:
        raise LaunchError(
            f"port {port} + local rank {local_rank} is over 65535: give a lower --bind port"
        )
    return host, port + local_rank


LAUNCHER_HELP = """\
launchers (no --members given, and a launcher's variables, --master or NETDAM_MASTER_ADDR set):
  the node binds its socket, reports (rank, address, port, control port, memory file) to rank
  0's rendezvous; rank 0 waits for all WORLD_SIZE ranks, answers everyone with the member list
  and writes --cluster FILE; then every node serves with those members and rank 0's admin key.

  rank and world size, first found:
    --rank / --world-size (each overrides its variable)
    torchrun:        RANK, WORLD_SIZE, LOCAL_RANK
    OpenMPI mpirun:  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
    Slurm srun:      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
  torchrun and OpenMPI values that disagree are an error; Slurm's are ignored when either is
  set (they run inside Slurm allocations). One of a launcher's two variables alone is an error.

  rendezvous host, first found: --master HOST[:PORT], NETDAM_MASTER_ADDR, MASTER_ADDR, the first
  host of SLURM_JOB_NODELIST (simple lists only: a,b or node[01-04]).
  port, first found: --master's, NETDAM_MASTER_PORT, MASTER_PORT (+1 under torchrun, whose store
  holds MASTER_PORT), 20000 + SLURM_JOB_ID mod 10000, else 29544. mpirun sets no master: use
  --master or mpirun -x NETDAM_MASTER_ADDR=HOST -x NETDAM_MASTER_PORT=PORT.

  node address: --bind HOST:PORT; HOST "auto" (the default) is the local address of the route
  to the rendezvous host; PORT (default 7744) + local rank, or 0 for any free port.

examples:
  torchrun --nproc-per-node 3 --no-python netdam node --bind auto:0 --cluster c.toml
  mpirun -np 3 netdam node --master 127.0.0.1:29544 --bind auto:0 --cluster c.toml
  srun -n 3 netdam node --cluster c.toml
"""
