"""``netdam bench allreduce``: the chain all-reduce against its peers, measured in the same run.

For every node count and size, in one run and on the same float32 tensor size:

- ``chain`` (always), ``chain-resident`` and ``ring-host``: :func:`netdam.tools.allreduce.run_allreduce`
  on real node processes over real UDP sockets (a private cluster per run, results checked
  bitwise). ``chain`` reduces plain numpy arrays and times their staging into node memory and
  back, as a user of ``netdam.all_reduce(x)`` sees it; ``chain-resident`` reduces arrays that
  live in NIC memory (``netdam.empty``), no staging;
- ``gloo``: N Python processes, ``torch.distributed.init_process_group("gloo",
  init_method="tcp://127.0.0.1:PORT")`` on CPU, timing ``dist.all_reduce``;
- ``mpi``: ``mpirun --oversubscribe -np N --mca btl tcp,self python -c ...`` with mpi4py's
  ``comm.Allreduce`` (``--allow-run-as-root`` added under root, BRIEF section 7): MPI over TCP
  loopback, the network path, as netdam and Gloo use it;
- ``mpi-shm``: the same without ``--mca btl``, so OpenMPI takes its shared-memory transport
  between ranks of one host, as MPI users run it there: no network at all, the fastest peer
  on one machine.

Every algorithm does ``warmup`` untimed full-size calls, then ``repeat`` timed ones (by default
100 up to 64 KiB, 20 up to 4 MiB, 5 above: enough calls for a p99 where calls are cheap); the
peers run as a plain script runs them: back-to-back calls on one tensor, a call ending when
its last rank returns (:func:`call_times`) (``seconds_median_barrier`` adds the same calls each after a barrier
on fresh data, the start-aligned way chain is timed). Rows carry the median, p50 and p99
(nearest rank) of the calls. ``ratio_vs_chain`` is the
algorithm's median seconds over chain's median seconds (same nodes, same size);
``model_seconds_100g`` is the cycle model's estimate of the same job on 100G cards (NetDAM chain
for ``chain``, a RoCE ring for the others): a field of the measured row, never a row of its own.
``chain-emu`` (and ``chain-resident-emu``) is the chain again at the emulation MTU (65000 unless
``--emulation-mtu`` says otherwise; SPEC.md 2.7), where a rank's block spans more than one wire
payload: the same job in fewer, larger datagrams on loopback, its model still at the wire's MTU.
A peer that is not installed lands in ``skipped`` with the command that installs it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import util
from pathlib import Path
from typing import Any

from netdam.fpga_model import default_params, estimate_allreduce_seconds
from netdam.protocol.constants import DEFAULT_MTU, largest_payload
from netdam.tools import plot as plotting
from netdam.tools.bench import report
from netdam.tools.bench.report import package_version
from netdam.units import format_size

#: Every algorithm a row can carry, in the order tables and plots list them.
ALGOS = (
    "chain",
    "chain-emu",
    "chain-resident",
    "chain-resident-emu",
    "ring-host",
    "gloo",
    "mpi",
    "mpi-shm",
)
#: Algorithms ``--vs`` accepts (chain always runs).
PEERS = ("chain-resident", "ring-host", "gloo", "mpi", "mpi-shm")
#: The MPI rows: transport of each (mpirun_command).
MPI_TRANSPORTS = {"mpi": "tcp", "mpi-shm": "shared memory"}
#: The algorithms this project runs on node processes (results checked bitwise).
NETDAM_ALGOS = ("chain", "chain-emu", "chain-resident", "chain-resident-emu", "ring-host")
#: The rows at the emulation MTU (AllReduceBenchConfig.emulation_mtu), each beside the row at
#: the wire's MTU it repeats: the same job in fewer, larger datagrams on loopback (SPEC.md 2.7).
EMULATED = {"chain": "chain-emu", "chain-resident": "chain-resident-emu"}
#: Each emulation row's row at the wire's MTU.
EMULATED_FROM = {emu: base for base, emu in EMULATED.items()}
#: The emulation MTU the bench runs them at unless told otherwise: 60 KiB payloads.
DEFAULT_EMULATION_MTU = 65000
DTYPE = "f32"
ELEMENT_BYTES = 4
MAX_NODES = 64
#: Printed by the peer scripts in front of their one JSON line.
RESULT_TAG = "NETDAM_BENCH_RESULT "
#: netdam is not on the package index: 'netdam[bench]' installs nothing from there, the
#: checkout's extra does.
INSTALL_BENCH = "from a netdam checkout: pip install '.[bench]'"
INSTALL_MPI = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
#: Cycle-model algorithm behind each row's model_seconds_100g.
MODEL_ALGO = {
    "chain": "netdam-chain",
    "chain-emu": "netdam-chain",
    "chain-resident": "netdam-chain",
    "chain-resident-emu": "netdam-chain",
    "ring-host": "roce-ring",
    "gloo": "roce-ring",
    "mpi": "roce-ring",
    "mpi-shm": "roce-ring",
}


@dataclass(frozen=True)
class AllReduceBenchConfig:
    nodes: tuple[int, ...] = (4,)
    sizes: tuple[int, ...] = (64 << 20,)
    peers: tuple[str, ...] = PEERS
    #: Timed calls per row; None: auto_repeat(size).
    repeat: int | None = None
    warmup: int = 1
    #: Wall-clock limit of one peer run (gloo or mpi), start-up included.
    timeout_s: float = 600.0
    plot: Path | None = None
    progress: bool = True
    #: Also run chain (and chain-resident) at this MTU, as chain-emu rows, where a block spans
    #: more than one wire payload (emulation_changes_datagrams); 0: not at all.
    emulation_mtu: int = DEFAULT_EMULATION_MTU
    #: NICs each node process of the netdam rows' clusters hosts (None: one process per core,
    #: the default of `netdam up`); on 2 cores one process of every NIC leaves a core to the
    #: hosts, quicker at small sizes and slower at large ones (docs/PERFORMANCE.md).
    nics_per_process: int | None = None
    #: Times every row of a (nodes, size) runs, the rows taking turns (chain, its peers, chain,
    #: ...): a row's calls are pooled over its rounds, so a spell of this machine's slow speed
    #: (docs/PERFORMANCE.md, "Runs that take twice as long") falls on every row alike.
    rounds: int = 1


#: Counters a row sums over its rounds (the rest of a runner's extras are its last round's).
_SUMMED_OVER_ROUNDS = ("retransmits", "kernel_drops", "packets", "wire_bytes")


@dataclass
class _Outcome:
    """One (algo, nodes, size) run: per-repeat seconds or an error."""

    times: list[float] = field(default_factory=list)
    ok: bool | None = None
    error: str | None = None
    startup_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- argument parsing


def parse_peers(text: str) -> tuple[str, ...]:
    """``gloo,mpi,ring-host`` -> the peers in canonical order; ``none`` or empty -> ()."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names in ([], ["none"]):
        return ()
    unknown = [n for n in names if n not in (*PEERS, "chain")]
    if unknown:
        raise ValueError(
            f"unknown peer {unknown[0]!r} in --vs {text!r}: choose from {', '.join(PEERS)} "
            "(comma-separated, or none; chain always runs)"
        )
    return tuple(p for p in PEERS if p in names)


def parse_nodes(text: str) -> tuple[int, ...]:
    """``4`` or ``2,4,8`` -> node counts, each 2..64, sorted and without duplicates."""
    values: list[int] = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ValueError(
                f"invalid --nodes {text!r}: give a node count or a comma-separated list (e.g. 2,4,8)"
            ) from None
        if not 2 <= value <= MAX_NODES:
            raise ValueError(f"invalid --nodes {text!r}: every node count must be 2..{MAX_NODES}")
        values.append(value)
    return tuple(sorted(set(values)))


def auto_repeat(nbytes: int) -> int:
    """Timed calls per row when --repeat is not given: 100 up to 64 KiB (a p99 of 100 calls),
    20 up to 4 MiB, 5 above (a 64 MiB call takes ~0.1-0.3 s here)."""
    if nbytes <= 64 << 10:
        return 100
    return 20 if nbytes <= 4 << 20 else 5


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): the smallest value with q% of the calls at or
    under it; with fewer than 100 calls p99 is the slowest call."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    for size in sizes:
        if size < ELEMENT_BYTES or size % ELEMENT_BYTES:
            raise ValueError(
                f"invalid size {size} B: give a positive multiple of {ELEMENT_BYTES} bytes "
                f"({DTYPE} elements), e.g. 64KiB"
            )
    return tuple(sorted(set(sizes)))


# ---------------------------------------------------------------- peers: availability


def gloo_unavailable() -> str | None:
    """Why the Gloo peer cannot run here, or None."""
    if util.find_spec("torch") is None:
        return f"torch not installed: pip install torch==2.13.0 (the CPU build here), or {INSTALL_BENCH}"
    return None


def mpi_unavailable() -> str | None:
    """Why the MPI peer cannot run here, or None."""
    if shutil.which("mpirun") is None:
        return f"mpirun not found: {INSTALL_MPI}"
    if util.find_spec("mpi4py") is None:
        return f"mpi4py not installed: pip install mpi4py (after apt-get install libopenmpi-dev) or {INSTALL_BENCH}"
    return None


def _mpi_library_version() -> str | None:
    exe = shutil.which("mpirun")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[:1]
    return line[0] if line else None


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: cores, kernel and every version that matters."""
    return {
        **report.machine_info(),
        "torch": package_version("torch"),
        "mpi4py": package_version("mpi4py"),
        "mpi": _mpi_library_version(),
        "netdam": package_version("netdam"),
    }


# ---------------------------------------------------------------- peers: processes

_GLOO_SCRIPT = r"""
import datetime, json, sys, time, zlib
t0 = time.perf_counter()
import torch
import torch.distributed as dist
rank, world, port, count, warmup, repeat = map(int, sys.argv[1:7])
timeout = float(sys.argv[7])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=timeout))
src = torch.rand(count, dtype=torch.float32, generator=torch.Generator().manual_seed(rank))
buf = torch.empty_like(src)
dist.barrier()
init = time.perf_counter() - t0
# 1. As a plain training script calls it: back to back on one tensor, no barrier between
#    calls. The tensor holds zeros so repeated sums stay finite (Gloo adds every element
#    whatever its value).
buf.zero_()
for _ in range(warmup):
    dist.all_reduce(buf)
dist.barrier()
# CLOCK_MONOTONIC is one clock for every process on the machine: the parent lines the ranks up.
ends = [time.monotonic()]
for _ in range(repeat):
    dist.all_reduce(buf)
    ends.append(time.monotonic())
# 2. Each call on fresh data after a barrier (the start-aligned way chain is timed).
barrier_times = []
for _ in range(repeat):
    buf.copy_(src)
    dist.barrier()
    t = time.perf_counter()
    dist.all_reduce(buf)
    barrier_times.append(time.perf_counter() - t)
crc = zlib.crc32(buf.numpy().tobytes())
dist.barrier()
dist.destroy_process_group()
print(TAG + json.dumps({"rank": rank, "ends": ends, "barrier_times": barrier_times,
                        "init_seconds": init, "crc": crc, "torch": torch.__version__}), flush=True)
"""

_MPI_SCRIPT = r"""
import json, sys, time, zlib
t0 = time.perf_counter()
from mpi4py import MPI
import numpy as np
comm = MPI.COMM_WORLD
count, warmup, repeat = map(int, sys.argv[1:4])
src = np.random.default_rng(comm.rank).random(count, dtype=np.float32)
buf = np.zeros_like(src)
comm.Barrier()
init = time.perf_counter() - t0
# 1. Back to back on one buffer of zeros (sums stay finite), as an application calls it.
for _ in range(warmup):
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
comm.Barrier()
ends = [time.monotonic()]
for _ in range(repeat):
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    ends.append(time.monotonic())
# 2. Each call on fresh data after a barrier.
barrier_times = []
for _ in range(repeat):
    buf[:] = src
    comm.Barrier()
    t = time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    barrier_times.append(time.perf_counter() - t)
crc = zlib.crc32(buf.tobytes())
rows = comm.gather((ends, barrier_times, init, crc), root=0)
if comm.rank == 0:
    print(TAG + json.dumps({"ends": [r[0] for r in rows],
                            "barrier_times": [max(r[1][i] for r in rows) for i in range(repeat)],
                            "init_seconds": max(r[2] for r in rows),
                            "ranks_identical": len({r[3] for r in rows}) == 1,
                            "library": MPI.Get_library_version().splitlines()[0]}), flush=True)
"""


def _script(body: str) -> str:
    return f"TAG = {RESULT_TAG!r}\n{body}"


def call_times(ends: Sequence[Sequence[float]]) -> list[float]:
    """Per-call seconds of back-to-back calls from every rank's timestamps (``ends[r][0]`` the
    loop's start, ``ends[r][i]`` the end of call i, one system-wide monotonic clock): call i
    ends when its last rank returns, so it lasts max_r ends[r][i] - max_r ends[r][i-1]. The
    calls add up to the loop's wall time, as a plain script's total / calls does."""
    done = [max(float(e[i]) for e in ends) for i in range(len(ends[0]))]
    return [done[i] - done[i - 1] for i in range(1, len(done))]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(proc: subprocess.Popen[str], grace: float = 3.0) -> None:
    """SIGTERM the process group *proc* leads, then SIGKILL it if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            # The leader is gone; members of its group may still live: one SIGKILL for them.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def _tagged(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            value = json.loads(line[len(RESULT_TAG) :])
            return value if isinstance(value, dict) else None
    return None


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)


def run_gloo(
    nodes: int, count: int, warmup: int, repeat: int, timeout_s: float, ranks: int | None = None
) -> _Outcome:
    """N processes on 127.0.0.1, one rank each, as torch.distributed users start them.

    *ranks* starts only the first ranks of the group (tests: a group that never completes)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="netdam-gloo-") as tmp:
        port = _free_port()
        procs: list[subprocess.Popen[str]] = []
        files = []
        try:
            # Each rank's own Gloo timeout comes 60 s after ours: this process's wall-clock
            # limit decides, and kills every rank's process group when it passes.
            for rank in range(nodes if ranks is None else ranks):
                out = open(Path(tmp) / f"rank{rank}.out", "w+")
                files.append(out)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            _script(_GLOO_SCRIPT),
                            str(rank),
                            str(nodes),
                            str(port),
                            str(count),
                            str(warmup),
                            str(repeat),
                            str(timeout_s + 60.0),
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        start_new_session=True,
                    )
                )
            deadline = start + timeout_s
            failed: int | None = None
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    return _Outcome(error=f"gloo timed out after {timeout_s:g} s (raise --timeout)")
                bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                time.sleep(0.05)
            if failed is None:
                failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
            if failed is not None:
                files[failed].seek(0)
                text = files[failed].read()
                code = procs[failed].returncode
                return _Outcome(error=f"gloo rank {failed} exited with {code}: {_tail(text)}")
            reports = []
            for rank, out in enumerate(files):
                out.seek(0)
                text = out.read()
                report = _tagged(text)
                if report is None:
                    return _Outcome(error=f"gloo rank {rank} printed no result: {_tail(text)}")
                reports.append(report)
        finally:  # also on KeyboardInterrupt: no rank outlives the run
            for proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
            for out in files:
                out.close()
    times = call_times([r["ends"] for r in reports])
    barrier_times = [max(r["barrier_times"][i] for r in reports) for i in range(repeat)]
    identical = len({r["crc"] for r in reports}) == 1
    init = max(float(r["init_seconds"]) for r in reports)
    return _Outcome(
        times=times,
        ok=identical,
        startup_seconds=init,
        extra={
            "ranks_identical": identical,
            "backend": f"gloo (torch {reports[0]['torch']}, TCP)",
            "seconds_median_barrier": _median(barrier_times),
        },
    )


def mpirun_command(nodes: int, transport: str = "tcp") -> list[str]:
    """The mpirun command line (without the program), root handled per BRIEF section 7: over
    TCP loopback (``--mca btl tcp,self``), or ("shared memory") with OpenMPI's own choice,
    which between ranks of one host is its shared-memory transport."""
    cmd = [shutil.which("mpirun") or "mpirun", "--oversubscribe", "-np", str(nodes)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return [*cmd, "--mca", "btl", "tcp,self"] if transport == "tcp" else cmd


def run_mpi(
    nodes: int, count: int, warmup: int, repeat: int, timeout_s: float, transport: str = "tcp"
) -> _Outcome:
    """``mpirun -np N python -c <mpi4py script>``, as MPI users start it."""
    cmd = [
        *mpirun_command(nodes, transport),
        sys.executable,
        "-c",
        _script(_MPI_SCRIPT),
        str(count),
        str(warmup),
        str(repeat),
    ]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)  # mpirun and the ranks it started share its process group
            return _Outcome(error=f"mpi timed out after {timeout_s:g} s (raise --timeout)")
        except BaseException:
            _kill_group(proc)
            raise
        out.seek(0)
        text = out.read()
    report = _tagged(text)
    if proc.returncode != 0 or report is None:
        return _Outcome(error=f"mpirun exited with {proc.returncode}: {_tail(text)}")
    return _Outcome(
        times=call_times(report["ends"]),
        ok=bool(report["ranks_identical"]),
        startup_seconds=float(report["init_seconds"]),
        extra={
            "ranks_identical": report["ranks_identical"],
            "backend": f"{report['library']} ({transport})",
            "seconds_median_barrier": _median([float(t) for t in report["barrier_times"]]),
            "command": " ".join(cmd[: cmd.index(sys.executable)]) + " python -c ...",
        },
    )


def run_netdam(
    algo: str,
    nodes: int,
    count: int,
    warmup: int,
    repeat: int,
    mtu: int = DEFAULT_MTU,
    nics_per_process: int | None = None,
) -> _Outcome:
    """chain, chain-resident or ring-host on a private cluster of real node processes at *mtu*
    (*nics_per_process* NICs a process; None: the default placement), results checked
    bitwise."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.tools.allreduce import AllReduceConfig, run_allreduce

    res = run_allreduce(
        AllReduceConfig(
            nodes=nodes,
            count=count,
            algo="chain" if algo == "chain-resident" else algo,
            repeat=warmup + repeat,
            resident=algo == "chain-resident",
            mtu=mtu,
            nics_per_process=nics_per_process,
        )
    )
    all_times = res.get("seconds_all")
    startup = res.get("startup_seconds")
    outcome = _Outcome(
        startup_seconds=float(startup) if isinstance(startup, (int, float)) else None
    )
    if not isinstance(all_times, list) or len(all_times) < warmup + repeat:
        outcome.error = str(res.get("error") or f"{algo} returned no timings")
        return outcome
    outcome.times = [float(t) for t in all_times[warmup:]]
    outcome.ok = bool(res.get("ok"))
    if not outcome.ok:
        outcome.error = str(res.get("error") or "result differs from the reference")
    outcome.extra = {
        k: res.get(k)
        for k in (
            "retransmits",
            "kernel_drops",
            "packets",
            "wire_bytes",
            "phases",
            "host_overhead_us",
        )
        if k in res
    }
    return outcome


# ---------------------------------------------------------------- the run


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def model_seconds(algo: str, nodes: int, nbytes: int, model: str | None = None) -> float | None:
    try:
        return float(
            estimate_allreduce_seconds(
                nodes, nbytes, 100.0, model or MODEL_ALGO[algo], ELEMENT_BYTES
            )
        )
    except ValueError:
        return None


def make_row(algo: str, nodes: int, nbytes: int, repeat: int, outcome: _Outcome) -> dict[str, Any]:
    row: dict[str, Any] = {
        "algo": algo,
        "nodes": nodes,
        "bytes": nbytes,
        "dtype": DTYPE,
        "repeat": repeat,
        "seconds_median": None,
        "seconds_p50": None,
        "seconds_p99": None,
        "seconds_min": None,
        "seconds_max": None,
        "algbw_gbps": None,
        "busbw_gbps": None,
        "ratio_vs_chain": None,
        "model_seconds_100g": model_seconds(algo, nodes, nbytes),
        "model_algo": MODEL_ALGO[algo],
        # Both RoCE estimates: the host-library model and the hardware bound of a ring.
        "model_seconds_100g_roce_ring": model_seconds(algo, nodes, nbytes, "roce-ring"),
        "model_seconds_100g_roce_ideal": model_seconds(algo, nodes, nbytes, "roce-ideal"),
        "ok": outcome.ok,
        "startup_seconds": outcome.startup_seconds,
    }
    if outcome.times:
        median = _median(outcome.times)
        algbw = nbytes * 8 / median / 1e9
        row.update(
            seconds_median=median,
            seconds_p50=percentile(outcome.times, 50),
            seconds_p99=percentile(outcome.times, 99),
            seconds_min=min(outcome.times),
            seconds_max=max(outcome.times),
            seconds_all=outcome.times,
            algbw_gbps=algbw,
            busbw_gbps=algbw * 2 * (nodes - 1) / nodes,
        )
    row.update(outcome.extra)
    if outcome.error is not None:
        row["error"] = outcome.error
    return row


Runner = Callable[[str, int, int, int, int, float], _Outcome]


def pooled(outcomes: Sequence[_Outcome]) -> _Outcome:
    """One row's rounds as one outcome: every round's timed calls, wrong if any round was
    wrong, the first error, the counters of _SUMMED_OVER_ROUNDS summed, and each round's
    median (``round_medians``) so a reader sees whether the rounds agreed."""
    if len(outcomes) == 1:
        return outcomes[0]
    oks = [o.ok for o in outcomes]
    extra = dict(outcomes[-1].extra)
    for key in _SUMMED_OVER_ROUNDS:
        values = [o.extra.get(key) for o in outcomes]
        if all(isinstance(v, int) for v in values):
            extra[key] = sum(values)  # type: ignore[arg-type]  # ints, checked just above
    extra["round_medians"] = [_median(o.times) if o.times else None for o in outcomes]
    return _Outcome(
        times=[t for o in outcomes for t in o.times],
        ok=False if False in oks else True if True in oks else None,
        error=next((o.error for o in outcomes if o.error is not None), None),
        startup_seconds=outcomes[0].startup_seconds,
        extra=extra,
    )


def _default_runner(
    algo: str,
    nodes: int,
    count: int,
    warmup: int,
    repeat: int,
    timeout_s: float,
    emulation_mtu: int = DEFAULT_EMULATION_MTU,
    nics_per_process: int | None = None,
) -> _Outcome:
    if algo == "gloo":
        return run_gloo(nodes, count, warmup, repeat, timeout_s)
    if algo in MPI_TRANSPORTS:
        return run_mpi(nodes, count, warmup, repeat, timeout_s, MPI_TRANSPORTS[algo])
    if algo in EMULATED_FROM:
        return run_netdam(
            EMULATED_FROM[algo], nodes, count, warmup, repeat, emulation_mtu, nics_per_process
        )
    return run_netdam(algo, nodes, count, warmup, repeat, nics_per_process=nics_per_process)


def emulation_changes_datagrams(nodes: int, nbytes: int) -> bool:
    """A rank's block is larger than one payload at the wire's MTU, so the emulation MTU sends
    fewer datagrams; at or below it both rows would run the same datagrams."""
    return bool(nbytes // nodes > largest_payload(DEFAULT_MTU))


def _progress(enabled: bool, text: str) -> None:
    if enabled:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _run_row(
    run: Runner,
    cfg: AllReduceBenchConfig,
    label: str,
    algo: str,
    nodes: int,
    nbytes: int,
    repeat: int,
) -> _Outcome:
    """One round of one row, its progress lines on stderr; a runner's exception becomes the
    row's error, so one bug never loses the other rows."""
    _progress(cfg.progress, f"{label} ...")
    t_run = time.monotonic()
    try:
        outcome = run(algo, nodes, nbytes // ELEMENT_BYTES, cfg.warmup, repeat, cfg.timeout_s)
    except Exception as exc:
        outcome = _Outcome(error=f"{type(exc).__name__}: {exc}")
    status = f"{_median(outcome.times):.4g} s median" if outcome.times else "FAILED"
    if outcome.error is not None:
        status += f" ({outcome.error})"
    _progress(cfg.progress, f"{label}: {status} [{time.monotonic() - t_run:.1f} s]")
    return outcome


def run_allreduce_bench(
    cfg: AllReduceBenchConfig, runner: Runner | None = None
) -> tuple[dict[str, Any], int]:
    """Run every (nodes, size, algo); return the result object and the exit code."""
    run = runner or functools.partial(
        _default_runner, emulation_mtu=cfg.emulation_mtu, nics_per_process=cfg.nics_per_process
    )
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.monotonic()
    skipped: list[dict[str, str]] = []
    algos = ["chain"]
    for peer in cfg.peers:
        check = mpi_unavailable if peer in MPI_TRANSPORTS else {"gloo": gloo_unavailable}.get(peer)
        reason = check() if check is not None else None
        if reason is None:
            algos.append(peer)
        else:
            skipped.append({"algo": peer, "reason": reason})
    if cfg.emulation_mtu:
        algos = [a for base in algos for a in (base, EMULATED.get(base)) if a is not None]
    results: list[dict[str, Any]] = []

    def runs_here(algo: str, nodes: int, nbytes: int) -> bool:
        return algo not in EMULATED_FROM or emulation_changes_datagrams(nodes, nbytes)

    total = cfg.rounds * sum(
        runs_here(a, n, b) for n in cfg.nodes for b in cfg.sizes for a in algos
    )
    done = 0
    for nodes in cfg.nodes:
        for nbytes in cfg.sizes:
            chain_median: float | None = None
            repeat = cfg.repeat if cfg.repeat is not None else auto_repeat(nbytes)
            here = [a for a in algos if runs_here(a, nodes, nbytes)]
            rounds: dict[str, list[_Outcome]] = {algo: [] for algo in here}
            for turn in range(cfg.rounds):
                for algo in here:
                    done += 1
                    label = f"[{done}/{total}] {algo} {nodes} nodes x {format_size(nbytes)} {DTYPE}"
                    if cfg.rounds > 1:
                        label += f", round {turn + 1}/{cfg.rounds}"
                    rounds[algo].append(_run_row(run, cfg, label, algo, nodes, nbytes, repeat))
            for algo in here:
                row = make_row(algo, nodes, nbytes, repeat, pooled(rounds[algo]))
                row["rounds"] = cfg.rounds
                row["mtu"] = (
                    cfg.emulation_mtu
                    if algo in EMULATED_FROM
                    else DEFAULT_MTU
                    if algo in NETDAM_ALGOS
                    else None  # a host library's TCP or shared memory: no NetDAM datagrams
                )
                if algo == "chain":
                    chain_median = row["seconds_median"]
                if row["seconds_median"] is not None and chain_median:
                    row["ratio_vs_chain"] = row["seconds_median"] / chain_median
                results.append(row)
    wrong = any(r["algo"] in NETDAM_ALGOS and r["ok"] is False for r in results)
    failed = any(r["seconds_median"] is None for r in results)
    code = 1 if wrong else 3 if failed else 0
    res: dict[str, Any] = {
        "ok": code == 0,
        "started_at": started.isoformat(timespec="seconds"),
        "seconds": time.monotonic() - t0,
        "nodes": list(cfg.nodes),
        "sizes": list(cfg.sizes),
        # The MTU of the chain rows, and of the -emu rows (null: none ran).
        "mtu": DEFAULT_MTU,
        "emulation_mtu": cfg.emulation_mtu or None,
        "nics_per_process": cfg.nics_per_process,
        # The cycle model's, for every row: it prices the wire's datagrams (SPEC.md 2.7).
        "model_mtu": default_params(100.0)[0].mtu,
        "dtype": DTYPE,
        "repeat": cfg.repeat,
        "rounds": cfg.rounds,
        "warmup": cfg.warmup,
        "results": results,
        "skipped": skipped,
        "targets": targets(results),
        "machine": machine_info(),
    }
    if wrong:
        res["error"] = (
            "a chain, chain-resident or ring-host result differs from the numpy reference"
        )
    elif failed:
        bad = next(r for r in results if r["seconds_median"] is None)
        res["error"] = (
            f"{bad['algo']} at {bad['nodes']} nodes x {bad['bytes']} B failed: {bad.get('error')}"
        )
    if cfg.plot is not None and results:
        write_plot(results, cfg.plot)
        res["plot"] = str(cfg.plot)
    return res, code


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, reported (never asserted): chain vs gloo at 4 x 64 MiB, scaling."""

    def median(algo: str, nodes: int, nbytes: int) -> float | None:
        for r in results:
            if (r["algo"], r["nodes"], r["bytes"]) == (algo, nodes, nbytes):
                return r["seconds_median"]  # type: ignore[no-any-return]  # JSON rows: a float here
        return None

    out: dict[str, Any] = {}
    gloo = median("gloo", 4, 64 << 20)
    chain = median("chain", 4, 64 << 20)
    out["gloo_over_chain_4x64MiB"] = None if gloo is None or chain is None else gloo / chain
    out["chain_not_slower_than_gloo_4x64MiB"] = (
        None if gloo is None or chain is None else chain <= gloo
    )
    sizes = sorted({r["bytes"] for r in results})
    if sizes:
        big = sizes[-1]

        def busbw(algo: str, nodes: int) -> float | None:
            s = median(algo, nodes, big)
            return None if s is None else big * 8 / s / 1e9 * 2 * (nodes - 1) / nodes

        c2, c8, g2, g8 = busbw("chain", 2), busbw("chain", 8), busbw("gloo", 2), busbw("gloo", 8)
        out["scaling_bytes"] = big
        out["chain_busbw_8_over_2"] = None if c2 is None or c8 is None else c8 / c2
        out["gloo_busbw_8_over_2"] = None if g2 is None or g8 is None else g8 / g2
    return out


# ---------------------------------------------------------------- output


def format_table(res: dict[str, Any]) -> str:
    head = (
        f"{'algo':<19}{'nodes':>6}{'size':>9}{'calls':>6}{'median s':>11}{'p50 s':>10}{'p99 s':>10}"
        f"{'min s':>10}{'busbw Gb/s':>12}{'vs chain':>10}{'model 100G s':>14}"
    )
    lines = [head, "-" * len(head)]

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in res["results"]:
        lines.append(
            f"{r['algo']:<19}{r['nodes']:>6}{format_size(r['bytes']):>9}"
            f"{r['repeat'] * r.get('rounds', 1):>6}"
            f"{num(r['seconds_median'], '.4g'):>11}{num(r['seconds_p50'], '.4g'):>10}"
            f"{num(r['seconds_p99'], '.4g'):>10}{num(r['seconds_min'], '.4g'):>10}{num(r['busbw_gbps'], '.2f'):>12}"
            f"{num(r['ratio_vs_chain'], '.2f'):>10}{num(r['model_seconds_100g'], '.2e'):>14}"
            + (f"  ERROR: {r['error']}" if "error" in r else "")
        )
    for s in res["skipped"]:
        lines.append(f"skipped {s['algo']}: {s['reason']}")
    if res.get("nics_per_process") is not None:
        lines.append(f"netdam rows: {res['nics_per_process']} NICs a node process")
    if res.get("rounds", 1) > 1:
        lines.append(
            f"{res['rounds']} rounds, the rows taking turns; each row's calls pooled "
            "(round_medians in --json)"
        )
    if "plot" in res:
        lines.append(f"plot: {res['plot']}")
    if "error" in res:
        lines.append(f"error: {res['error']}")
    return "\n".join(lines)


def plot_unavailable() -> str | None:
    if util.find_spec("matplotlib") is None:
        return plotting.PLOT_HINT
    return None


def _busbw_gbps(nbytes: int, seconds: float, nodes: int) -> float:
    """nccl-tests' busbw in 10^9 bits/s: algbw x 2(N-1)/N."""
    return nbytes * 8 / seconds / 1e9 * 2 * (nodes - 1) / nodes


#: The phases of a chain all-reduce call as run_allreduce times them (medians), in call order.
PHASES = (
    "stage_in",
    "start_skew",
    "collective",  # stands for the four node phases when a completion lacks them
    "reduce_scatter",
    "all_gather",
    "done",
    "completion",
    "copy_out",
)


def _phase_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Where a chain call's time goes, per size: each phase's share of the call, stacked (the
    largest node count that ran; phases are medians over the calls)."""
    nodes = max(r["nodes"] for r in rows)
    rows = sorted((r for r in rows if r["nodes"] == nodes), key=lambda r: r["bytes"])
    labels = [format_size(r["bytes"]) for r in rows]
    bottom = [0.0] * len(rows)
    totals = [sum(float(r["phases"].get(p, 0.0)) for p in PHASES) or 1.0 for r in rows]
    for k, phase in enumerate(PHASES):
        if not any(phase in r["phases"] for r in rows):
            continue  # "collective" only stands in where node phases are missing
        share = [100 * float(r["phases"].get(phase, 0.0)) / t for r, t in zip(rows, totals)]
        ax.bar(labels, share, bottom=bottom, label=phase.replace("_", " "), color=f"C{k}")
        bottom = [b + v for b, v in zip(bottom, share)]
    ax.set(
        ylabel="share of the call (%)",
        title=f"chain: where the time goes ({nodes} nodes)",
        ylim=(0, 100),
    )
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    """Time and busbw against size (log-log) and, when several node counts ran, busbw against
    nodes at the largest size. Colour: the algorithm; marker: the node count; measured solid,
    the 100G model dashed (drawn once per model: ring-host, gloo and mpi share roce-ring)."""
    plt = plotting.pyplot()
    node_counts = sorted({r["nodes"] for r in results})
    algos = [a for a in ALGOS if any(r["algo"] == a for r in results)]
    # Each model line in the colour of the first algorithm it models.
    modelled: dict[str, list[str]] = {}
    for algo in algos:
        modelled.setdefault(MODEL_ALGO[algo], []).append(algo)
    drawn_model = {group[0] for group in modelled.values()}
    several = len(node_counts) > 1
    phased = [r for r in results if r["algo"] == "chain" and isinstance(r.get("phases"), dict)]
    fig, axes = plotting.figure(plt, 1, (3 if several else 2) + bool(phased))

    def rows_of(algo: str, key: str, value: int, order: str) -> list[dict[str, Any]]:
        return sorted(
            (r for r in results if r["algo"] == algo and r[key] == value), key=lambda r: r[order]
        )

    for algo in algos:
        for k, nodes in enumerate(node_counts):
            rows = rows_of(algo, "nodes", nodes, "bytes")
            meas = [r for r in rows if r["seconds_median"] is not None]
            style = plotting.series_style(k, algo)
            axes[0].plot([r["bytes"] for r in meas], [r["seconds_median"] for r in meas], **style)
            axes[1].plot([r["bytes"] for r in meas], [r["busbw_gbps"] for r in meas], **style)
            model = [r for r in rows if r["model_seconds_100g"] is not None]
            if algo in drawn_model and model:
                style = plotting.series_style(k, algo, model=True)
                axes[0].plot(
                    [r["bytes"] for r in model], [r["model_seconds_100g"] for r in model], **style
                )
                axes[1].plot(
                    [r["bytes"] for r in model],
                    [_busbw_gbps(r["bytes"], r["model_seconds_100g"], nodes) for r in model],
                    **style,
                )
    for ax, ylabel, title in (
        (axes[0], "seconds (median)", "all-reduce time vs size"),
        (axes[1], "busbw (Gb/s)", "bus bandwidth vs size"),
    ):
        plotting.size_axis(ax, f"bytes per rank ({DTYPE})")
        ax.set_yscale("log")
        ax.set(ylabel=ylabel, title=title)
    if several:
        big = max(r["bytes"] for r in results)
        for algo in algos:
            rows = rows_of(algo, "bytes", big, "nodes")
            meas = [r for r in rows if r["busbw_gbps"] is not None]
            axes[2].plot(
                [r["nodes"] for r in meas],
                [r["busbw_gbps"] for r in meas],
                **plotting.series_style(0, algo),
            )
            model = [r for r in rows if r["model_seconds_100g"] is not None]
            if algo in drawn_model and model:
                axes[2].plot(
                    [r["nodes"] for r in model],
                    [_busbw_gbps(big, r["model_seconds_100g"], r["nodes"]) for r in model],
                    **plotting.series_style(0, algo, model=True),
                )
        plotting.nodes_axis(axes[2], node_counts)
        axes[2].set_yscale("log")
        axes[2].set(ylabel="busbw (Gb/s)", title=f"busbw vs nodes at {format_size(big)}")
    if phased:
        _phase_bars(axes[-1], phased)
    key = plotting.Key().colors(algos)
    if several:
        key.markers(f"{n} nodes" for n in node_counts)
    key.sources("measured", "model of 100G cards")
    models = "; ".join(f"{m} for {', '.join(group)}" for m, group in modelled.items())
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    nodes_text = "" if several else f", {node_counts[0]} nodes"
    path.parent.mkdir(parents=True, exist_ok=True)
    plotting.finish(
        fig,
        path,
        f"netdam bench allreduce{nodes_text}, {os.cpu_count()} cores, loopback, {stamp}\n"
        f"model (dashed, in the colour of the first algorithm it models): {models}",
        key,
    )
