"""The send queue of a core (node or switch): datagrams packed back to back in one byte buffer.

Datagram k lies at ``buf[off[k] : off[k] + length[k]]`` and goes to ``dst[k]``; ``off[tail]``
is the next free byte, and ``q = [head, tail]`` marks what is pending. Packing back to back lets
an I/O shell send a run of datagrams to one destination as one GSO message without copying, and
the compiled kernels append to the queue directly (they take these arrays as arguments).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from netdam.kernels.datapath import drain
from netdam.kernels.state import TXQ_HEAD, TXQ_TAIL, Kept, TxQueue
from netdam.protocol import counters as C
from netdam.protocol.constants import DEFAULT_MTU, slot_bytes

#: Room one outgoing datagram may need at the default MTU: header, full SR list, largest payload,
#: tag (SPEC.md 2). A core at another MTU sizes its queue by constants.slot_bytes of it.
SLOT_BYTES = slot_bytes(DEFAULT_MTU)
#: Bound of the queue: beyond it the datapath drops and counts (DROP_TX_FULL).
MAX_TX_QUEUE = 1 << 15


class SendQueue:
    """Pending datagrams of one core; the arrays are replaced when the queue grows."""

    def __init__(self, slots: int, counters: np.ndarray, slot: int = SLOT_BYTES) -> None:
        self.counters = counters
        #: Room one datagram may need (constants.slot_bytes of the core's MTU); the kernels
        #: check it is free before they build a datagram at the tail.
        self.slot = slot
        self._bundle: Kept[TxQueue] = Kept()
        self.buf = np.zeros(slots * slot, np.uint8)
        self.off = np.zeros(slots + 1, np.int64)
        self.len = np.zeros(slots, np.int32)
        self.dst = np.zeros(slots, np.uint64)
        self.q = np.zeros(2, np.int64)
        #: While ``capture`` runs: datagrams the control plane pushes, kept out of the queue.
        self.captured: list[tuple[bytes, int]] | None = None

    @contextmanager
    def capture(self) -> Iterator[list[tuple[bytes, int]]]:
        """Collect what ``push`` is given instead of queuing it: a process shell sends the
        control plane's answers to a management-port request back through that port (which may
        fragment, unlike the data port). What the compiled datapath queues is not captured."""
        self.captured = []
        try:
            yield self.captured
        finally:
            self.captured = None

    def pending(self) -> int:
        """Datagrams waiting."""
        return int(self.q[TXQ_TAIL] - self.q[TXQ_HEAD])

    def reserve(self, n: int) -> None:
        """Make room for n more datagrams: compact the queue, then grow up to MAX_TX_QUEUE."""
        head, tail = int(self.q[TXQ_HEAD]), int(self.q[TXQ_TAIL])
        if head:
            live, base, end = tail - head, int(self.off[head]), int(self.off[tail])
            self.buf[: end - base] = self.buf[base:end]
            self.off[: live + 1] = self.off[head : tail + 1] - base
            self.len[:live] = self.len[head:tail]
            self.dst[:live] = self.dst[head:tail]
            self.q[:] = (0, live)
            tail = live
        need = tail + n + 1  # +1: a punted packet's reply
        cap = self.len.shape[0]
        if need > cap and cap < MAX_TX_QUEUE:
            new_cap = min(MAX_TX_QUEUE, max(need, 2 * cap))
            self.off = _grown(self.off, new_cap + 1)
            self.len = _grown(self.len, new_cap)
            self.dst = _grown(self.dst, new_cap)
        room = int(self.off[tail]) + (min(need, self.len.shape[0]) - tail) * self.slot
        if room > self.buf.shape[0]:
            self.buf = _grown(self.buf, max(room, 2 * self.buf.shape[0]))

    def push(self, data: bytes, dst: int) -> bool:
        """Queue one datagram built in Python; False (and counted) when there is no room."""
        if self.captured is not None:
            self.captured.append((data, dst))
            return True
        self.reserve(1)
        tail = int(self.q[TXQ_TAIL])
        start = int(self.off[tail])
        if tail >= self.len.shape[0] or start + len(data) > self.buf.shape[0]:
            self.counters[C.DROP_TX_FULL] += 1
            return False
        self.buf[start : start + len(data)] = np.frombuffer(data, np.uint8)
        self.len[tail] = len(data)
        self.dst[tail] = dst
        self.off[tail + 1] = start + len(data)
        self.q[TXQ_TAIL] = tail + 1
        return True

    def bundle(self) -> TxQueue:
        """The queue's arrays as the kernels take them (made again when growing replaced them)."""
        return self._bundle.of(TxQueue, self.buf, self.off, self.len, self.dst, self.slot)

    def fill(
        self, out: np.ndarray, out_offs: np.ndarray, out_lens: np.ndarray, out_dsts: np.ndarray
    ) -> int:
        """Copy pending datagrams into a caller's batch (back to back, as many as fit)."""
        head, tail = int(self.q[TXQ_HEAD]), int(self.q[TXQ_TAIL])
        out_q = TxQueue(out, out_offs, out_lens, out_dsts, self.slot)
        count = drain(self.bundle(), head, tail - head, out_q)
        self.sent(count)
        return count

    def sent(self, count: int) -> None:
        """The *count* oldest datagrams left: count them and free their room."""
        if count:
            head = int(self.q[TXQ_HEAD])
            self.counters[C.TX_PACKETS] += count
            self.counters[C.TX_BYTES] += int(self.len[head : head + count].sum())
            self.q[TXQ_HEAD] = head + count
        if self.q[TXQ_HEAD] == self.q[TXQ_TAIL]:
            self.q[:] = 0
            self.off[0] = 0


class QueueOwner:
    """Gives a core (node or switch) its send queue as the kernels take it; the arrays are looked
    up each time because the queue replaces them when it grows."""

    sendq: SendQueue

    @property
    def _txq(self) -> np.ndarray:
        return self.sendq.q

    def tx_bundle(self) -> TxQueue:
        return self.sendq.bundle()

    def pending(self) -> int:
        """Datagrams waiting in the send queue."""
        return self.sendq.pending()

    def sent(self, count: int) -> None:
        """The owner sent the *count* oldest queued datagrams: count them and free their room."""
        self.sendq.sent(count)


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    """A copy of 1-D *array* extended with zeros to *size* elements."""
    grown = np.zeros(size, array.dtype)
    grown[: array.shape[0]] = array
    return grown
