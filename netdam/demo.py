"""``netdam demo``: the main job on what exists so far, checked against numpy.

It starts a local cluster of real node processes on loopback UDP and drives them only with wire
packets, from one host process:

1. a controller REGISTERs the same rkey on every node (admin key from the cluster file);
2. pool traffic: several clients WRITE random blocks, READ them back and FETCH_ADD a shared
   counter, each over its own UDP socket;
3. an all-reduce the NetDAM way (netdam.api): each rank's host stores its input into its
   node's memory through the shared mapping and sends START_COLL; then the NICs alone run a
   chained reduce-scatter (each block's packets travel the ring on the SR list, every hop adds
   its block in flight, only the owner stores) and a multicast all-gather, with loss recovery;
4. every rank's result is compared with a numpy reference summed in chain order, bitwise.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from netdam import counters as C
from netdam.allreduce_run import reference_chain_allreduce
from netdam.api import ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.control import ControlClient
from netdam.fpga_model import estimate_allreduce_seconds
from netdam.launch import LocalCluster, start_cluster
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    RIGHTS_ALL,
    DType,
    Opcode,
    ReduceOp,
    max_elements,
)
from netdam.protocol.packet import Packet


@dataclass(frozen=True)
class DemoConfig:
    nodes: int = 4
    count: int = 1 << 18  # elements per rank
    dtype: DType = DType.F32
    clients: int = 4
    pool_ops: int = 256
    seed: int = 1
    mtu: int = 9000
    timeout_s: float = 30.0


def run_demo(config: DemoConfig) -> dict[str, object]:
    """Run the demo; returns the summary (``ok`` says whether every check passed)."""
    if config.nodes < 2:
        raise ValueError("--nodes must be at least 2 for an all-reduce")
    nbytes = config.count * ELEMENT_SIZE[config.dtype]
    # Node memory: the pool area below, the host API's staging area in the upper half.
    pool_base = 0
    region = _round_up(64 + 64 * config.pool_ops, 4096)
    memory = max(16 << 20, _round_up(4 * nbytes, 1 << 20))
    with start_cluster(config.nodes, memory=memory, mtu=config.mtu) as cluster:
        rkey = _register_everywhere(cluster, region)
        pool = _pool_traffic(cluster, rkey, config, pool_base)
        allreduce = _allreduce(cluster, rkey, config)
        totals = np.zeros(C.NUM_COUNTERS, np.uint64)
        with ControlClient(admin_key=cluster.info.admin_key) as client:
            for ep in cluster.endpoints:
                totals += client.counters(ep)
        startup = cluster.startup_seconds
    return {
        "ok": bool(pool["ok"] and allreduce["ok"]),
        "transport": "node processes on loopback UDP",
        "nodes": config.nodes,
        "dtype": config.dtype.name.lower(),
        "bytes": nbytes,
        "startup_seconds": startup,
        "pool": pool,
        "allreduce": allreduce,
        "counters": {
            "rx_packets": int(totals[C.RX_PACKETS]),
            "forwarded": int(totals[C.FORWARDED]),
            "stored": int(totals[C.STORED]),
            "nacks": int(totals[C.NACK_BASE : C.NACK_BASE + C.NACK_SLOTS].sum()),
            "kernel_drops": int(totals[C.KERNEL_DROPS]),
            "bytes_combined": int(totals[C.BYTES_COMBINED]),
        },
    }


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


def _register_everywhere(cluster: LocalCluster, region: int) -> int:
    """REGISTER the same rkey on every node (the first node picks it)."""
    rkey = 0
    with ControlClient(admin_key=cluster.info.admin_key) as controller:
        for ep in cluster.endpoints:
            rkey = controller.register(ep, 0, region, RIGHTS_ALL, rkey=rkey)
    return rkey


def _pool_traffic(cluster: LocalCluster, rkey: int, config: DemoConfig, base: int) -> dict[str, object]:
    """Clients WRITE random blocks, READ them back, and FETCH_ADD one shared counter on node 0."""
    rng = np.random.default_rng(config.seed)
    clients = [ControlClient() for _ in range(config.clients)]
    endpoints = cluster.endpoints
    mismatches = 0
    start = time.perf_counter()
    try:
        for k in range(config.pool_ops):
            client = clients[k % len(clients)]
            node = endpoints[k % len(endpoints)]
            addr = base + 64 + 64 * (k // len(endpoints))
            data = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
            client.write(node, rkey, addr, data)
            if client.read(node, rkey, addr, 64) != data:
                mismatches += 1
            client.request(endpoints[0], Packet(Opcode.FETCH_ADD, rkey=rkey, addr=base, dtype=DType.U64,
                                                length=8, payload=struct.pack("<Q", 1)))  # fmt: skip
        counter = struct.unpack("<Q", clients[0].read(endpoints[0], rkey, base, 8))[0]
    finally:
        for client in clients:
            client.close()
    seconds = time.perf_counter() - start
    return {"ok": mismatches == 0 and counter == config.pool_ops, "ops": 3 * config.pool_ops,
            "ops_per_second": 3 * config.pool_ops / seconds, "mismatches": mismatches,
            "fetch_add_counter": counter, "fetch_add_expected": config.pool_ops}  # fmt: skip


def _allreduce(cluster: LocalCluster, rkey: int, config: DemoConfig) -> dict[str, object]:
    """All-reduce in the NICs: each rank's host stages its input and starts the collective on
    its node (START_COLL); the nodes chain, store, multicast and repair among themselves."""
    n = config.nodes
    esize = ELEMENT_SIZE[config.dtype]
    rng = np.random.default_rng(config.seed + 1)
    inputs = [_random_input(rng, config.count, config.dtype) for _ in range(n)]
    groups = [ProcessGroup(cluster.info, rank) for rank in range(n)]
    try:
        buffers = [x.copy() for x in inputs]
        start = time.perf_counter()
        works = [api_all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, groups, strict=True)]
        for work in works:
            assert work is not None
            work.wait()
        seconds = time.perf_counter() - start
        stats = [work.stats for work in works if work is not None]
    finally:
        for group in groups:
            group.close()
    expected = reference_chain_allreduce(inputs, ReduceOp.SUM)
    identical = all(b.tobytes() == buffers[0].tobytes() for b in buffers)
    exact = buffers[0].tobytes() == expected.tobytes()
    nbytes = config.count * esize
    return {
        "ok": identical and exact,
        "ranks_identical": identical,
        "equals_reference": exact,
        "elements_per_packet": max_elements(config.mtu, config.dtype, segments=n - 1),
        "seconds": seconds,
        "retransmits": sum(s.get("retransmits", 0) for s in stats),
        # What the same all-reduce would cost on 100G NetDAM cards (fpga_model), beside our time.
        "model_seconds_100g": estimate_allreduce_seconds(n, nbytes, link_gbps=100.0, dtype_bytes=esize),
    }


def _random_input(rng: np.random.Generator, count: int, dtype: DType) -> np.ndarray:
    np_dtype = np.dtype(NUMPY_DTYPE[dtype])
    if np_dtype.kind == "f":
        return rng.standard_normal(count).astype(np_dtype)
    return rng.integers(-1000, 1000, count).astype(np_dtype)
