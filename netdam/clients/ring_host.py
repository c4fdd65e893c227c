"""The host-ring baseline (``--algo ring-host``): all-reduce the RoCE way.

The NICs only move data; every reduction runs on a host after the data landed in host memory.
Each rank's host runs a ring: at reduce-scatter step s it WRITEs block (r-1-s) mod N of its
buffer into the next node's receive area (packets built and sent by the same batched kernels as
everything else, a credit window of ACKed WRITEs), tells the next host the step is there, and
waits for the previous host's word; then it copies the received block from its node's memory
into host memory (the DMA crossing, counted in ``host_copy_bytes``) and combines it into its
buffer with the same numba kernel the NICs use. N-1 all-gather steps move the reduced blocks
the same way. Block j is folded in the order j+1, j+2, ..., j, as the chain folds it, so both
algorithms give bitwise the same result.

One thread per rank plays that rank's host (the combine kernel and the socket calls release the
GIL); what differs from the chain is only where the combine runs.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

from netdam.api import ProcessGroup, _wire_dtype
from netdam.kernels.combine import combine
from netdam.kernels.udp_io import (
    MAX_MSGS,
    SEND_SCRATCH_WORDS_PER_MSG,
    STATE_LEN,
    recv_batch,
    send_batch,
)
from netdam.protocol.constants import ELEMENT_SIZE, Flags, Opcode, ReduceOp, max_elements
from netdam.protocol.packet import HEADER_STRUCT, Endpoint, Packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import pack_ring_step, unpack_ring_step

#: WRITEs in flight per host.
WINDOW = 64


@dataclass
class RingResult:
    seconds: float
    host_copy_bytes: int
    packets: int
    #: UDP payload bytes the hosts sent (WRITEs; the nodes' ACKs are in the node counters).
    payload_bytes: int


def ring_all_reduce(groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp,
                    timeout_s: float = 60.0) -> RingResult:  # fmt: skip
    """All-reduce *buffers* (one per rank, in place) with the host ring; all ranks at once."""
    world = len(groups)
    hosts = [_RingHost(g, buffers[g.rank], op, world) for g in groups]
    for host in hosts:
        host.peer = hosts[(host.rank + 1) % world].address
    errors: list[BaseException] = []

    def run(host: _RingHost) -> None:
        try:
            host.run(timeout_s)
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in hosts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    seconds = time.perf_counter() - start
    for host in hosts:
        host.close()
    if errors:
        raise RuntimeError(f"ring-host all-reduce failed: {errors[0]}")
    return RingResult(seconds, sum(h.host_copy_bytes for h in hosts), sum(h.packets for h in hosts),
                      sum(h.payload_bytes for h in hosts))  # fmt: skip


class _RingHost:
    def __init__(self, group: ProcessGroup, buf: np.ndarray, op: ReduceOp, world: int) -> None:
        self.group = group
        self.rank = group.rank
        self.world = world
        self.buf = buf
        self.raw = buf.reshape(-1).view(np.uint8)
        self.op = op
        self.dtype = _dtype_code(buf)
        self.esize = ELEMENT_SIZE[self.dtype]
        self.count = buf.size
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.address: Endpoint = self.sock.getsockname()
        self.peer: Endpoint = self.address
        self.next_node = group.cluster.nodes[(self.rank + 1) % world].endpoint
        self.recv_base = group.memory.shape[0] // 2  # this node's receive area
        self.per_packet = max_elements(group.cluster.mtu, self.dtype) * self.esize
        self.host_copy_bytes = 0
        self.packets = 0
        self.payload_bytes = 0
        self.steps_heard: set[int] = set()
        self.scratch = np.zeros(MAX_MSGS * SEND_SCRATCH_WORDS_PER_MSG, np.int64)
        self.state = np.zeros(STATE_LEN, np.int64)
        self.rx = np.zeros(4 << 20, np.uint8)
        self.rx_off = np.zeros(4096, np.int64)
        self.rx_len = np.zeros(4096, np.int32)
        self.rx_src = np.zeros(4096, np.uint64)
        self.acked = 0

    def close(self) -> None:
        self.sock.close()

    def block(self, j: int) -> tuple[int, int]:
        """Byte range of block j in the buffer (the chain's layout)."""
        lo, hi = j * self.count // self.world, (j + 1) * self.count // self.world
        return lo * self.esize, hi * self.esize

    def run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        n = self.world
        for step in range(2 * (n - 1)):
            reduce_phase = step < n - 1
            s = step if reduce_phase else step - (n - 1)
            send_block = (self.rank - 1 - s) % n if reduce_phase else (self.rank - s) % n
            recv_block = (self.rank - 2 - s) % n if reduce_phase else (self.rank - 1 - s) % n
            # One receive area per phase: within a phase every step moves a different block, so
            # a host running ahead never overwrites data its successor has not copied yet.
            area = self.recv_base + (0 if reduce_phase else self.raw.shape[0])
            self._write_block(send_block, step, area, deadline)
            self.sock.sendto(pack_ring_step(step), self.peer)
            self._wait_step(step, deadline)
            lo, hi = self.block(recv_block)
            landed = self.group.memory[area + lo : area + hi]
            host_copy = np.array(landed)  # the data crosses into host memory
            self.host_copy_bytes += host_copy.nbytes
            if reduce_phase:  # the host reduces: payload op local, as each chain hop does
                combine(host_copy, host_copy, self.raw[lo:hi], self.dtype, int(self.op))
                self.raw[lo:hi] = host_copy
            else:
                self.raw[lo:hi] = host_copy

    def _write_block(self, j: int, step: int, area: int, deadline: float) -> None:
        """WRITE block j into the next node's receive area, at most WINDOW unACKed."""
        lo, hi = self.block(j)
        packets: list[bytes] = []
        for start in range(lo, hi, self.per_packet):
            end = min(start + self.per_packet, hi)
            packets.append(encode_packet(Packet(
                Opcode.WRITE, flags=Flags.ACK_REQ, seq=step, txn_id=len(packets), rkey=self.group.rkey,
                addr=area + start, dtype=self.dtype, length=end - start,
                payload=self.raw[start:end].tobytes(),
            )))  # fmt: skip
        self.packets += len(packets)
        self.payload_bytes += sum(len(p) for p in packets)
        sent = self.acked = 0
        while self.acked < len(packets):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: WRITEs of step {step} not ACKed")
            burst = packets[sent : sent + max(0, WINDOW - (sent - self.acked))]
            if burst:
                self._send(burst)
                sent += len(burst)
            self._receive(50)

    def _send(self, packets: list[bytes]) -> None:
        lens = np.array([len(p) for p in packets], np.int32)
        offs = np.zeros(len(packets), np.int64)
        offs[1:] = np.cumsum(lens[:-1])
        buf = np.frombuffer(b"".join(packets), np.uint8).copy()
        dsts = np.full(len(packets), endpoint_to_u64(self.next_node), np.uint64)
        done = 0
        while done < len(packets):
            done += int(send_batch(self.sock.fileno(), buf, offs[done:], lens[done:], dsts[done:],
                                    len(packets) - done, self.scratch, self.state))  # fmt: skip

    def _receive(self, timeout_ms: int) -> None:
        got = int(recv_batch(self.sock.fileno(), self.rx, self.rx_off, self.rx_len, self.rx_src,
                              4096, timeout_ms, self.state))  # fmt: skip
        for k in range(got):
            start = int(self.rx_off[k])
            datagram = self.rx[start : start + self.rx_len[k]]
            step = unpack_ring_step(bytes(datagram[:8]))
            if step is not None:
                self.steps_heard.add(step)
            elif datagram.shape[0] >= HEADER_STRUCT.size and datagram[1] == Opcode.ACK:
                self.acked += 1
            elif datagram.shape[0] >= HEADER_STRUCT.size and datagram[1] == Opcode.NACK:
                raise RuntimeError(f"rank {self.rank}: a WRITE was refused (status {int(datagram[50])})")

    def _wait_step(self, step: int, deadline: float) -> None:
        while step not in self.steps_heard:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: step {step} of the previous host never came")
            self._receive(50)


def _dtype_code(buf: np.ndarray):  # type: ignore[no-untyped-def]

    return _wire_dtype(buf)
