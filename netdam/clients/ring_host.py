"""The host-ring baseline (``--algo ring-host``): all-reduce the RoCE way, as a good host library
runs it.

The NICs only move data; every reduction runs on a host CPU, in memory the NIC wrote. That is
RoCE: an RDMA WRITE lands in the peer's registered host memory, and the peer's CPU reduces it
there. Here node memory is that registered memory: it is mapped into the host process (the
shared mapping), so a host reads what its node received with no copy, as a RoCE host reads its
registered buffer.

Each rank's host runs Gloo's ring (``gloo/allreduce_ring_chunked.h``) / MPI's segmented ring
(OpenMPI ``coll_base_allreduce.c``, ``ompi_coll_base_allreduce_intra_ring_segmented``): blocks
cut into segments, each segment forwarded as soon as it is reduced, so reduction of one segment
overlaps the transfer of the next.

- Reduce-scatter, steps s = 0..N-2: rank r WRITEs block (r-1-s) mod N to the next node's receive
  area (step 0 from its own input, later steps the partial it just reduced there), segment by
  segment; once a segment's WRITEs are ACKed it tells the next host (RING_STEP word: step,
  segment). The next host reduces that segment in place in its receive area, ``partial op
  local``, the order every chain hop uses, so block j is folded j+1, j+2, ..., j and the result
  is bitwise the chain's.
- All-gather, N-1 steps: the owner of a finished segment WRITEs it straight into the next rank's
  output buffer (RDMA WRITE to the peer's buffer, addresses exchanged at setup), which forwards
  it the same way.

WRITE datagrams are built by ``netdam.kernels.host_ring`` (the NIC's DMA read) and sent with the
batched GSO path every datagram uses; the ACKs come back through a ``UDP_GRO`` socket, a run of
them per receive, as a RoCE NIC hands its host completions, not packets. One thread per rank
plays that rank's host (kernels and socket calls release the GIL), as the chain's driver plays
every rank's host.

Registration, as a RoCE library does it: the library registers the buffer it is given (Gloo's
ibverbs pairs, UCX's registration cache), so the NIC reads the input where it lies and the
peer's RDMA WRITEs land in registered memory. Here the WRITEs of the input are built straight
from the caller's array, and the owner of a block stores its final sum there; what the other
NICs wrote (the all-gather's blocks) is in node memory, and a caller's array that is not
NIC-resident (``netdam.empty``) gets it copied out inside the timed call. The chain stages the
whole input in and the whole result out (``netdam.all_reduce``), since its nodes read the input.

Who may send to a host's socket: its next node (the ACKs and NACKs of its WRITEs) and the
previous host (step words). Anything else is dropped unread and counted (``RingResult.ignored``):
an unprivileged local process cannot forge a loopback source address, so it cannot make a host
reduce a segment before its data came, nor tell the next host early with forged ACKs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from netdam.api import ProcessGroup, wire_dtype
from netdam.kernels.combine import combine
from netdam.kernels.host_ring import sort_replies, write_headers
from netdam.kernels.udp_io import STATE_LEN, new_gather_scratch, recv_batch, send_gather
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    HEADER_SIZE,
    Flags,
    Opcode,
    ReduceOp,
    max_elements,
)
from netdam.protocol.layout import H_OPCODE, H_STATUS
from netdam.protocol.packet import Endpoint, Packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import RING_STEP, pack_ring_step, unpack_ring_step
from netdam.shell.udp import open_udp_socket

#: Segment of the pipelined ring: OpenMPI's segmented ring uses 1 MiB segments for large
#: messages (coll_tuned's allreduce decision, ``segsize`` 1 << 20).
SEGMENT_BYTES = 1 << 20
#: Receive-area alignment in node memory.
RECEIVE_ALIGN = 4096


@dataclass
class RingResult:
    seconds: float
    #: Bytes the hosts copied besides what the NICs wrote into node memory (copied out for a
    #: caller's array that is not NIC-resident): each owner's finished block, from its receive
    #: area into its output buffer.
    host_copy_bytes: int
    packets: int
    #: UDP payload bytes the hosts sent (WRITEs; the nodes' ACKs are in the node counters).
    payload_bytes: int
    #: Datagrams the hosts dropped unread: not an ACK or NACK from the next node, nor a step
    #: word from the previous host (SPEC.md has no ring-host wire: these are its only senders).
    ignored: int = 0


def ring_all_reduce(
    groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp, timeout_s: float = 60.0
) -> RingResult:
    """All-reduce *buffers* (one per rank, in place) with the host ring; all ranks at once."""
    return _run(_ring_hosts(groups, buffers, op), timeout_s)


def _ring_hosts(
    groups: list[ProcessGroup], buffers: list[np.ndarray], op: ReduceOp
) -> list[_RingHost]:
    """Every rank's host, each told its successor's socket and buffers and its predecessor's
    socket (the only one whose step words it takes)."""
    world = len(groups)
    hosts: list[_RingHost] = []
    try:
        for g in groups:
            hosts.append(_RingHost(g, buffers[g.rank], op, world))
    except BaseException:
        for host in hosts:  # the ranks made before the one refused: their sockets are open
            host.close()
        raise
    for host in hosts:
        successor = hosts[(host.rank + 1) % world]
        host.peer = successor.address
        host.next_out = successor.out
        host.next_recv = successor.recv
        host.prev_word = endpoint_to_u64(hosts[(host.rank - 1) % world].address)
    return hosts


def _run(hosts: list[_RingHost], timeout_s: float) -> RingResult:
    """Run every host in a thread of its own; close them; the result, or the first error."""
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
    return RingResult(
        seconds,
        sum(h.host_copy_bytes for h in hosts),
        sum(h.packets for h in hosts),
        sum(h.payload_bytes for h in hosts),
        sum(h.ignored for h in hosts),
    )


class _RingHost:
    def __init__(self, group: ProcessGroup, buf: np.ndarray, op: ReduceOp, world: int) -> None:
        if not buf.flags.c_contiguous:
            raise ValueError("ring-host reduces C-contiguous arrays in place")
        self.group = group
        self.rank = group.rank
        self.world = world
        self.mem = group.memory
        self.op = int(op)
        self.dtype = int(wire_dtype(buf))
        self.esize = ELEMENT_SIZE[self.dtype]
        self.count = buf.size
        self.nbytes = buf.nbytes
        resident = group._offset_of(buf)
        self.staged = resident is None
        #: The caller's array as bytes: the input WRITEs are built from, the output. A RoCE
        #: library registers the buffer it is given (Gloo's ibverbs pairs, UCX's registration
        #: cache), so its NIC reads the input where it lies, with no staging copy.
        self.input = buf.reshape(-1).view(np.uint8)
        staging = group.staging_base
        #: Where this rank's buffer lives in node memory (the staging area when not resident).
        self.out = resident if resident is not None else staging
        #: Where the previous host's reduce-scatter WRITEs land.
        self.recv = staging + (self.nbytes + RECEIVE_ALIGN - 1) // RECEIVE_ALIGN * RECEIVE_ALIGN
        if self.recv + self.nbytes > group.arena_end:
            raise MemoryError(
                f"ring-host needs {2 * self.nbytes} bytes in the staging half of the rank's arena "
                f"({group.arena_end - staging} bytes): start nodes with more --memory"
            )
        self.sock = open_udp_socket(("127.0.0.1", 0), rcvbuf=8 << 20, gro=True)
        self.address: Endpoint = self.sock.getsockname()
        self.peer: Endpoint = self.address
        #: The previous host's socket (endpoint_to_u64): the only sender of step words.
        self.prev_word = endpoint_to_u64(self.address)
        self.next_out = 0
        self.next_recv = 0
        self.next_node = group.cluster.nodes[(self.rank + 1) % world].endpoint
        self.per_packet = max_elements(group.cluster.mtu, self.dtype) * self.esize
        # The header every WRITE starts from (txn_id, length and addr are set per datagram).
        one = bytes(self.esize)
        self.template = np.frombuffer(
            encode_packet(
                Packet(
                    Opcode.WRITE,
                    flags=Flags.ACK_REQ,
                    rkey=group.arena_key_of((self.rank + 1) % world),
                    dtype=self.dtype,
                    length=len(one),
                    payload=one,
                )
            ),
            np.uint8,
        )[:HEADER_SIZE].copy()
        per_segment = -(-SEGMENT_BYTES // self.per_packet)
        #: One segment's WRITE headers, and where each payload lies in its source.
        self.heads = np.zeros(per_segment * HEADER_SIZE, np.uint8)
        self.body_off = np.zeros(per_segment, np.int64)
        self.body_len = np.zeros(per_segment, np.int32)
        self.next_node_word = endpoint_to_u64(self.next_node)
        self.scratch = new_gather_scratch()
        self.state = np.zeros(STATE_LEN, np.int64)
        self.rx = np.zeros(4 << 20, np.uint8)
        self.rx_off = np.zeros(4096, np.int64)
        self.rx_len = np.zeros(4096, np.int32)
        self.rx_src = np.zeros(4096, np.uint64)
        self.others = np.zeros(4096, np.int64)
        self.heard: set[tuple[int, int]] = set()
        #: Datagrams from anyone else, dropped (RingResult.ignored).
        self.ignored = 0
        #: Segments posted and not yet ACKed whole: (ACK count that completes it, step, segment),
        #: in posting order (the node ACKs in arrival order, one ACK per WRITE).
        self.pending: deque[tuple[int, int, int]] = deque()
        self.acked = 0
        self.txn = 0
        self.host_copy_bytes = 0
        self.packets = 0
        self.payload_bytes = 0

    def close(self) -> None:
        self.sock.close()

    def segments(self, j: int) -> list[tuple[int, int]]:
        """Byte ranges (relative to the buffer) of block j's segments (the chain's blocks)."""
        lo = j * self.count // self.world * self.esize
        hi = (j + 1) * self.count // self.world * self.esize
        step = max(SEGMENT_BYTES // self.esize * self.esize, self.esize)
        return [(a, min(a + step, hi)) for a in range(lo, hi, step)]

    def run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        n, r, mem, data = self.world, self.rank, self.mem, self.input
        # Reduce-scatter step 0: this rank's own block r-1, read where it lies.
        for k, (lo, hi) in enumerate(self.segments((r - 1) % n)):
            self._send_segment(data, lo, self.next_recv + lo, hi - lo, 0, k, deadline)
        for s in range(n - 1):
            for k, (lo, hi) in enumerate(self.segments((r - 2 - s) % n)):
                self._wait(s, k, deadline)
                area = mem[self.recv + lo : self.recv + hi]
                combine(area, area, data[lo:hi], self.dtype, self.op)
                if s < n - 2:
                    self._send_segment(
                        mem, self.recv + lo, self.next_recv + lo, hi - lo, s + 1, k, deadline
                    )
                else:  # this rank owns the block: final here; all-gather step 0 starts
                    data[lo:hi] = area  # its input of this block was read for the last time
                    self.host_copy_bytes += hi - lo
                    self._send_segment(
                        mem, self.recv + lo, self.next_out + lo, hi - lo, n - 1, k, deadline
                    )
        # All-gather: a block the previous NIC wrote is forwarded, then (for a caller's array
        # not in node memory) copied out at once, while the next segment is still in flight.
        for t in range(n - 1):
            for k, (lo, hi) in enumerate(self.segments((r - 1 - t) % n)):
                self._wait(n - 1 + t, k, deadline)
                if t < n - 2:
                    self._send_segment(
                        mem, self.out + lo, self.next_out + lo, hi - lo, n + t, k, deadline
                    )
                if self.staged:
                    data[lo:hi] = mem[self.out + lo : self.out + hi]
        while self.pending:  # the next host still waits for word of our last segments
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: WRITEs of step {self.pending[0][1]} not ACKed"
                )
            self._receive(50)

    def _send_segment(
        self,
        source: np.ndarray,
        src: int,
        dst: int,
        nbytes: int,
        step: int,
        segment: int,
        deadline: float,
    ) -> None:
        """Post the WRITEs of source[src : src + nbytes] to the next node at *dst* and return: once
        every one is ACKed, :meth:`_receive` tells the next host that (step, segment) is in
        place. Meanwhile this host reduces the segments arriving from the previous host, as a
        verbs host posts a WRITE and polls its completion queue later (the overlap of Gloo's
        and OpenMPI's segmented rings)."""
        count = write_headers(
            self.template,
            source.shape[0],
            src,
            dst,
            nbytes,
            self.per_packet,
            self.txn,
            self.heads,
            self.body_off,
            self.body_len,
        )
        self.txn += count
        self.packets += count
        self.payload_bytes += nbytes + count * HEADER_SIZE
        target = (self.pending[-1][0] if self.pending else self.acked) + count
        self.pending.append((target, step, segment))
        done = 0
        while done < count:
            done += send_gather(
                self.sock.fileno(),
                self.heads[done * HEADER_SIZE :],
                HEADER_SIZE,
                source,
                self.body_off[done:],
                self.body_len[done:],
                self.next_node_word,
                count - done,
                self.scratch,
                self.state,
            )
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: cannot send the WRITEs of step {step}")

    def _wait(self, step: int, segment: int, deadline: float) -> None:
        while (step, segment) not in self.heard:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: segment {segment} of step {step} never came")
            self._receive(50)
        self.heard.discard((step, segment))

    def _receive(self, timeout_ms: int) -> None:
        got = recv_batch(
            self.sock.fileno(),
            self.rx,
            self.rx_off,
            self.rx_len,
            self.rx_src,
            4096,
            timeout_ms,
            self.state,
        )
        acks, n_others = sort_replies(
            self.rx, self.rx_off, self.rx_len, self.rx_src, got, self.next_node_word, self.others
        )
        self.acked += acks  # counted compiled: a Python loop over the ACKs was 80% of a send
        while self.pending and self.pending[0][0] <= self.acked:
            _, step, segment = self.pending.popleft()
            self.sock.sendto(pack_ring_step(step, segment), self.peer)
        for k in self.others[:n_others]:
            start = int(self.rx_off[k])
            datagram = self.rx[start : start + self.rx_len[k]]
            source = int(self.rx_src[k])
            signal = unpack_ring_step(bytes(datagram[: RING_STEP.size]))
            if source == self.prev_word and signal is not None:
                self.heard.add(signal)
            elif (
                source == self.next_node_word
                and datagram.shape[0] >= HEADER_SIZE
                and datagram[H_OPCODE] == Opcode.NACK
            ):
                raise RuntimeError(
                    f"rank {self.rank}: a WRITE was refused (status {int(datagram[H_STATUS])})"
                )
            else:  # a local process that is not this ring's: a forged step or ACK, or noise
                self.ignored += 1
