"""``netdam allreduce``: one all-reduce on real node processes, checked against numpy.

One driver process plays every rank's host (as a launcher would start one host per rank): it
stages each rank's seeded input into its node's memory, starts the collective on every node,
waits for every completion, and compares every rank's result with a numpy reference summed in
chain order, bitwise. Counters come from the nodes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netdam import progress
from netdam.api import CollectiveError, ProcessGroup, Work
from netdam.api import all_reduce as api_all_reduce
from netdam.clients.ring_host import ring_all_reduce
from netdam.cluster.clusterfile import load_cluster
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import ClusterStartError, LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.fpga_model import estimate_allreduce_seconds
from netdam.protocol import counters as C
from netdam.protocol.constants import ELEMENT_SIZE, IP_UDP_OVERHEAD, NUMPY_DTYPE, DType, ReduceOp

#: Node memory for a private cluster: the API stages inputs in the upper half.
MIN_NODE_MEMORY = 16 << 20
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
    density: float = 1.0  # fraction of input elements kept non-zero (the rest exactly +0)
    #: Buffers in NIC memory (netdam.empty): no staging copy in or out (chain only).
    resident: bool = False


def reference_chain_allreduce(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Block j folds ranks j+1, j+2, ..., j (owner last), rounding after every hop."""
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    n, count = len(inputs), inputs[0].size
    out = np.empty_like(inputs[0])
    for j in range(n):
        lo, hi = j * count // n, (j + 1) * count // n
        acc = inputs[(j + 1) % n][lo:hi].copy()
        for k in range(2, n + 1):
            acc = ufunc(acc, inputs[(j + k) % n][lo:hi]).astype(acc.dtype)
        out[lo:hi] = acc
    return out


def _inputs(config: AllReduceConfig, world: int) -> list[np.ndarray]:
    rng = np.random.default_rng(config.seed)
    dtype = np.dtype(NUMPY_DTYPE[config.dtype])
    if dtype.kind == "f":
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


def _totals(cluster_info, client: ControlClient) -> np.ndarray:  # type: ignore[no-untyped-def]
    total = np.zeros(C.NUM_COUNTERS, np.uint64)
    for node in cluster_info.nodes:
        total += client.counters(node.control_endpoint)
    return total


def run_allreduce(config: AllReduceConfig) -> dict[str, object]:
    """Run it; the result dict follows BRIEF section 7 (``ok``, ``error``, ...)."""
    esize = ELEMENT_SIZE[config.dtype]
    nbytes = config.count * esize
    result: dict[str, object] = {
        "ok": False, "nodes": config.nodes, "bytes": nbytes, "dtype": config.dtype.name.lower(),
        "op": config.op.name.lower(), "algo": config.algo, "seconds": None, "startup_seconds": None,
        "algbw_gbps": None, "busbw_gbps": None, "packets": None, "retransmits": None,
        "kernel_drops": None, "wire_bytes": None, "model_seconds_100g": None,
    }  # fmt: skip
    if config.sparse:
        result.update(sparse=True, density=config.density, wire_bytes_dense=None,
                      wire_bytes_sparse=None, seconds_dense=None)  # fmt: skip
    cluster: LocalCluster | None = None
    start = time.monotonic()
    try:
        if config.cluster is not None:
            info = load_cluster(config.cluster)
        else:
            memory = max(MIN_NODE_MEMORY, 4 * nbytes + (1 << 20))
            cluster = start_cluster(config.nodes, memory=memory, faults=config.faults)
            info = cluster.info
        world = len(info.nodes)
        result["nodes"] = world
        timeout = config.timeout_s
        groups = [ProcessGroup(info, rank, timeout_s=timeout) for rank in range(world)]
        result["startup_seconds"] = time.monotonic() - start
        progress.status("warm-up all-reduce")
        _run_once(groups, [np.ones(1, np.float32) for _ in range(world)], ReduceOp.SUM)  # warm-up
        with ControlClient(admin_key=info.admin_key) as client:
            inputs = _inputs(config, world)
            expected = reference_chain_allreduce(inputs, config.op)
            if config.sparse:
                # The same inputs dense first: its wire bytes and time, held to the reference too.
                before = _totals(info, client)
                buffers = [x.copy() for x in inputs]
                seconds_dense = _run_once(groups, buffers, config.op)
                dense_ok = all(b.tobytes() == expected.tobytes() for b in buffers)
                dense_delta = _totals(info, client).astype(np.int64) - before.astype(np.int64)
                result.update(wire_bytes_dense=_wire_bytes(dense_delta), seconds_dense=seconds_dense,
                              retransmits_dense=int(dense_delta[C.RETRANSMITS]),
                              dense_equals_reference=dense_ok)  # fmt: skip
            before = _totals(info, client)
            times = []
            phase_times: dict[str, list[float]] = {}
            resident = config.resident
            threaded = nbytes >= THREADED_MIN_BYTES
            pool = ThreadPoolExecutor(world, thread_name_prefix="netdam-rank") if threaded else None
            held = [g.empty(x.shape, x.dtype) for g, x in zip(groups, inputs, strict=True)] if resident else None
            host_copy = host_packets = host_bytes = 0
            ok = True
            try:
                for index in range(config.repeat):
                    progress.status(f"all-reduce {index + 1}/{config.repeat}")
                    buffers = _buffers(groups, inputs, held)
                    if config.algo == "ring-host":
                        ring = ring_all_reduce(groups, buffers, config.op)
                        times.append(ring.seconds)
                        host_copy += ring.host_copy_bytes
                        host_packets += ring.packets
                        host_bytes += ring.payload_bytes
                    else:
                        seconds, phases = _timed_run(groups, buffers, config.op, config.sparse, pool)
                        times.append(seconds)
                        for key, value in phases.items():
                            phase_times.setdefault(key, []).append(value)
                    identical = all(b.tobytes() == buffers[0].tobytes() for b in buffers)
                    exact = buffers[0].tobytes() == expected.tobytes()
                    ok = ok and identical and exact
            finally:
                if pool is not None:
                    pool.shutdown()
            after = _totals(info, client)
        seconds = float(np.median(times))
        if phase_times:
            result["phases"] = {key: float(np.median(v)) for key, v in phase_times.items()}
        result["resident"] = resident
        result["threaded"] = threaded
        delta = after.astype(np.int64) - before.astype(np.int64)
        # Datagrams the nodes sent, plus (ring-host) the WRITEs the hosts sent through their NICs.
        packets = int(delta[C.TX_PACKETS]) + host_packets
        algbw = nbytes * 8 / seconds / 1e9
        result.update(
            ok=ok, ranks_identical=identical, equals_reference=exact, seconds=seconds,
            seconds_all=times, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (world - 1) / world,
            packets=packets, retransmits=int(delta[C.RETRANSMITS]),
            kernel_drops=int(after[C.KERNEL_DROPS]), wire_bytes=_wire_bytes(delta, host_packets, host_bytes),
            model_seconds_100g=estimate_allreduce_seconds(
                world, nbytes, 100.0, "netdam-chain" if config.algo == "chain" else "roce-ring", esize),
            host_copy_bytes=host_copy // config.repeat,
        )  # fmt: skip
        if config.sparse:
            result["wire_bytes_sparse"] = _wire_bytes(delta) // config.repeat  # per run, as the dense
            ok = ok and bool(result["dense_equals_reference"])
            result["ok"] = ok
        if not ok:
            result["error"] = "result differs from the numpy chain-order reference" if identical else "ranks differ"
        for group in groups:
            group.close()
    except CollectiveError as exc:
        result.update(error=str(exc), waiting_for=exc.waiting_for, exit_code=3)
    except (ClusterStartError, ControlError) as exc:
        result.update(error=str(exc), exit_code=3)
    finally:
        if cluster is not None:
            cluster.stop()
    return result


def _buffers(groups: list[ProcessGroup], inputs: list[np.ndarray], held: list[np.ndarray] | None) -> list[np.ndarray]:
    """Fresh copies of the inputs: plain numpy arrays, or each rank's NIC-memory array *held*
    (netdam.empty), refilled untimed (a resident user computes into it)."""
    if held is None:
        return [x.copy() for x in inputs]
    for buf, x in zip(held, inputs, strict=True):
        buf[...] = x
    return held


def _one_rank(group: ProcessGroup, buf: np.ndarray, op: ReduceOp, sparse: bool, t0: float) -> dict[str, float]:
    """One rank's host: all_reduce(buf) as its own process would call it; its phase times."""
    t_call = time.perf_counter()
    work = api_all_reduce(buf, op=op, group=group, async_op=True, sparse=sparse)
    assert work is not None
    work.wait()
    t_end = time.perf_counter()
    completed = work.completed_at if work.completed_at is not None else t_end
    return {"call": t_call - t0, "stage_in": work.stage_in_s, "sent": work.sent_at - t0,
            "completed": completed - t0, "copy_out": work.copy_out_s, "end": t_end - t0}  # fmt: skip


def _timed_run(groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp, sparse: bool,
               pool: ThreadPoolExecutor | None) -> tuple[float, dict[str, float]]:  # fmt: skip
    """One all-reduce on every rank: seconds from the first rank's call to the last rank's
    return, and host-side phases (seconds): ``stage_in`` (slowest rank's copy into node
    memory), ``start_skew`` (first to last START_COLL sent), ``collective`` (last START_COLL
    sent to last completion received: the NICs' work), ``copy_out`` (slowest rank's copy back)."""
    t0 = time.perf_counter()
    if pool is None:
        works: list[Work] = []
        calls: list[float] = []
        for group, buf in zip(groups, buffers, strict=True):
            calls.append(time.perf_counter() - t0)
            work = api_all_reduce(buf, op=op, group=group, async_op=True, sparse=sparse)
            assert work is not None
            works.append(work)
        ranks = []
        for work, t_call in zip(works, calls, strict=True):
            work.wait()
            t_end = time.perf_counter() - t0
            done = (work.completed_at - t0) if work.completed_at is not None else t_end
            ranks.append({"call": t_call, "stage_in": work.stage_in_s, "sent": work.sent_at - t0,
                          "completed": done, "copy_out": work.copy_out_s, "end": t_end})  # fmt: skip
    else:
        futures = [pool.submit(_one_rank, g, b, op, sparse, t0) for g, b in zip(groups, buffers, strict=True)]
        ranks = [f.result() for f in futures]
    seconds = max(r["end"] for r in ranks)
    phases = {
        "stage_in": max(r["stage_in"] for r in ranks),
        "start_skew": max(r["sent"] for r in ranks) - min(r["sent"] for r in ranks),
        "collective": max(r["completed"] for r in ranks) - max(r["sent"] for r in ranks),
        "copy_out": max(r["copy_out"] for r in ranks),
    }
    return seconds, phases


def _run_once(groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp, sparse: bool = False) -> float:
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
