"""``netdam demo``: the main job on what exists so far, checked against numpy.

Today it runs node *cores* on the in-memory fabric (no sockets, no processes: those arrive with
the compiled I/O shells), and drives them only with wire packets:

1. a controller registers one region per node with REGISTER (admin key);
2. pool traffic: WRITE, READ back, FETCH_ADD on a shared counter, from several clients;
3. an all-reduce the NetDAM way: a chained reduce-scatter (each block's packets start at the
   node after its owner and travel the ring on the SR list; every hop adds its block in flight,
   only the owner stores) and a multicast all-gather (each owner sends its reduced block once
   with ALL_WRITE to a group; every member writes it);
4. every rank's result is compared with a numpy reference summed in chain order, bitwise.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from netdam import counters as C
from netdam.fabric import Fabric
from netdam.faults import FaultSpec
from netdam.fpga_model import estimate_allreduce_seconds
from netdam.node import NodeConfig, NodeCore
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    Status,
    max_elements,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet

CONTROLLER: Endpoint = ("127.0.0.1", 9000)
GROUP: Endpoint = ("239.77.0.1", 7744)
ADMIN_KEY = 0x0D3E0001
COLL_ID = 1


@dataclass(frozen=True)
class DemoConfig:
    nodes: int = 4
    count: int = 1 << 18  # elements per rank
    dtype: DType = DType.F32
    clients: int = 4
    pool_ops: int = 256
    seed: int = 1
    mtu: int = 9000


def run_demo(config: DemoConfig) -> dict[str, object]:
    """Run the demo; returns the summary (``ok`` says whether every check passed)."""
    if config.nodes < 2:
        raise ValueError("--nodes must be at least 2 for an all-reduce")
    esize = ELEMENT_SIZE[config.dtype]
    nbytes = config.count * esize
    region = _round_up(2 * nbytes + 64 + 64 * config.pool_ops, 4096)  # input, output, pool area
    fabric = Fabric(FaultSpec())
    endpoints = [("127.0.0.1", 7744 + rank) for rank in range(config.nodes)]
    nodes = [
        NodeCore(
            NodeConfig(
                endpoint=ep,
                memory_bytes=region,
                admin_key=ADMIN_KEY,
                members=tuple(endpoints),
                rank=rank,
                world_size=config.nodes,
                mtu=config.mtu,
            )
        )  # fmt: skip
        for rank, ep in enumerate(endpoints)
    ]
    for ep, node in zip(endpoints, nodes, strict=True):
        fabric.add_core(ep, node)
        fabric.join(GROUP, ep)
    fabric.add_endpoint(CONTROLLER)
    start = time.perf_counter()
    rkey = _register_everywhere(fabric, endpoints, region)
    pool = _pool_traffic(fabric, endpoints, rkey, config, base=_round_up(2 * nbytes, 64))
    allreduce = _allreduce(fabric, endpoints, nodes, rkey, config)
    seconds = time.perf_counter() - start
    totals = np.sum([n.counters for n in nodes], axis=0)
    ok = bool(pool["ok"] and allreduce["ok"])
    return {
        "ok": ok,
        "transport": "in-memory fabric (node cores driven by wire packets; no sockets yet)",
        "nodes": config.nodes,
        "dtype": config.dtype.name.lower(),
        "bytes": nbytes,
        "seconds": seconds,
        "pool": pool,
        "allreduce": allreduce,
        "counters": {
            "rx_packets": int(totals[C.RX_PACKETS]),
            "forwarded": int(totals[C.FORWARDED]),
            "stored": int(totals[C.STORED]),
            "nacks": int(totals[C.NACK_BASE : C.NACK_BASE + C.NACK_SLOTS].sum()),
            "bytes_combined": int(totals[C.BYTES_COMBINED]),
        },
    }


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


def _exchange(fabric: Fabric, src: Endpoint, dst: Endpoint, packet: Packet) -> list[Packet]:
    fabric.send(src, dst, encode_packet(packet))
    fabric.run_until_idle()
    return [decode_packet(data) for data, _ in fabric.receive(src)]


def _register_everywhere(fabric: Fabric, endpoints: list[Endpoint], region: int) -> int:
    """REGISTER the same rkey on every node (the first node picks it)."""
    rkey = 0
    for txn, ep in enumerate(endpoints, start=1):
        payload = struct.pack("<II", rkey, int(RIGHTS_ALL))
        request = Packet(Opcode.REGISTER, client_id=1, txn_id=txn, rkey=ADMIN_KEY, addr=0,
                         aux_addr=region, length=8, payload=payload)  # fmt: skip
        (reply,) = _exchange(fabric, CONTROLLER, ep, request)
        if reply.opcode != Opcode.ACK:
            raise RuntimeError(f"REGISTER on {ep[0]}:{ep[1]} failed: {reply.status.name}")
        rkey = reply.rkey
    return rkey


def _pool_traffic(
    fabric: Fabric, endpoints: list[Endpoint], rkey: int, config: DemoConfig, base: int
) -> dict[str, object]:
    """Clients WRITE random blocks, READ them back, and FETCH_ADD one shared counter."""
    rng = np.random.default_rng(config.seed)
    clients = [("127.0.0.1", 9100 + k) for k in range(config.clients)]
    for client in clients:
        fabric.add_endpoint(client)
    counter_addr = base
    mismatches = ops = 0
    for k in range(config.pool_ops):
        client = clients[k % len(clients)]
        cid = 100 + k % len(clients)
        node = endpoints[k % len(endpoints)]
        addr = base + 64 + 64 * (k // len(endpoints))
        data = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
        write = Packet(Opcode.WRITE, flags=Flags.ACK_REQ, client_id=cid, txn_id=2 * k + 1, rkey=rkey,
                       addr=addr, length=64, payload=data)  # fmt: skip
        read = Packet(Opcode.READ, client_id=cid, txn_id=2 * k + 2, rkey=rkey, addr=addr, length=64)
        add = Packet(Opcode.FETCH_ADD, client_id=cid, txn_id=2 * k + 2, rkey=rkey, addr=counter_addr,
                     dtype=DType.U64, length=8, payload=struct.pack("<Q", 1))  # fmt: skip
        replies = _exchange(fabric, client, node, write) + _exchange(fabric, client, node, read)
        replies += _exchange(fabric, client, endpoints[0], add)
        ops += 3
        if len(replies) != 3 or replies[1].payload != data or replies[0].status != Status.OK:
            mismatches += 1
    final = _exchange(
        fabric,
        clients[0],
        endpoints[0],
        Packet(Opcode.READ, rkey=rkey, addr=counter_addr, dtype=DType.U64, length=8),
    )
    counter = struct.unpack("<Q", final[0].payload)[0]
    return {"ok": mismatches == 0 and counter == config.pool_ops, "ops": ops, "mismatches": mismatches,
            "fetch_add_counter": counter, "fetch_add_expected": config.pool_ops}  # fmt: skip


def _allreduce(
    fabric: Fabric, endpoints: list[Endpoint], nodes: list[NodeCore], rkey: int, config: DemoConfig
) -> dict[str, object]:
    n = config.nodes
    esize = ELEMENT_SIZE[config.dtype]
    dtype = np.dtype(NUMPY_DTYPE[config.dtype])
    rng = np.random.default_rng(config.seed + 1)
    inputs = [_random_input(rng, config.count, config.dtype) for _ in range(n)]
    nbytes = config.count * esize
    in_addr, out_addr = 0, nbytes
    for node, data in zip(nodes, inputs, strict=True):
        node.memory[in_addr : in_addr + nbytes] = data.view(np.uint8)
    bounds = np.linspace(0, config.count, n + 1).astype(
        np.int64
    )  # block j = [bounds[j], bounds[j+1])
    per_packet = max_elements(config.mtu, config.dtype, segments=n - 1)
    start = time.perf_counter()
    packets = 0
    for j in range(n):
        origin = (j + 1) % n
        ring = [(origin + k) % n for k in range(1, n)]  # ends at the owner j
        segments = tuple(endpoints[r] for r in ring)
        for seq, first in enumerate(range(int(bounds[j]), int(bounds[j + 1]), per_packet)):
            last = min(first + per_packet, int(bounds[j + 1]))
            payload = inputs[origin][first:last].tobytes()
            fabric.send(endpoints[origin], segments[0], encode_packet(Packet(
                Opcode.CHAIN_ADD, flags=Flags.ACK_REQ, seq=seq, coll_id=COLL_ID, epoch=1, rkey=rkey,
                addr=in_addr + first * esize, aux_addr=out_addr + first * esize, dtype=config.dtype,
                segments=segments, segments_left=len(segments) - 1, length=len(payload), payload=payload,
            )))  # fmt: skip
            packets += 1
    fabric.run_until_idle()
    reduce_scatter_s = time.perf_counter() - start
    for j in range(n):  # all-gather: each owner multicasts its reduced block once
        for first in range(int(bounds[j]), int(bounds[j + 1]), per_packet):
            last = min(first + per_packet, int(bounds[j + 1]))
            a = out_addr + first * esize
            payload = bytes(nodes[j].memory[a : a + (last - first) * esize])
            fabric.send(endpoints[j], GROUP, encode_packet(Packet(
                Opcode.ALL_WRITE, flags=Flags.MCAST, rkey=rkey, addr=a, dtype=config.dtype,
                length=len(payload), payload=payload,
            )))  # fmt: skip
            packets += 1
    fabric.run_until_idle()
    seconds = time.perf_counter() - start
    for node in nodes:
        while node.next_event() is not None:  # chain ACKs arrive as events at the originators
            pass
    expected = np.empty(config.count, dtype)
    for j in range(n):
        order = [(j + 1 + k) % n for k in range(n)]  # originator first, owner last
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        expected[lo:hi] = _chain_reference([inputs[r][lo:hi] for r in order])
    results = [bytes(node.memory[out_addr : out_addr + nbytes]) for node in nodes]
    identical = all(r == results[0] for r in results)
    exact = results[0] == expected.tobytes()
    # What the same all-reduce would cost on 100G NetDAM cards (fpga_model), beside our time.
    model_s = estimate_allreduce_seconds(n, nbytes, link_gbps=100.0, dtype_bytes=esize)
    return {
        "ok": identical and exact,
        "ranks_identical": identical,
        "equals_reference": exact,
        "packets": packets,
        "elements_per_packet": per_packet,
        "seconds": seconds,
        "reduce_scatter_seconds": reduce_scatter_s,
        "model_seconds_100g": model_s,
    }


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
