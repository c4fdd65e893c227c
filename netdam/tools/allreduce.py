"""``netdam allreduce``: one all-reduce on real node processes, checked against numpy.

One driver process plays every rank's host (as a launcher would start one host per rank): it
stages each rank's seeded input into its node's memory, starts the collective on every node,
waits for every completion, and compares every rank's result with a numpy reference summed in
chain order, bitwise. Counters come from the nodes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netdam import progress
from netdam.api import GROUPS_STAGING_SHARE, ArenaInUseError, CollectiveError, ProcessGroup, Work
from netdam.api import all_reduce as api_all_reduce
from netdam.api import trace as api_trace
from netdam.clients.ring_host import RECEIVE_ALIGN as RING_ALIGN
from netdam.clients.ring_host import ring_all_reduce
from netdam.cluster.clusterfile import ClusterFile, load_cluster
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import ClusterStartError, LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.core.torus import torus_shape
from netdam.fpga_model import default_params, estimate_allreduce_seconds
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DEFAULT_MTU,
    ELEMENT_SIZE,
    IP_UDP_OVERHEAD,
    MAX_SEGMENTS,
    NUMPY_DTYPE,
    DType,
    ReduceOp,
)
from netdam.protocol.elements import BFLOAT16, bf16_combine, bf16_round, is_bf16
from netdam.protocol.payloads import NO_PHASE_US
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS

#: Node memory for a private cluster: the API stages inputs in the upper half.
MIN_NODE_MEMORY = 16 << 20


def node_memory_needed(nbytes: int, algo: str, torus: bool = False) -> int:
    """Node memory one rank needs for *nbytes* per rank on a running cluster: the host API's
    arena is half of node memory (the rest is left to other clients and the pool) and stages
    the buffer in the arena's upper half (api.ProcessGroup._stage); ring-host also lands the
    previous host's WRITEs there, past the buffer (clients/ring_host.py). A *torus* (past one
    chain's members) makes its rows' and columns' groups, and the default group then stages
    in its share of that half (api.GROUPS_STAGING_SHARE)."""
    if algo == "ring-host":
        return 4 * (-(-nbytes // RING_ALIGN) * RING_ALIGN + nbytes)
    if torus:
        num, den = GROUPS_STAGING_SHARE
        return -(-4 * nbytes * den // num)
    return 4 * nbytes


def private_node_memory(nbytes: int) -> int:
    """Node memory of a private cluster: room for the staged buffer, ring-host's receive area
    and --resident arrays (the lower half) alike."""
    return max(MIN_NODE_MEMORY, 4 * nbytes + (1 << 20))


#: From this many bytes per rank every rank's host runs in its own thread, as one process per
#: rank would (numpy's copies release the GIL, so stagings overlap); below it one thread starts
#: every rank in turn, cheaper than a thread hand-off (~50 us) when a call takes ~1-3 ms.
THREADED_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class AllReduceConfig:
    nodes: int = 4
    count: int = 1 << 20
    dtype: DType = DType.F32
    op: ReduceOp = ReduceOp.SUM
    faults: FaultSpec = FaultSpec()
    timeout_s: float | None = None
    cluster: Path | None = None
    seed: int = 0
    repeat: int = 1
    algo: str = "chain"
    sparse: bool = False  # sparse mode; the same inputs also run dense, both wire byte counts
    trace: Path | None = None  # a timeline of the timed runs (api.trace), written here
    density: float = 1.0  # fraction of input elements kept non-zero (the rest exactly +0)
    #: Buffers in NIC memory (netdam.empty): no staging copy in or out (chain only).
    resident: bool = False
    #: NICs per node process of a private cluster (None: one process per core).
    nics_per_process: int | None = None
    #: The longest chain (SPEC.md 4.2): past it the all-reduce runs as a torus of chains.
    max_chain: int = MAX_SEGMENTS
    #: IP MTU of a private cluster; above the wire's, an emulation MTU (SPEC.md 2.7): larger
    #: datagrams on loopback, while the cycle model stays at its wire MTU.
    mtu: int = DEFAULT_MTU
    #: Records of each NIC's trace ring in a private cluster (SPEC.md 6.7): `trace` reads them.
    trace_records: int = DEFAULT_TRACE_RECORDS


def _combiner(array: np.ndarray, op: ReduceOp) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """One hop's combine for *array*'s dtype, rounded to it (SPEC.md 2.4): numpy's ufunc, or the
    bf16 rule for bf16 bit patterns."""
    if is_bf16(array):
        return lambda acc, block: bf16_combine(acc, block, int(op)).view(BFLOAT16)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]

    def hop(acc: np.ndarray, block: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # overflow to infinity and NaNs are results, as in the NICs
            combined: np.ndarray = ufunc(acc, block).astype(acc.dtype)
        return combined

    return hop


def reference_chain_allreduce(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Block j folds ranks j+1, j+2, ..., j (owner last), rounding after every hop."""
    combine = _combiner(inputs[0], op)
    n, count = len(inputs), inputs[0].size
    out = np.empty_like(inputs[0])
    for j in range(n):
        lo, hi = j * count // n, (j + 1) * count // n
        acc = inputs[(j + 1) % n][lo:hi].copy()
        for k in range(2, n + 1):
            acc = combine(acc, inputs[(j + k) % n][lo:hi])
        out[lo:hi] = acc
    return out


def reference_torus_allreduce(
    inputs: list[np.ndarray], op: ReduceOp, max_chain: int = MAX_SEGMENTS
) -> np.ndarray:
    """The torus of chains past *max_chain* ranks (SPEC.md 4.2): each row's chain sum, then
    block c of the rows' sums added along column c in its chain order; a flat chain below."""
    world = len(inputs)
    if world <= max_chain:
        return reference_chain_allreduce(inputs, op)
    rows, size = torus_shape(world, max_chain)
    sums = [reference_chain_allreduce(inputs[r * size : (r + 1) * size], op) for r in range(rows)]
    count = inputs[0].size
    out = np.empty_like(inputs[0])
    for c in range(size):
        lo, hi = c * count // size, (c + 1) * count // size
        if hi > lo:
            out[lo:hi] = reference_chain_allreduce([x[lo:hi] for x in sums], op)
    return out


def _inputs(config: AllReduceConfig, world: int) -> list[np.ndarray]:
    rng = np.random.default_rng(config.seed)
    dtype = np.dtype(NUMPY_DTYPE[config.dtype])
    if config.dtype == DType.BF16:
        inputs = [
            bf16_round(rng.standard_normal(config.count).astype(np.float32)).view(BFLOAT16)
            for _ in range(world)
        ]
    elif dtype.kind == "f":
        inputs = [rng.standard_normal(config.count).astype(dtype) for _ in range(world)]
    else:
        inputs = [rng.integers(-1000, 1000, config.count).astype(dtype) for _ in range(world)]
    if config.density < 1.0:
        for x in inputs:
            x[rng.random(config.count) >= config.density] = 0
    return inputs


def _wire_bytes(delta: np.ndarray, host_packets: int = 0, host_bytes: int = 0) -> int:
    """Bytes on the wire: datagrams the nodes sent (plus hosts' WRITEs), with IP/UDP headers."""
    packets = int(delta[C.TX_PACKETS]) + host_packets
    return int(delta[C.TX_BYTES]) + host_bytes + int(IP_UDP_OVERHEAD) * packets


def _totals(cluster_info: ClusterFile, client: ControlClient) -> np.ndarray:
    total = np.zeros(C.NUM_COUNTERS, np.uint64)
    for node in cluster_info.nodes:
        total += client.counters(node.control_endpoint)
    return total


def run_allreduce(config: AllReduceConfig) -> dict[str, object]:
    """Run it; the result dict follows BRIEF section 7 (``ok``, ``error``, ...)."""
    esize = ELEMENT_SIZE[config.dtype]
    nbytes = config.count * esize
    result: dict[str, object] = {
        "ok": False,
        "nodes": config.nodes,
        "bytes": nbytes,
        "dtype": config.dtype.name.lower(),
        "op": config.op.name.lower(),
        "algo": config.algo,
        "seconds": None,
        "startup_seconds": None,
        "algbw_gbps": None,
        "busbw_gbps": None,
        "packets": None,
        "retransmits": None,
        "kernel_drops": None,
        "wire_bytes": None,
        "model_seconds_100g": None,
        # The cycle model prices the wire's datagrams, whatever MTU the emulation runs at.
        "model_mtu": default_params(100.0)[0].mtu,
        "mtu": None,
    }
    if config.sparse:
        result.update(
            sparse=True,
            density=config.density,
            wire_bytes_dense=None,
            wire_bytes_sparse=None,
            seconds_dense=None,
        )
    cluster: LocalCluster | None = None
    start = time.monotonic()
    try:
        if config.cluster is not None:
            info = load_cluster(config.cluster)
        else:
            cluster = start_cluster(
                config.nodes,
                memory=private_node_memory(nbytes),
                faults=config.faults,
                nics_per_process=config.nics_per_process,
                mtu=config.mtu,
                trace_records=config.trace_records,
            )
            info = cluster.info
        world = len(info.nodes)
        result["nodes"] = world
        result["mtu"] = info.mtu
        timeout = config.timeout_s
        # A private cluster is this run's alone: its groups take all of node memory.
        arena = None if cluster is None else info.nodes[0].memory_bytes
        groups = [
            ProcessGroup(
                info, rank, timeout_s=timeout, arena_bytes=arena, max_chain=config.max_chain
            )
            for rank in range(world)
        ]
        result["startup_seconds"] = time.monotonic() - start
        progress.status("warm-up all-reduce")
        _run_once(groups, [np.ones(1, np.float32) for _ in range(world)], ReduceOp.SUM)  # warm-up
        with ControlClient.for_cluster(info) as client:
            inputs = _inputs(config, world)
            expected = reference_torus_allreduce(inputs, config.op, config.max_chain)
            if config.sparse:
                # The same inputs dense first: its wire bytes and time, held to the reference too.
                before = _totals(info, client)
                buffers = [x.copy() for x in inputs]
                seconds_dense = _run_once(groups, buffers, config.op)
                dense_ok = all(b.tobytes() == expected.tobytes() for b in buffers)
                dense_delta = _totals(info, client).astype(np.int64) - before.astype(np.int64)
                result.update(
                    wire_bytes_dense=_wire_bytes(dense_delta),
                    seconds_dense=seconds_dense,
                    retransmits_dense=int(dense_delta[C.RETRANSMITS]),
                    dense_equals_reference=dense_ok,
                )
            before = _totals(info, client)
            times = []
            phase_times: dict[str, list[float]] = {}
            resident = config.resident
            # A torus's steps are started by each rank's progress thread (netdam.api.TorusWork):
            # a thread per rank on top of those only takes turns with them for the GIL.
            threaded = nbytes >= THREADED_MIN_BYTES and (
                world <= config.max_chain or config.algo != "chain"
            )
            pool = ThreadPoolExecutor(world, thread_name_prefix="netdam-rank") if threaded else None
            held = (
                [g.empty(x.shape, x.dtype) for g, x in zip(groups, inputs, strict=True)]
                if resident
                else None
            )
            host_copy = host_packets = host_bytes = host_ignored = 0
            host_overheads: list[tuple[float, float]] = []
            ok = True
            timeline = (
                api_trace(config.trace, groups[0])
                if config.trace is not None
                else contextlib.nullcontext()
            )
            try:
                with timeline as traced:
                    for index in range(config.repeat):
                        progress.status(f"all-reduce {index + 1}/{config.repeat}")
                        buffers = _buffers(groups, inputs, held)
                        if config.algo == "ring-host":
                            ring = ring_all_reduce(groups, buffers, config.op)
                            times.append(ring.seconds)
                            host_copy += ring.host_copy_bytes
                            host_packets += ring.packets
                            host_bytes += ring.payload_bytes
                            host_ignored += ring.ignored
                        else:
                            seconds, phases, overheads = _timed_run(
                                groups, buffers, config.op, config.sparse, pool
                            )
                            times.append(seconds)
                            host_overheads += overheads
                            for key, value in phases.items():
                                phase_times.setdefault(key, []).append(value)
                        identical = all(b.tobytes() == buffers[0].tobytes() for b in buffers)
                        exact = buffers[0].tobytes() == expected.tobytes()
                        ok = ok and identical and exact
            finally:
                if pool is not None:
                    pool.shutdown()
            after = _totals(info, client)
            if traced is not None:
                result["trace"] = {
                    "path": str(traced.path),
                    "records": traced.records,
                    "lost": traced.lost,
                }
        seconds = float(np.median(times))
        if phase_times:
            result["phases"] = {key: float(np.median(v)) for key, v in phase_times.items()}
        if host_overheads:
            # The API's own time per call and rank, medians, microseconds (issue 26 asks for
            # it): the call until its START_COLL left, and the completion until the return.
            issue, back = zip(*host_overheads, strict=True)
            result["host_overhead_us"] = {
                "issue": float(np.median(issue)) * 1e6,
                "return": float(np.median(back)) * 1e6,
            }
        result["resident"] = resident
        result["threaded"] = threaded
        if world > config.max_chain and config.algo == "chain":
            rows, size = torus_shape(world, config.max_chain)
            result["torus"] = {"rows": rows, "row_size": size}
        delta = after.astype(np.int64) - before.astype(np.int64)
        # Datagrams the nodes sent, plus (ring-host) the WRITEs the hosts sent through their NICs.
        packets = int(delta[C.TX_PACKETS]) + host_packets
        algbw = nbytes * 8 / seconds / 1e9
        result.update(
            ok=ok,
            ranks_identical=identical,
            equals_reference=exact,
            seconds=seconds,
            seconds_all=times,
            algbw_gbps=algbw,
            busbw_gbps=algbw * 2 * (world - 1) / world,
            packets=packets,
            retransmits=int(delta[C.RETRANSMITS]),
            kernel_drops=int(after[C.KERNEL_DROPS]),
            wire_bytes=_wire_bytes(delta, host_packets, host_bytes),
            model_seconds_100g=estimate_allreduce_seconds(
                world, nbytes, 100.0, _model_algo(config.algo, world, config.max_chain), esize
            ),
            host_copy_bytes=host_copy // config.repeat,
        )
        if config.algo == "ring-host":
            # Datagrams the ring's hosts dropped unread over every run: from no ACK-sending node
            # nor step-sending host of this ring (netdam.clients.ring_host).
            result["host_ignored_datagrams"] = host_ignored
        if config.sparse:
            result["wire_bytes_sparse"] = (
                _wire_bytes(delta) // config.repeat
            )  # per run, as the dense
            ok = ok and bool(result["dense_equals_reference"])
            result["ok"] = ok
        if not ok:
            result["error"] = (
                "result differs from the numpy chain-order reference"
                if identical
                else "ranks differ"
            )
        for group in groups:
            group.close()
    except CollectiveError as exc:
        result.update(error=str(exc), waiting_for=exc.waiting_for, exit_code=3)
    except (ClusterStartError, ControlError, ArenaInUseError) as exc:
        result.update(error=str(exc), exit_code=3)
    finally:
        if cluster is not None:
            cluster.stop()
    return result


def _model_algo(algo: str, world: int, max_chain: int) -> str:
    """The cycle model's name for the job: the chain, the torus of chains past one chain
    (fpga_model's netdam-chain-2d, rows of up to 64), or the RoCE ring."""
    if algo != "chain":
        return "roce-ring"
    return "netdam-chain-2d" if world > max_chain else "netdam-chain"


def _buffers(
    groups: list[ProcessGroup], inputs: list[np.ndarray], held: list[np.ndarray] | None
) -> list[np.ndarray]:
    """Fresh copies of the inputs: plain numpy arrays, or each rank's NIC-memory array *held*
    (netdam.empty), refilled untimed (a resident user computes into it)."""
    if held is None:
        return [x.copy() for x in inputs]
    for buf, x in zip(held, inputs, strict=True):
        buf[...] = x
    return held


def _one_rank(
    group: ProcessGroup, buf: np.ndarray, op: ReduceOp, sparse: bool
) -> tuple[Work, float]:
    """One rank's host: all_reduce(buf) as its own process would call it; (work, return time)."""
    work = api_all_reduce(buf, op=op, group=group, async_op=True, sparse=sparse)
    assert work is not None
    work.wait()
    return work, time.monotonic()


def _timed_run(
    groups: list[ProcessGroup],
    buffers: list[np.ndarray],
    op: ReduceOp,
    sparse: bool,
    pool: ThreadPoolExecutor | None,
) -> tuple[float, dict[str, float], list[tuple[float, float]]]:
    """One all-reduce on every rank: seconds from the first rank's call to the last rank's
    return, its phases (seconds, :func:`phases`), and each rank's host API overhead (seconds
    to issue, to return: ``Work.host_overhead``)."""
    t0 = time.monotonic()
    if pool is None:
        works: list[Work] = []
        for group, buf in zip(groups, buffers, strict=True):
            work = api_all_reduce(buf, op=op, group=group, async_op=True, sparse=sparse)
            assert work is not None
            works.append(work)
        done = []
        for work in works:
            work.wait()
            done.append((work, time.monotonic()))
    else:
        futures = [
            pool.submit(_one_rank, g, b, op, sparse) for g, b in zip(groups, buffers, strict=True)
        ]
        done = [f.result() for f in futures]
    overheads = [o for o in (w.host_overhead() for w, _ in done) if o is not None]
    return max(end for _, end in done) - t0, phases(done), overheads


def phases(done: list[tuple[Work, float]]) -> dict[str, float]:
    """Where one all-reduce's time went, from every rank's Work and return time (seconds; host
    and nodes share CLOCK_MONOTONIC on one machine):

    - ``stage_in``: the slowest rank's copy into node memory (0 for NIC-resident buffers);
    - ``start_skew``: first to last START_COLL sent;
    - ``reduce_scatter``: last START_COLL sent to the last node whose chains are all ACKed;
    - ``all_gather``: from there to the last node holding every chunk;
    - ``done``: from there to the last node holding every member's DONE;
    - ``completion``: from there to the last completion received by a host;
    - ``copy_out``: the slowest rank's copy back out.

    The node phases need every completion to carry them (SPEC.md 4.1); without, ``collective``
    (last START_COLL sent to last completion received) stands for the four."""
    works = [w for w, _ in done]
    sent = [w.sent_at for w in works]
    received = [w.completed_at if w.completed_at is not None else end for w, end in done]
    out = {"stage_in": max(w.stage_in_s for w in works), "start_skew": max(sent) - min(sent)}
    node = [w.node_phases for w in works]
    ended = [
        p
        for p in node
        if p is not None and NO_PHASE_US not in (p.chains_us, p.chunks_us, p.done_us)
    ]
    if len(ended) == len(works):
        chains = max(p.start_ns / 1e9 + p.chains_us / 1e6 for p in ended)
        chunks = max(p.start_ns / 1e9 + p.chunks_us / 1e6 for p in ended)
        dones = max(p.start_ns / 1e9 + p.done_us / 1e6 for p in ended)
        # Microsecond stamps on one clock, read in order: clamp rounding to zero, never negative.
        out["reduce_scatter"] = max(chains - max(sent), 0.0)
        out["all_gather"] = max(chunks - max(chains, max(sent)), 0.0)
        out["done"] = max(dones - max(chunks, chains, max(sent)), 0.0)
        out["completion"] = max(max(received) - max(dones, chunks, chains, max(sent)), 0.0)
    else:
        out["collective"] = max(received) - max(sent)
    out["copy_out"] = max(w.copy_out_s for w in works)
    return out


def _run_once(
    groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp, sparse: bool = False
) -> float:
    """Start the all-reduce on every rank (staging included), wait for all; seconds."""
    start = time.perf_counter()
    works: list[Work] = []
    for group, buf in zip(groups, buffers, strict=True):
        work = api_all_reduce(buf, op=op, group=group, async_op=True, sparse=sparse)
        assert work is not None
        works.append(work)
    for work in works:
        work.wait()
    return time.perf_counter() - start
