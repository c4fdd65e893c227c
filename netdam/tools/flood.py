"""``netdam flood``: blast a node or the switch with a seeded mix of valid and malformed
datagrams for a while and show that it stays alive, answers stats, keeps memory use flat, and
counts what it could not take.

Why memory stays flat (the design this checks): every queue and table of the datapath is a
fixed-size array allocated at start (receive batch, send queue of ``tx_slots`` datagrams,
at-most-once window of 256 requesters x 256 txns, 4 collective slots); the switch keeps no
per-request state at all. What does not fit is dropped and counted: by the kernel when the
socket's receive buffer is full (``kernel_drops``, from SO_RXQ_OVFL), by the node when its send
queue is full (``drop_tx_full``). Nothing waits for a sender to slow down: on UDP, as on a NIC,
backpressure is loss, and the protocol's retries (pool client, collectives) recover from it.
The mix's wrong keys get the flooding address locked out after its first bursts (SPEC.md 12.3):
from then on the target drops its datagrams at the cost of one table lookup (``drop_lockout``).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from netdam.cluster.control import ControlClient, ControlError
from netdam.kernels import udp_io as U
from netdam.kernels.state import TxQueue
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DEFAULT_MTU,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Rights,
    slot_bytes,
)
from netdam.protocol.packet import Endpoint, Packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import pack_key_rights, pack_u64
from netdam.shell.startup import wait_while_working
from netdam.shell.udp import open_udp_socket
from netdam.tools.workers import worker_context

#: The flooders' source address (a loopback address of its own, see _sender).
FLOOD_SOURCE = "127.0.0.2"
#: Datagrams in the sender's cycle; sent again and again, batch by batch.
MIX_SIZE = 4096
FEED_BATCH = 64
#: Seconds of flood before the memory baseline is taken. Node and switch make their queues and
#: tables resident before serving (netdam.shell.shm.prefault), so this only lets the first requests
#: of the control plane's Python settle (~0.2 MiB once).
WARMUP_S = 1.0
#: Growth of a process's anonymous memory (RssAnon) over the flood that still counts as flat.
FLAT_LIMIT_BYTES = 4 << 20
SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True)
class FloodConfig:
    target: str  # "node" or "switch"
    seconds: float
    senders: int = 1
    seed: int = 0
    nodes: int = 3


@dataclass(frozen=True)
class Target:
    """What the mix may name: a region with its rkey at the place the datagrams go."""

    dst: Endpoint
    addr: int  # node-local address (node target) or global address (switch target)
    size: int
    rkey: int
    peers: tuple[Endpoint, ...]


def build_mix(target: Target, seed: int, count: int = MIX_SIZE) -> list[bytes]:
    """A seeded mix: 40% valid READ/WRITE/FETCH_ADD, the rest wrong keys, out-of-bounds ranges,
    chains, control opcodes without the admin key, truncated and random datagrams."""
    rng = np.random.default_rng(seed)
    mix = []
    for i in range(count):
        kind = int(rng.integers(0, 10))
        length = int(rng.choice([8, 64, 1024]))
        addr = target.addr + int(rng.integers(0, (target.size - length) // 8 + 1)) * 8
        ids = {"client_id": int(rng.integers(1, 2**32)), "txn_id": i}
        if kind <= 1:
            p = Packet(
                Opcode.READ, rkey=target.rkey, addr=addr, length=length, dtype=DType.RAW, **ids
            )
        elif kind == 2:
            p = Packet(
                Opcode.WRITE,
                flags=Flags.ACK_REQ,
                rkey=target.rkey,
                addr=addr,
                length=length,
                dtype=DType.RAW,
                payload=bytes(length),
                **ids,
            )
        elif kind == 3:
            p = Packet(
                Opcode.FETCH_ADD,
                rkey=target.rkey,
                addr=addr,
                length=8,
                dtype=DType.U64,
                payload=pack_u64(1),
                **ids,
            )
        elif kind == 4:
            p = Packet(Opcode.READ, rkey=target.rkey ^ 0x5A5A, addr=addr, length=length, **ids)
        elif kind == 5:
            p = Packet(
                Opcode.WRITE,
                rkey=target.rkey,
                addr=target.addr + target.size - 8,
                length=64,
                payload=bytes(64),
                **ids,
            )
        elif kind == 6:
            segs = (target.dst, *target.peers[:2])
            p = Packet(
                Opcode.CHAIN_ADD,
                rkey=target.rkey,
                addr=addr,
                aux_addr=addr,
                length=1024,
                dtype=DType.F32,
                reduce_op=ReduceOp.SUM,
                segments=segs,
                segments_left=len(segs) - 1,
                payload=bytes(1024),
                **ids,
            )
        elif kind == 7:
            op = [Opcode.REGISTER, Opcode.COUNTERS, Opcode.JOIN, Opcode.START_COLL][
                int(rng.integers(0, 4))
            ]
            payload = pack_key_rights(0, int(Rights.READ)) if op == Opcode.REGISTER else b""
            payload = bytes(64) if op == Opcode.START_COLL else payload
            p = Packet(
                op,
                rkey=int(rng.integers(1, 2**32)),
                length=len(payload),
                payload=payload,
                coll_id=1 if op == Opcode.START_COLL else 0,
                **ids,
            )
        else:
            mix.append(bytes(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8)))
            continue
        data = encode_packet(p)
        if kind == 8 and rng.random() < 0.5:
            data = data[: int(rng.integers(1, len(data)))]  # truncated
        mix.append(data)
    return mix


def _sender(conn: Connection, mix: list[bytes], dst: Endpoint) -> None:
    """Spawned child: send the mix round and round with sendmmsg until the time it is told."""

    try:
        # Another loopback address than the operator's (127.0.0.1): the mix's wrong keys get the
        # flooder locked out (SPEC.md 12.3), as they would another host, never the stats client.
        sock = open_udp_socket((FLOOD_SOURCE, 0), rcvbuf=1 << 16, gro=False)
        slot = max(len(d) for d in mix)
        buf = np.zeros(len(mix) * slot, np.uint8)
        for i, data in enumerate(mix):
            buf[i * slot : i * slot + len(data)] = np.frombuffer(data, np.uint8)
        offs = np.arange(len(mix), dtype=np.int64) * slot
        lens = np.array([len(d) for d in mix], np.int32)
        dsts = np.full(len(mix), endpoint_to_u64(dst), np.uint64)
        counts = np.zeros(U.COUNTS_LEN, np.int64)
        progress = np.zeros(8, np.int64)
        conn.send(("ready", {}))
        t_end_ns = int(conn.recv())
        U.feed_run(
            sock.fileno(),
            TxQueue(buf, offs, lens, dsts, slot_bytes(DEFAULT_MTU)),
            len(mix),
            FEED_BATCH,
            U.new_send_scratch(),
            U.new_state(),
            0,
            t_end_ns,
            counts,
            progress,
            0,
            0,
        )
        conn.send(("done", {"sent": int(counts[U.FEED_SENT_TOTAL])}))
    except BaseException as exc:  # report, the parent turns it into `error`
        with contextlib.suppress(Exception):
            conn.send(("error", f"sender: {type(exc).__name__}: {exc}"))


def rss_bytes(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of *pid* (anonymous memory: what a leak grows; the node's memory file
    is shared memory and touched pages of it count in VmRSS only)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _setup(cfg: FloodConfig, workdir: Path) -> tuple[Any, Any, Target, int, Endpoint]:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import start_pool_cluster

    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import PoolController

    cluster, switch = start_pool_cluster(
        cfg.nodes, memory=8 << 20, cluster_path=workdir / "flood.toml"
    )
    # Untagged (SPEC v1): the flood's valid datagrams name the region by its rkey alone, as any
    # v1 client's would; a tagged region would refuse them all BAD_RKEY.
    region = PoolController(cluster.path).alloc(64 << 10, tagged=False)
    node_rank, local = region.locate(0)
    peers = tuple(ep for i, ep in enumerate(cluster.endpoints) if i != node_rank)
    if cfg.target == "switch":
        target = Target(switch.vip, region.gaddr, region.size, region.rkey, peers)
        return cluster, switch, target, switch.process.pid, switch.entry.control_endpoint
    node = cluster.info.nodes[node_rank]
    target = Target(node.endpoint, local, region.size, region.rkey, peers)
    return cluster, switch, target, node.pid, node.control_endpoint


def run_flood(cfg: FloodConfig) -> dict[str, Any]:
    """Start a pool cluster, flood the target for cfg.seconds, sample it, report."""
    with tempfile.TemporaryDirectory(prefix="netdam-flood-") as tmp:
        cluster, switch, target, pid, control = _setup(cfg, Path(tmp))
        try:
            return _flood(cfg, cluster, target, pid, control)
        finally:
            switch.stop()
            cluster.stop()


def _flood(
    cfg: FloodConfig, cluster: Any, target: Target, pid: int, control: Endpoint
) -> dict[str, Any]:
    ctx = worker_context()
    children = []
    for k in range(cfg.senders):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=_sender,
            args=(child_end, build_mix(target, cfg.seed + k), target.dst),
            daemon=True,
        )
        proc.start()
        children.append((proc, parent_end))
    for proc, conn in children:
        # As long as the sender works (its first run compiles; netdam.shell.startup).
        wait_while_working(proc.pid or 0, conn.poll, "flood sender")
        kind, body = conn.recv()
        if kind != "ready":
            raise RuntimeError(str(body))
    t_end = time.monotonic_ns() + int(cfg.seconds * 1e9)
    for _, conn in children:
        conn.send(t_end)
    samples: list[dict[str, float]] = []
    stats_latency: list[float] = []
    stats_failures = 0
    start = time.monotonic()
    with ControlClient.for_cluster(cluster.info) as client:
        before = client.counters(control)
        while time.monotonic() - start < cfg.seconds:
            time.sleep(SAMPLE_EVERY_S)
            t0 = time.perf_counter()
            try:
                client.counters(control)
                stats_latency.append(time.perf_counter() - t0)
            except ControlError:
                stats_failures += 1
            rss = rss_bytes(pid)
            samples.append({"t": time.monotonic() - start, **rss})
        flood_seconds = time.monotonic() - start
        sent = 0
        for proc, conn in children:
            if conn.poll(10):
                kind, body = conn.recv()
                sent += int(body.get("sent", 0)) if kind == "done" else 0
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        time.sleep(0.3)
        alive = True
        try:
            client.ping(control, timeout=2.0)
            after = client.counters(control)
        except ControlError:
            alive, after = False, before
    result = _report(
        cfg, samples, stats_latency, stats_failures, flood_seconds, before, after, alive
    )
    result["sent"] = sent
    result["sent_per_second"] = round(sent / max(flood_seconds, 1e-9))
    return result


def _report(
    cfg: FloodConfig,
    samples: list[dict[str, float]],
    latency: list[float],
    failures: int,
    seconds: float,
    before: np.ndarray,
    after: np.ndarray,
    alive: bool,
) -> dict[str, Any]:
    warm = [s for s in samples if s["t"] >= WARMUP_S] or samples[-1:]
    anon = [int(s["RssAnon"]) for s in warm]
    growth = anon[-1] - anon[0] if anon else 0
    delta = np.maximum(after.astype(np.int64) - before.astype(np.int64), 0).astype(np.uint64)
    named = C.counters_to_dict(delta)
    counts = {
        k: named[k]
        for k in (
            "rx_packets",
            "tx_packets",
            "kernel_drops",
            "drop_tx_full",
            "drop_truncated",
            "drops",
            "nacks",
        )
    }
    flat = growth <= FLAT_LIMIT_BYTES
    ok = alive and flat and failures == 0
    return {
        "ok": ok,
        "target": cfg.target,
        "seconds": round(seconds, 2),
        "senders": cfg.senders,
        "seed": cfg.seed,
        "alive": alive,
        "rss_anon_mib_start": round(anon[0] / 2**20, 2) if anon else None,
        "rss_anon_mib_end": round(anon[-1] / 2**20, 2) if anon else None,
        "rss_anon_mib_max": round(max(anon) / 2**20, 2) if anon else None,
        "rss_anon_growth_mib": round(growth / 2**20, 3),
        "flat_limit_mib": FLAT_LIMIT_BYTES / 2**20,
        "rss_anon_mib_series": [
            [round(s["t"], 1), round(s["RssAnon"] / 2**20, 2)] for s in samples
        ],
        "memory_flat": flat,
        "stats_answered": len(latency),
        "stats_failed": failures,
        "stats_latency_ms_max": round(max(latency) * 1e3, 2) if latency else None,
        "counters": counts,
    }
