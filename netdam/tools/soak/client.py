"""One ``netdam soak`` client process: its socket (seeded faults on what it receives, a
retry clock) and its loop of pipelined WRITE / READ / FETCH_ADD batches checked against its
book. Spawned by netdam/tools/soak/parent.py (the plan, the bookkeeping and the parent live there).
"""

from __future__ import annotations

import contextlib
import heapq
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np

from netdam.clients.pool import PoolClient, PoolError, fetch_add_packet
from netdam.core.faults import FaultSpec, decide, packet_id
from netdam.protocol.constants import Flags, Opcode
from netdam.protocol.layout import H_OPCODE, HEADER
from netdam.protocol.packet import Endpoint, Packet, endpoint_to_u64
from netdam.protocol.payloads import unpack_u64
from netdam.tools.soak.plan import (
    ATTEMPT_MEMORY,
    ERROR_SAMPLES,
    FILL_BATCH,
    KINDS,
    OK,
    REORDER_HOLD_S,
    BlockBook,
    ClientPlan,
    ClientSettings,
    SoakFailure,
    checksum,
    seeded,
)

# ---------------------------------------------------------------- the clients' socket


@dataclass
class _Sent:
    """A request the probe saw go out and no reply for yet."""

    first: float
    opcode: int
    addr: int
    length: int
    sends: int = 1


class ProbeSocket:
    """The socket a soak client's PoolClient uses: seeded faults on the datagrams it receives
    (the replies, which reach the client straight from the nodes) and the latency of every
    request (first send to first reply delivered, retries included)."""

    def __init__(self, sock: socket.socket, faults: FaultSpec) -> None:
        self._sock = sock
        self._faults = faults
        self._me = endpoint_to_u64(sock.getsockname())
        self._timeout: float | None = None
        self._ready: deque[tuple[bytes, Any]] = deque()
        self._delayed: list[tuple[float, int, bytes, Any]] = []  # heap by release time
        self._reordered: list[tuple[float, bytes, Any]] = []
        self._attempts: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._sent: dict[int, _Sent] = {}
        self._order = 0
        self.latency_us: dict[int, list[float]] = {int(k): [] for k in KINDS}
        self.injected = {"drops": 0, "dups": 0, "reordered": 0, "delayed": 0}

    def settimeout(self, value: float | None) -> None:
        self._timeout = value

    def getsockname(self) -> Any:
        return self._sock.getsockname()

    def close(self) -> None:
        self._sock.close()

    def sendto(self, data: bytes, address: Endpoint) -> int:
        txn = HEADER.read(data, "txn_id")
        sent = self._sent.get(txn)
        if sent is None:
            self._sent[txn] = _Sent(
                time.monotonic(),
                data[H_OPCODE],
                HEADER.read(data, "addr"),
                HEADER.read(data, "length"),
            )
            if len(self._sent) > 8192:
                self._prune()
        else:
            sent.sends += 1
        return self._sock.sendto(data, address)

    def reset_latency(self) -> None:
        for samples in self.latency_us.values():
            samples.clear()

    def unanswered(self, since: float) -> list[_Sent]:
        """Requests first sent at or after *since* that got no reply (yet)."""
        return [s for s in self._sent.values() if s.first >= since]

    def recvfrom(self, bufsize: int) -> tuple[bytes, Any]:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            now = time.monotonic()
            item = self._due(now)
            if item is not None:
                return self._deliver(item, now)
            wake = [t for t in (deadline, self._next_release()) if t is not None]
            if deadline is not None and now >= deadline:
                raise TimeoutError("timed out")
            self._sock.settimeout(max(min(wake) - now, 1e-4) if wake else None)
            try:
                data, src = self._sock.recvfrom(bufsize)
            except TimeoutError:
                continue
            self._arrive(data, src, time.monotonic())

    # ------------------------------------------------------------ internals

    def _arrive(self, data: bytes, src: Any, now: float) -> None:
        if not self._faults.active:
            self._ready.append((data, src))
            return
        source = endpoint_to_u64((src[0], int(src[1])))
        pid = packet_id(data)
        key = (source, pid)
        attempt = self._attempts.pop(key, 0)
        self._attempts[key] = attempt + 1
        if len(self._attempts) > ATTEMPT_MEMORY:
            self._attempts.popitem(last=False)
        fate = decide(self._faults, source, self._me, pid, attempt)
        if fate.drop:
            self.injected["drops"] += 1
            return
        self.injected["dups"] += fate.copies - 1
        for _ in range(fate.copies):
            if fate.delay_s:
                self.injected["delayed"] += 1
                self._order += 1
                heapq.heappush(self._delayed, (now + fate.delay_s, self._order, data, src))
            elif fate.reorder:
                self.injected["reordered"] += 1
                self._reordered.append((now + REORDER_HOLD_S, data, src))
            else:
                self._ready.append((data, src))

    def _due(self, now: float) -> tuple[bytes, Any] | None:
        if self._ready:
            return self._ready.popleft()
        if self._delayed and self._delayed[0][0] <= now:
            _, _, data, src = heapq.heappop(self._delayed)
            return data, src
        if self._reordered and self._reordered[0][0] <= now:
            _, data, src = self._reordered.pop(0)
            return data, src
        return None

    def _next_release(self) -> float | None:
        times = [self._delayed[0][0]] if self._delayed else []
        times += [self._reordered[0][0]] if self._reordered else []
        return min(times) if times else None

    def _deliver(self, item: tuple[bytes, Any], now: float) -> tuple[bytes, Any]:
        data = item[0]
        # Reordered datagrams go out after this one: they were overtaken.
        self._ready.extend((d, s) for _, d, s in self._reordered)
        self._reordered.clear()
        if len(data) >= HEADER["txn_id"].end:
            sent = self._sent.pop(HEADER.read(data, "txn_id"), None)
            if sent is not None and sent.opcode in self.latency_us:
                self.latency_us[sent.opcode].append((now - sent.first) * 1e6)
        return item

    def _prune(self) -> None:
        """Forget requests that were abandoned long ago (their replies never came)."""
        limit = time.monotonic() - 10.0
        for txn in [t for t, sent in self._sent.items() if sent.first < limit]:
            del self._sent[txn]


# ---------------------------------------------------------------- one client process


@dataclass
class _Op:
    kind: Opcode
    block: int
    digest: bytes | None
    packet: Packet


@dataclass
class ClientReport:
    index: int
    book: BlockBook
    olds: np.ndarray
    latency_us: dict[int, np.ndarray]
    counts: dict[str, int]
    seconds: float
    retransmits: int
    injected: dict[str, int]
    error_samples: list[str]


class SoakClient:
    """The work of one client process (also usable in-process, for tests)."""

    def __init__(self, plan: ClientPlan, settings: ClientSettings) -> None:
        self.plan = plan
        self.settings = settings
        self.rng = seeded(plan.seed, plan.index, 0x50A4)
        self.pool = PoolClient(
            settings.vip,
            client_id=plan.client_id,
            timeout=settings.timeout_s,
            retries=settings.retries,
            window=32,
            tag_keys=plan.tag_keys(),
        )
        self.probe = ProbeSocket(self.pool.sock, settings.reply_faults)
        self.pool.sock = cast(socket.socket, self.probe)
        self.book = BlockBook(len(plan.blocks))
        self.olds: list[int] = []
        self.counts = {
            "reads": 0,
            "writes": 0,
            "fetch_adds": 0,
            "failed_ops": 0,
            "unconfirmed_writes": 0,
            "unconfirmed_increments": 0,
        }
        self.error_samples: list[str] = []
        self.seconds = 0.0

    def close(self) -> None:
        self.pool.close()

    def fill(self) -> None:
        """Write every block once, so each has a known acknowledged version."""
        indices = list(range(len(self.plan.blocks)))
        for start in range(0, len(indices), FILL_BATCH):
            ops = [self._write_op(b) for b in indices[start : start + FILL_BATCH]]
            try:
                self.pool.execute([op.packet for op in ops])
            except PoolError as exc:
                raise SoakFailure(
                    f"client {self.plan.index}: the first write of its region at "
                    f"0x{self.plan.gaddr:x} failed: {exc}"
                ) from None
            for op in ops:
                assert op.digest is not None
                self.book.acknowledged(op.block, op.digest)
        self.probe.reset_latency()  # the timed phase alone is reported

    def run(self, deadline: float) -> None:
        """Batches of operations until *deadline* (time.monotonic, shared by every process)."""
        start = time.monotonic()
        while time.monotonic() < deadline:
            self.batch()
        self.seconds = time.monotonic() - start

    def batch(self) -> None:
        ops = self._draw_ops()
        start = time.monotonic()
        try:
            replies = self.pool.execute([op.packet for op in ops])
        except PoolError as exc:
            self._failed(ops, exc, start)
            return
        for op, reply in zip(ops, replies, strict=True):
            self._complete(op, reply)

    def report(self) -> ClientReport:
        return ClientReport(
            index=self.plan.index,
            book=self.book,
            olds=np.array(self.olds, np.uint64),
            latency_us={k: np.array(v, np.float32) for k, v in self.probe.latency_us.items()},
            counts=dict(self.counts),
            seconds=self.seconds,
            retransmits=self.pool.retransmits,
            injected=dict(self.probe.injected),
            error_samples=list(self.error_samples),
        )

    # ------------------------------------------------------------ internals

    def _draw_ops(self) -> list[_Op]:
        kinds = self.rng.choice(3, size=self.settings.pipeline, p=self.settings.mix)
        wanted = int(np.count_nonzero(kinds != 2))
        blocks = iter(
            self.rng.choice(
                len(self.plan.blocks), size=min(wanted, len(self.plan.blocks)), replace=False
            )
        )
        ops = []
        for kind in kinds:
            if kind == 2:
                packet = fetch_add_packet(self.plan.counter_addr, 1, self.plan.counter_rkey)
                ops.append(_Op(Opcode.FETCH_ADD, -1, None, packet))
                continue
            block = next(blocks, None)
            if block is not None:
                ops.append(self._write_op(int(block)) if kind == 0 else self._read_op(int(block)))
        return ops

    def _write_op(self, block: int) -> _Op:
        offset, length = self.plan.blocks[block]
        data = self.rng.bytes(length)
        packet = Packet(
            Opcode.WRITE,
            flags=Flags.ACK_REQ,
            rkey=self.plan.rkey,
            addr=self.plan.gaddr + offset,
            length=length,
            payload=data,
        )
        return _Op(Opcode.WRITE, block, checksum(data), packet)

    def _read_op(self, block: int) -> _Op:
        offset, length = self.plan.blocks[block]
        packet = Packet(
            Opcode.READ, rkey=self.plan.rkey, addr=self.plan.gaddr + offset, length=length
        )
        return _Op(Opcode.READ, block, None, packet)

    def _complete(self, op: _Op, reply: Packet) -> None:
        if op.kind == Opcode.WRITE:
            assert op.digest is not None
            self.book.acknowledged(op.block, op.digest)
            self.counts["writes"] += 1
        elif op.kind == Opcode.READ:
            self.counts["reads"] += 1
            verdict = self.book.check(op.block, reply.payload)
            if verdict != OK:
                self._sample(
                    f"client {self.plan.index}: READ of block {op.block} at 0x{op.packet.addr:x} "
                    f"({op.packet.length} bytes) found {verdict} data"
                )
        else:
            self.counts["fetch_adds"] += 1
            self.olds.append(unpack_u64(reply.payload))

    def _failed(self, ops: Sequence[_Op], exc: PoolError, start: float) -> None:
        """No reply (or a NACK) in the batch: nothing of it counts as acknowledged."""
        self.counts["failed_ops"] += len(ops)
        for op in ops:
            if op.kind == Opcode.WRITE:
                assert op.digest is not None
                self.book.unconfirmed(op.block, op.digest)
                self.counts["unconfirmed_writes"] += 1
            elif op.kind == Opcode.FETCH_ADD:
                self.counts["unconfirmed_increments"] += 1
        waiting = "; ".join(
            f"{Opcode(s.opcode).name} 0x{s.addr:x} ({s.length} B, node {self.plan.node_of(s.addr)}) "
            f"sent {s.sends}x"
            for s in self.probe.unanswered(start)
        )
        self._sample(
            f"client {self.plan.index}: batch of {len(ops)} operations not acknowledged at "
            f"t={start:.3f}: {exc}" + (f" [unanswered: {waiting}]" if waiting else "")
        )
        time.sleep(self.settings.quiesce_s)

    def _sample(self, message: str) -> None:
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(message)


def client_main(conn: Connection) -> None:
    """Entry point of a client process: wait for its plan, fill its region, report ready, run
    until the deadline, report. (Spawned before the cluster exists: imports overlap start-up.)"""
    index = -1
    try:
        tag, body = conn.recv()
        if tag != "plan":
            return
        plan, settings = body
        index = plan.index
        client = SoakClient(plan, settings)
        try:
            client.fill()
            conn.send(("ready", None))
            tag, deadline = conn.recv()
            if tag != "go":
                return
            client.run(float(deadline))
            conn.send(("done", client.report()))
        finally:
            client.close()
    except BaseException as exc:  # the parent reports it; a child has nobody else to tell
        with contextlib.suppress(Exception):
            conn.send(("error", f"client {index}: {type(exc).__name__}: {exc}"))
