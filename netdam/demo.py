"""``netdam demo``: the main job on what exists so far, checked against numpy.

It starts a local cluster of real node processes on loopback UDP and drives them only with wire
packets, from one host process:

1. a controller REGISTERs the same rkey on every node (admin key from the cluster file);
2. pool traffic: several clients WRITE random blocks, READ them back and FETCH_ADD a shared
   counter, each over its own UDP socket;
3. an all-reduce the NetDAM way: the host puts each rank's input into its node's memory through
   the shared-memory mapping (host load/store), then a chained reduce-scatter runs in the NICs:
   each block's packets travel the ring on the SR list, every hop adds its block in flight and
   only the owner stores; then the all-gather writes each owner's reduced block into every
   member with ALL_WRITE. Today the host injects the chain heads and the ALL_WRITEs (the
   collective engine inside the nodes, multicast groups and loss recovery come next);
4. every rank's result, read back through shared memory, is compared with a numpy reference
   summed in chain order, bitwise.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from netdam import counters as C
from netdam.control import ControlClient
from netdam.fpga_model import estimate_allreduce_seconds
from netdam.kernels.udp_io import (
    MAX_MSGS,
    SEND_SCRATCH_WORDS_PER_MSG,
    STATE_LEN,
    _recv_batch,
    _send_batch,
)
from netdam.launch import LocalCluster, start_cluster
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    max_elements,
)
from netdam.protocol.packet import Endpoint, Packet, encode_packet, endpoint_to_u64
from netdam.shm import attach
from netdam.udp import open_udp_socket

COLL_ID = 1
#: Chain heads in flight at once: a window, so no receive buffer overflows (BRIEF s1).
WINDOW = 64


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
    pool_base = _round_up(2 * nbytes, 64)
    region = _round_up(pool_base + 64 + 64 * config.pool_ops, 4096)  # input, output, pool area
    with start_cluster(config.nodes, memory=region, mtu=config.mtu) as cluster:
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
    n = config.nodes
    esize = ELEMENT_SIZE[config.dtype]
    dtype = np.dtype(NUMPY_DTYPE[config.dtype])
    nbytes = config.count * esize
    in_addr, out_addr = 0, nbytes
    rng = np.random.default_rng(config.seed + 1)
    inputs = [_random_input(rng, config.count, config.dtype) for _ in range(n)]
    memories = [attach(node.memory_file) for node in cluster.info.nodes]
    for memory, data in zip(memories, inputs, strict=True):  # host stores into NIC memory
        memory[in_addr : in_addr + nbytes] = data.view(np.uint8)
    bounds = np.linspace(0, config.count, n + 1).astype(np.int64)  # block j = [bounds[j], bounds[j+1])
    per_packet = max_elements(config.mtu, config.dtype, segments=n - 1)
    endpoints = cluster.endpoints
    chains: list[tuple[Endpoint, bytes]] = []
    for j in range(n):
        origin = (j + 1) % n
        segments = tuple(endpoints[(origin + k) % n] for k in range(1, n))  # ends at the owner j
        for first in range(int(bounds[j]), int(bounds[j + 1]), per_packet):
            last = min(first + per_packet, int(bounds[j + 1]))
            payload = inputs[origin][first:last].tobytes()
            chains.append((segments[0], encode_packet(Packet(
                Opcode.CHAIN_ADD, flags=Flags.ACK_REQ, seq=len(chains), coll_id=COLL_ID, epoch=1,
                rkey=rkey, addr=in_addr + first * esize, aux_addr=out_addr + first * esize,
                dtype=config.dtype, segments=segments, segments_left=len(segments) - 1,
                length=len(payload), payload=payload,
            ))))  # fmt: skip
    io = _HostIO()
    start = time.perf_counter()
    acked = io.run_window(chains, config.timeout_s)
    reduce_scatter_s = time.perf_counter() - start
    gathers: list[tuple[Endpoint, bytes]] = []
    for j in range(n):  # all-gather: each owner's reduced block to every other member
        for first in range(int(bounds[j]), int(bounds[j + 1]), per_packet):
            last = min(first + per_packet, int(bounds[j + 1]))
            a = out_addr + first * esize
            payload = memories[j][a : a + (last - first) * esize].tobytes()
            for member in range(n):
                if member != j:
                    gathers.append((endpoints[member], encode_packet(Packet(
                        Opcode.ALL_WRITE, flags=Flags.ACK_REQ, seq=len(gathers), rkey=rkey, addr=a,
                        dtype=config.dtype, length=len(payload), payload=payload))))  # fmt: skip
    acked += io.run_window(gathers, config.timeout_s)
    seconds = time.perf_counter() - start
    io.close()
    expected = np.empty(config.count, dtype)
    for j in range(n):
        order = [(j + 1 + k) % n for k in range(n)]  # originator first, owner last
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        expected[lo:hi] = _chain_reference([inputs[r][lo:hi] for r in order])
    results = [bytes(m[out_addr : out_addr + nbytes]) for m in memories]
    identical = all(r == results[0] for r in results)
    exact = results[0] == expected.tobytes()
    # What the same all-reduce would cost on 100G NetDAM cards (fpga_model), beside our time.
    model_s = estimate_allreduce_seconds(n, nbytes, link_gbps=100.0, dtype_bytes=esize)
    return {
        "ok": identical and exact and acked == len(chains) + len(gathers),
        "ranks_identical": identical,
        "equals_reference": exact,
        "packets": len(chains) + len(gathers),
        "acked": acked,
        "elements_per_packet": per_packet,
        "seconds": seconds,
        "reduce_scatter_seconds": reduce_scatter_s,
        "model_seconds_100g": model_s,
    }


class _HostIO:
    """The host side of the demo: batched sends (GSO where possible) and ACK collection."""

    def __init__(self) -> None:
        self.sock = open_udp_socket(("127.0.0.1", 0))
        self.scratch = np.zeros(MAX_MSGS * SEND_SCRATCH_WORDS_PER_MSG, np.int64)
        self.state = np.zeros(STATE_LEN, np.int64)
        self.rx = np.zeros(8 << 20, np.uint8)
        self.rx_off = np.zeros(1024, np.int64)
        self.rx_len = np.zeros(1024, np.int32)
        self.rx_src = np.zeros(1024, np.uint64)

    def run_window(self, packets: list[tuple[Endpoint, bytes]], timeout_s: float) -> int:
        """Send every packet keeping at most WINDOW unacknowledged; return the ACKs counted."""
        acked = sent = 0
        deadline = time.monotonic() + timeout_s
        while acked < len(packets) and time.monotonic() < deadline:
            burst = packets[sent : sent + max(0, WINDOW - (sent - acked))]
            if burst:
                self._send(burst)
                sent += len(burst)
            got = int(_recv_batch(self.sock.fileno(), self.rx, self.rx_off, self.rx_len, self.rx_src,
                                  1024, 50, self.state))  # fmt: skip
            for k in range(got):
                if self.rx[self.rx_off[k] + 1] == Opcode.ACK:
                    acked += 1
        return acked

    def _send(self, packets: list[tuple[Endpoint, bytes]]) -> None:
        lens = np.array([len(d) for _, d in packets], np.int32)
        offs = np.zeros(len(packets), np.int64)
        offs[1:] = np.cumsum(lens[:-1])
        buf = np.frombuffer(b"".join(d for _, d in packets), np.uint8).copy()
        dsts = np.array([endpoint_to_u64(ep) for ep, _ in packets], np.uint64)
        done = 0
        while done < len(packets):
            done += int(_send_batch(self.sock.fileno(), buf, offs[done:], lens[done:], dsts[done:],
                                    len(packets) - done, self.scratch, self.state))  # fmt: skip

    def close(self) -> None:
        self.sock.close()


def _random_input(rng: np.random.Generator, count: int, dtype: DType) -> np.ndarray:
    np_dtype = np.dtype(NUMPY_DTYPE[dtype])
    if np_dtype.kind == "f":
        return rng.standard_normal(count).astype(np_dtype)
    return rng.integers(-1000, 1000, count).astype(np_dtype)


def _chain_reference(blocks: list[np.ndarray]) -> np.ndarray:
    """Sum in chain order with rounding after every hop, as the NICs do."""
    acc = blocks[0].copy()
    for block in blocks[1:]:
        acc = np.asarray(acc + block, dtype=acc.dtype)
    return np.asarray(acc)
