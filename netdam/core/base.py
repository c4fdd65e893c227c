"""What the node and switch cores share: the batch verbs' checks, the send queue's plumbing and
the reply path of the slow path (sans-I/O, like both cores).

A core keeps a send queue (``sendq``), a counters array, an event deque and ``_trusted``: the
endpoints whose return segment it honours (a node trusts its cluster members, the switch its
nodes; SPEC.md 3.1). Subclasses implement ``receive_batch`` and ``_handle_punted``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from netdam.core.sendqueue import QueueOwner
from netdam.kernels.tag import seal_bytes, seal_control_bytes
from netdam.protocol import counters as C
from netdam.protocol.constants import TAG_SIZE, Flags, Opcode, Status
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import (
    Endpoint,
    Packet,
    encode_packet,
    endpoint_to_u64,
    reply_to,
    u64_to_endpoint,
)

#: How many proven control requests a process remembers to refuse their replays from another
#: source (SPEC.md 2.6, "Control tags"): a tag and a source each, about 3 MB when full.
REPLAY_WINDOW = 16_384


class CoreBase(QueueOwner):
    """Batch verbs and reply plumbing common to NodeCore and SwitchCore."""

    counters: np.ndarray
    _events: deque[Any]
    _trusted: set[int]
    #: While the control plane answers a request its control tag proved: the admin tag key
    #: every answer is sealed under (SPEC.md 2.6, "Control tags"); b"" otherwise.
    _seal_key: bytes = b""
    #: The control tags of the last REPLAY_WINDOW proven requests taken, with their source.
    _taken_tags: OrderedDict[bytes, int] | None = None

    def receive_batch(
        self,
        buf: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        srcs: np.ndarray,
        n: int,
        now: float,
    ) -> None:
        raise NotImplementedError

    def _handle_punted(self, data: bytes, src: int) -> None:
        raise NotImplementedError

    def handle_punted(
        self,
        buf: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        srcs: np.ndarray,
        punt: np.ndarray,
        n_punt: int,
    ) -> None:
        """Run the slow path for the datagrams the datapath punted (batch indices in *punt*)."""
        for k in range(n_punt):
            i = int(punt[k])
            self._handle_punted(bytes(buf[offs[i] : offs[i] + lens[i]]), int(srcs[i]))

    def fill_send_batch(
        self,
        out: np.ndarray,
        out_offs: np.ndarray,
        out_lens: np.ndarray,
        out_dsts: np.ndarray,
        now: float,
    ) -> int:
        """Copy queued datagrams into the caller's batch (back to back in ``out``, as many as fit
        in its bytes and its ``out_lens`` slots); return how many."""
        check_batch(out, out_offs, out_lens, out_dsts, out_lens.shape[0])
        return self.sendq.fill(out, out_offs, out_lens, out_dsts)

    def next_event(self) -> Any:
        """The oldest undelivered event, or None."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ one-datagram helpers

    def receive_datagram(self, data: bytes, src: Endpoint, now: float) -> None:
        """Convenience for tests, tools and management ports: a batch of one."""
        buf = np.frombuffer(data, np.uint8).copy() if data else np.zeros(1, np.uint8)
        self.receive_batch(
            buf,
            np.zeros(1, np.int64),
            np.array([len(data)], np.int32),
            np.array([endpoint_to_u64(src)], np.uint64),
            1,
            now,
        )

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Endpoint]]:
        """Drain the whole send queue as (bytes, destination) pairs."""
        count = max(self.pending(), 1)
        out = np.zeros(count * self.sendq.slot, np.uint8)
        offs = np.zeros(count, np.int64)
        lens = np.zeros(count, np.int32)
        dsts = np.zeros(count, np.uint64)
        got = self.fill_send_batch(out, offs, lens, dsts, now)
        return [
            (bytes(out[offs[k] : offs[k] + lens[k]]), u64_to_endpoint(int(dsts[k])))
            for k in range(got)
        ]

    # ------------------------------------------------------------------ the slow path's replies

    def _reserve_tx(self, n: int) -> None:
        self.sendq.reserve(n)

    def _push(self, data: bytes, dst: int) -> None:
        """Queue one datagram built by the control plane."""
        self.sendq.push(self._outgoing(data), dst)

    def _answer(self, seal_key: bytes, respond: Callable[[], None]) -> None:
        """Run *respond*, every datagram it queues sealed under *seal_key* (the admin tag key,
        for a request its control tag proved; b"": as built). SPEC.md 2.6, "Control tags"."""
        self._seal_key = seal_key
        try:
            respond()
        finally:
            self._seal_key = b""

    def _replayed(self, data: bytes, src: int) -> bool:
        """Whether *data*, a request its control tag proved, is a replay: the same datagram
        (the same tag) taken before from another source, dropped and counted. A retry from its
        own source goes on (the duplicate windows answer it). SPEC.md 2.6, "Control tags"."""
        if self._taken_tags is None:
            self._taken_tags = OrderedDict()
        tag = data[-TAG_SIZE:]
        first = self._taken_tags.get(tag)
        if first is not None and first != src:
            self.counters[C.DROP_CONTROL_REPLAYED] += 1
            return True
        self._remember_tag(tag, src)
        return False

    def _remember_tag(self, tag: bytes, src: int) -> None:
        """Control tag *tag* was taken from *src* (the REPLAY_WINDOW newest are kept)."""
        if self._taken_tags is None:
            self._taken_tags = OrderedDict()
        self._taken_tags[tag] = src
        self._taken_tags.move_to_end(tag)
        if len(self._taken_tags) > REPLAY_WINDOW:
            self._taken_tags.popitem(last=False)

    def _outgoing(self, data: bytes) -> bytes:
        """*data* as it leaves: sealed under the admin tag key while answering a request that
        carried a control tag, unless it is sealed already (a collective's answer)."""
        if self._seal_key and not HEADER.read(data, "flags") & Flags.TAGGED:
            return seal_control_bytes(self._seal_key, data)
        return data

    def _reply_dst(self, packet: Packet, src: int) -> int:
        """Where a reply goes: the return segment when a trusted endpoint sent the request."""
        ret = endpoint_to_u64(packet.ret)
        return int(ret) if ret and src in self._trusted else src

    def _reply(
        self,
        request: Packet,
        src: int,
        opcode: Opcode,
        status: Status = Status.OK,
        payload: bytes = b"",
        rkey: int | None = None,
        aux_addr: int | None = None,
        addr: int | None = None,
        tag_key: bytes = b"",
    ) -> bytes:
        """Queue the reply to *request*; sealed under *tag_key* (a collective's, SPEC.md 2.6)."""
        data = encode_packet(
            reply_to(request, opcode, status, payload, rkey=rkey, addr=addr, aux_addr=aux_addr)
        )
        if tag_key:
            data = seal_bytes(tag_key, data)
        self._push(data, self._reply_dst(request, src))
        if status != Status.OK:
            self.counters[C.NACK_BASE + status] += 1
        return bytes(data)

    def _nack(self, request: Packet, src: int, status: Status, tag_key: bytes = b"") -> None:
        self._reply(request, src, Opcode.NACK, status, tag_key=tag_key)


def check_batch(
    buf: np.ndarray, offs: np.ndarray, lens: np.ndarray, addrs: np.ndarray, n: int
) -> None:
    """The kernels trust their arrays: check dtypes, shapes and contiguity once, here."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("batch buffer must be a 1-D C-contiguous uint8 array")
    if offs.dtype != np.int64 or offs.ndim != 1 or not offs.flags.c_contiguous:
        raise ValueError("batch offsets must be a 1-D contiguous int64 array")
    if lens.dtype != np.int32 or lens.ndim != 1 or not lens.flags.c_contiguous:
        raise ValueError("batch lengths must be a 1-D contiguous int32 array")
    if addrs.dtype != np.uint64 or addrs.ndim != 1 or not addrs.flags.c_contiguous:
        raise ValueError("batch addresses must be a 1-D contiguous uint64 array (ip << 16 | port)")
    if not 0 <= n <= min(offs.shape[0], lens.shape[0], addrs.shape[0]):
        raise ValueError(f"batch count {n} exceeds the arrays ({lens.shape[0]} entries)")
