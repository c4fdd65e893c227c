"""``netdam demo``: the main job on what exists so far, checked against numpy.

It starts a local cluster of real node processes on loopback UDP and drives them only with wire
packets, from one host process:

1. the pool controller allocates a region interleaved over every node (8 KiB stride) behind the
   switch's virtual IP, registering each backing range on its node;
2. pool traffic through the VIP: several clients WRITE random blocks, READ them back
   (pipelined) and FETCH_ADD a shared counter;
3. an all-reduce the NetDAM way (netdam.api): each rank's host stores its input into its
   node's memory through the shared mapping and sends START_COLL; then the NICs alone run a
   chained reduce-scatter (each block's packets travel the ring on the SR list, every hop adds
   its block in flight, only the owner stores) and a multicast all-gather, with loss recovery;
4. every rank's result is compared with a numpy reference summed in chain order, bitwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from netdam import progress
from netdam.api import ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.clients.pool import PoolClient, tag_keys_of
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.fpga_model import estimate_allreduce_seconds
from netdam.protocol import counters as C
from netdam.protocol.constants import ELEMENT_SIZE, NUMPY_DTYPE, DType, ReduceOp, max_elements
from netdam.protocol.payloads import unpack_u64
from netdam.switch.controller import PoolController
from netdam.tools.allreduce import reference_chain_allreduce

#: Interleave stride of the demo's pool region.
STRIDE = 8192


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
    # Node memory: the pool's regions low, the host API's staging area in the upper half.
    memory = max(16 << 20, _round_up(4 * nbytes, 1 << 20))
    with start_cluster(config.nodes, memory=memory, mtu=config.mtu, switch=True) as cluster:
        progress.status("pool traffic through the switch")
        pool = _pool_traffic(cluster, config)
        progress.status("all-reduce in the NICs")
        allreduce = _allreduce(cluster, config)
        totals = np.zeros(C.NUM_COUNTERS, np.uint64)
        with ControlClient.for_cluster(cluster.info) as client:
            for ep in cluster.endpoints:
                totals += client.counters(ep)
        startup = cluster.startup_seconds
    return {
        "ok": bool(pool["ok"] and allreduce["ok"]),
        "transport": "node processes and a switch on loopback UDP",
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
            # By status: BUSY is flow control (a rank's node started the all-reduce before
            # another's), anything else would be worth a look.
            "nacks": C.counters_to_dict(totals)["nacks"],
            "kernel_drops": int(totals[C.KERNEL_DROPS]),
            "bytes_combined": int(totals[C.BYTES_COMBINED]),
        },
    }


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


def _pool_traffic(cluster: LocalCluster, config: DemoConfig) -> dict[str, object]:
    """Through the switch's VIP: allocate an interleaved region, then clients WRITE random
    blocks, READ them back (pipelined), and FETCH_ADD one shared counter."""
    assert cluster.switch is not None
    controller = PoolController(cluster.path)
    size = _round_up(64 * (config.pool_ops + 1), STRIDE)
    region = controller.alloc(size, interleave=STRIDE)
    rng = np.random.default_rng(config.seed)
    clients = [
        PoolClient(cluster.switch.vip, mtu=cluster.info.mtu, tag_keys=tag_keys_of(region))
        for _ in range(config.clients)
    ]
    counter_addr = region.gaddr
    blocks = [rng.integers(0, 256, 64, dtype=np.uint8).tobytes() for _ in range(config.pool_ops)]
    addrs = [region.gaddr + 64 * (k + 1) for k in range(config.pool_ops)]
    start = time.perf_counter()
    try:
        for c, client in enumerate(clients):
            mine = range(c, config.pool_ops, len(clients))
            client.write_many([(addrs[k], blocks[k], region.rkey) for k in mine])
            back = client.read_many([(addrs[k], 64, region.rkey) for k in mine])
            mismatches = sum(got != blocks[k] for got, k in zip(back, mine, strict=True))
        for k in range(config.pool_ops):
            clients[k % len(clients)].fetch_add(counter_addr, 1, region.rkey)
        counter = unpack_u64(clients[0].read(counter_addr, 8, region.rkey))
    finally:
        for client in clients:
            client.close()
    seconds = time.perf_counter() - start
    ops = 3 * config.pool_ops + 1
    return {
        "ok": mismatches == 0 and counter == config.pool_ops,
        "ops": ops,
        "ops_per_second": ops / seconds,
        "mismatches": mismatches,
        "fetch_add_counter": counter,
        "fetch_add_expected": config.pool_ops,
        "vip": f"{cluster.switch.vip[0]}:{cluster.switch.vip[1]}",
        "region": {"gaddr": region.gaddr, "size": size, "stride": STRIDE},
    }


def _allreduce(cluster: LocalCluster, config: DemoConfig) -> dict[str, object]:
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
        works = [
            api_all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, groups, strict=True)
        ]
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
        "model_seconds_100g": estimate_allreduce_seconds(
            n, nbytes, link_gbps=100.0, dtype_bytes=esize
        ),
    }


def _random_input(rng: np.random.Generator, count: int, dtype: DType) -> np.ndarray:
    np_dtype = np.dtype(NUMPY_DTYPE[dtype])
    if np_dtype.kind == "f":
        return rng.standard_normal(count).astype(np_dtype)
    return rng.integers(-1000, 1000, count).astype(np_dtype)
