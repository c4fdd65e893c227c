"""Blocking pool client: READ, WRITE, FETCH_ADD, CAS through the switch's VIP, pipelined.

Plain ``socket``: requests go to the VIP, replies come straight from the nodes (the switch put
our address in the return segment), so the socket is *not* connected. Many requests stay in
flight (``window``), matched by transaction id. A request with no answer within ``timeout`` is
re-sent with the *same* transaction id (flag RETRY), so a node executes a mutating request at
most once however often it is retried (SPEC.md section 7): the switch maps a global address to
the same node every time, so the retry meets the same duplicate window.

Transaction ids stay within 192 of the oldest unanswered one, well inside the node's window of
256, so a retried request is never answered STALE.

Tagged regions (SPEC.md 2.6, the pool's default): give the client each region's tag key
(``tag_keys={rkey: key}``, or ``add_region``). A request under such an rkey is sealed, and only
a reply sealed under the same key is taken: an unsealed answer (a forger's, or a NACK from
whoever does not hold the key, such as the switch's NO_ROUTE for a freed region) is ignored,
and named in the timeout's message if nothing else came.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from netdam.kernels.tag import seal_bytes, verify_bytes
from netdam.protocol.constants import (
    AMPLIFICATION_FACTOR,
    DEFAULT_MTU,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    DType,
    Flags,
    Opcode,
    Status,
    largest_payload,
    max_payload,
)
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.packet import (
    REPLY_IDS,
    REPLY_IDS_OFFSET,
    Endpoint,
    Packet,
    decode_packet,
    encode_packet,
    with_retry_flag,
)
from netdam.protocol.payloads import pack_cas, pack_u64, unpack_u64
from netdam.shell.udp import IP_MTU_DISCOVER, IP_PMTUDISC_DO

#: Largest distance between the newest and the oldest unanswered transaction id.
TXN_SPAN = 192


class PoolError(NetdamError):
    """A request was refused (``status`` is the NACK's) or never answered (``status`` None)."""

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        self.status = status


class PoolTimeout(PoolError):
    """No answer after every retry."""


def split(
    addr: int, length: int, stride: int = 0, limit: int = MAX_PAYLOAD_BYTES
) -> list[tuple[int, int]]:
    """(address, length) pieces of [addr, addr+length): at most *limit* bytes, never across a
    multiple of *stride* (interleaved regions; the switch answers SPANS_NODES otherwise)."""
    pieces = []
    end = addr + length
    while addr < end:
        step = min(end - addr, limit)
        if stride:
            step = min(step, stride - addr % stride)
        pieces.append((addr, step))
        addr += step
    return pieces


@dataclass
class _Flight:
    index: int
    seq: int  # the transaction id before wrapping to u32
    data: bytes  # as sent, unsealed (a retry sets RETRY, which the tag covers, and seals anew)
    deadline: float
    tries: int
    key: bytes = b""  # the region's tag key, b"": untagged


class TaggedRegion(Protocol):
    """What add_region reads of a region (netdam.switch.addrmap.Region, payloads.RegionInfo)."""

    rkey: int
    tag_key: bytes


def needs_token(packet: Packet) -> bool:
    """A READ answered with more than 3 times its request's bytes: it needs this socket's
    address-validation token (SPEC.md 12.4), which a PING asks for once. Smaller READs,
    WRITEs and atomics need none, so a client that has not PINGed yet (or cannot: its address
    is locked out by a guesser that shares it, 12.3) still does them."""
    return bool(
        packet.opcode == Opcode.READ
        and HEADER_SIZE + packet.length > AMPLIFICATION_FACTOR * HEADER_SIZE
    )


def tag_keys_of(*regions: TaggedRegion) -> dict[int, bytes]:
    """rkey -> tag key of the tagged ones among *regions* (PoolClient's ``tag_keys``)."""
    return {r.rkey: r.tag_key for r in regions if r.tag_key}


def random_client_id() -> int:
    """A random non-zero client id (the duplicate window keys on (client id, requester))."""
    return int.from_bytes(os.urandom(4), "big") | 1


class PoolClient:
    """Blocking, pipelined client of the pool at *vip*."""

    def __init__(
        self,
        vip: Endpoint,
        *,
        client_id: int | None = None,
        timeout: float = 0.05,
        retries: int = 20,
        window: int = 32,
        bind: str = "0.0.0.0",
        mtu: int = DEFAULT_MTU,
        tag_keys: Mapping[int, bytes] | None = None,
    ) -> None:
        if not 1 <= window <= 128:
            raise ValueError(f"window {window} must be 1..128")
        #: Largest READ/WRITE piece: what one datagram carries at the cluster's MTU (the cluster
        #: file's `mtu`); requests are split to fit, as a NIC splits a transfer into frames. A
        #: tagged region's pieces leave room for the tag (piece_limit).
        self.max_payload = max_payload(mtu)
        self._tagged_payload = max_payload(mtu, tagged=True)
        #: What the codec lets a request or reply carry: the largest payload at the MTU.
        self._codec_payload = largest_payload(mtu)
        self.vip = vip
        self.client_id = client_id or random_client_id()
        self.timeout = timeout
        self.retries = retries
        self.window = window
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # Never fragment (as the nodes): a request over the path MTU fails at once, naming it.
        self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        self.sock.bind((bind, 0))
        self._next_txn = int.from_bytes(os.urandom(3), "big") + 1
        #: Requests re-sent after a timeout (all operations so far).
        self.retransmits = 0
        #: The switch's address-validation token for this socket (SPEC.md 12.4), from a PING
        #: before the first READ; READs carry it in aux_addr. None: not asked yet.
        self.token: int | None = None
        #: rkey -> tag key of each tagged region this client uses (SPEC.md 2.6).
        self.tag_keys: dict[int, bytes] = dict(tag_keys or {})
        #: Answers to sealed requests that were not sealed under their key: ignored.
        self.unsealed = 0
        self._unsealed_seen = ""

    def add_region(self, region: TaggedRegion) -> None:
        """Use *region*'s tag key for its rkey (nothing for an untagged region)."""
        if region.tag_key:
            self.tag_keys[region.rkey] = region.tag_key

    def piece_limit(self, rkey: int) -> int:
        """Largest READ/WRITE piece under *rkey*: max_payload, less the tag's room when tagged."""
        return int(
            min(self.max_payload, self._tagged_payload)
            if rkey in self.tag_keys
            else self.max_payload
        )

    def close(self) -> None:
        self.sock.close()

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendto(data, self.vip)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise PoolError(
                    f"a {len(data)}-byte datagram does not fit the path MTU to "
                    f"{self.vip[0]}: give PoolClient(mtu=...) the cluster's MTU"
                ) from None
            raise

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ operations

    def read(self, addr: int, length: int, rkey: int, *, stride: int = 0) -> bytes:
        """*length* bytes from global address *addr* (split into requests as needed)."""
        pieces = split(addr, length, stride, self.piece_limit(rkey))
        replies = self.execute(
            [Packet(Opcode.READ, rkey=rkey, addr=a, length=n) for a, n in pieces]
        )
        return b"".join(r.payload for r in replies)

    def write(self, addr: int, data: bytes, rkey: int, *, stride: int = 0) -> None:
        """Write *data* at *addr*; returns when every piece is ACKed."""
        pieces = split(addr, len(data), stride, self.piece_limit(rkey))
        self.execute(
            [
                Packet(
                    Opcode.WRITE,
                    flags=Flags.ACK_REQ,
                    rkey=rkey,
                    addr=a,
                    length=n,
                    payload=data[a - addr : a - addr + n],
                )
                for a, n in pieces
            ]
        )

    def fetch_add(self, addr: int, addend: int, rkey: int) -> int:
        """Add *addend* (mod 2^64) to the u64 at *addr*; returns the old value."""
        [reply] = self.execute([fetch_add_packet(addr, addend, rkey)])
        return int(unpack_u64(reply.payload))

    def cas(self, addr: int, compare: int, swap: int, rkey: int) -> int:
        """Swap in *swap* if the u64 at *addr* equals *compare*; returns the old value."""
        [reply] = self.execute([cas_packet(addr, compare, swap, rkey)])
        return int(unpack_u64(reply.payload))

    def read_many(self, requests: Sequence[tuple[int, int, int]]) -> list[bytes]:
        """[(addr, length <= 8192, rkey)] -> their bytes, all pipelined."""
        replies = self.execute(
            [Packet(Opcode.READ, rkey=k, addr=a, length=n) for a, n, k in requests]
        )
        return [r.payload for r in replies]

    def write_many(self, requests: Sequence[tuple[int, bytes, int]]) -> None:
        """[(addr, data <= 8192 bytes, rkey)], all pipelined, each ACKed."""
        self.execute(
            [
                Packet(Opcode.WRITE, flags=Flags.ACK_REQ, rkey=k, addr=a, length=len(d), payload=d)
                for a, d, k in requests
            ]
        )

    # ------------------------------------------------------------------ the pipeline

    def execute(self, packets: Sequence[Packet]) -> list[Packet]:
        """Send every request (client and txn ids replaced), ``window`` in flight; return the
        replies in request order. A NACK raises PoolError; no answer after every retry raises
        PoolTimeout. Requests still in flight then are abandoned (their late replies ignored)."""
        if self.token is None and any(needs_token(p) for p in packets):
            self.token = self.execute([Packet(Opcode.PING)])[0].aux_addr
        replies: list[Packet | None] = [None] * len(packets)
        flight: dict[int, _Flight] = {}
        nxt = 0
        while nxt < len(packets) or flight:
            now = time.monotonic()
            oldest = min((f.seq for f in flight.values()), default=self._next_txn)
            while (
                nxt < len(packets)
                and len(flight) < self.window
                and self._next_txn - oldest < TXN_SPAN
            ):
                seq = self._next_txn
                self._next_txn += 1
                txn = seq & 0xFFFFFFFF
                packet = packets[nxt]
                if packet.opcode == Opcode.READ and packet.aux_addr == 0 and self.token:
                    packet = replace(packet, aux_addr=self.token)
                data = encode_packet(
                    replace(packet, client_id=self.client_id, txn_id=txn), self._codec_payload
                )
                key = self.tag_keys.get(packet.rkey, b"") if packet.opcode != Opcode.PING else b""
                self._send(seal_bytes(key, data) if key else data)
                flight[txn] = _Flight(nxt, seq, data, now + self.timeout, 0, key)
                nxt += 1
            if not flight:
                continue
            wait = min(f.deadline for f in flight.values()) - time.monotonic()
            if wait > 0:
                self.sock.settimeout(wait)
                try:
                    data, _ = self.sock.recvfrom(65536)
                except TimeoutError:
                    data = b""
                if data:
                    self._take(data, flight, replies, packets)
                    continue
            self._resend_due(flight)
        return [r for r in replies if r is not None]

    def _take(
        self,
        data: bytes,
        flight: dict[int, _Flight],
        replies: list[Packet | None],
        packets: Sequence[Packet],
    ) -> None:
        if len(data) < HEADER_SIZE:
            return
        client, txn = REPLY_IDS.unpack_from(data, REPLY_IDS_OFFSET)
        entry = flight.get(txn)
        if client != self.client_id or entry is None:
            return  # a late duplicate, or someone else's
        if entry.key and not verify_bytes(entry.key, data):
            # Not from a holder of the region's key: a forger, or a NACK of the switch that
            # cannot seal (NO_ROUTE, BAD_RKEY). Not taken; the timeout names it.
            self.unsealed += 1
            try:
                seen = decode_packet(data, self._codec_payload)
                self._unsealed_seen = f"{seen.opcode.name} {seen.status.name}"
            except RemoteProtocolError:
                self._unsealed_seen = "a malformed datagram"
            return
        try:
            reply = decode_packet(data, self._codec_payload)
        except RemoteProtocolError:
            return
        del flight[txn]
        if reply.opcode == Opcode.NACK:
            request = packets[entry.index]
            text = f" ({reply.payload.decode(errors='replace')})" if reply.payload else ""
            raise PoolError(
                f"{request.opcode.name} at 0x{request.addr:x} ({request.length} bytes) "
                f"refused: {reply.status.name}{text}",
                reply.status,
            )
        replies[entry.index] = reply

    def _resend_due(self, flight: dict[int, _Flight]) -> None:
        now = time.monotonic()
        for txn, entry in flight.items():
            if entry.deadline > now:
                continue
            if entry.tries >= self.retries:
                if self._unsealed_seen:
                    raise PoolTimeout(
                        f"no sealed answer from the pool at {self.vip[0]}:{self.vip[1]} to txn {txn} "
                        f"after {entry.tries + 1} tries; {self.unsealed} unsealed answer(s) were "
                        f"ignored, the last {self._unsealed_seen}: is the region freed, or its "
                        "tag key (PoolClient tag_keys) wrong?"
                    )
                sealed = (
                    (
                        ", and is the region's tag key right (a request with a wrong tag is dropped "
                        "unanswered, SPEC 2.6)"
                    )
                    if entry.key
                    else ""
                )
                raise PoolTimeout(
                    f"no answer from the pool at {self.vip[0]}:{self.vip[1]} to txn {txn} "
                    f"after {entry.tries + 1} tries of {self.timeout * 1000:.0f} ms: is the "
                    f"switch running (netdam up --switch){sealed}?"
                )
            if entry.tries == 0:
                entry.data = with_retry_flag(entry.data)
            entry.tries += 1
            entry.deadline = now + self.timeout
            self.retransmits += 1
            self._send(seal_bytes(entry.key, entry.data) if entry.key else entry.data)


def fetch_add_packet(addr: int, addend: int, rkey: int) -> Packet:
    return Packet(
        Opcode.FETCH_ADD, rkey=rkey, addr=addr, length=8, dtype=DType.U64, payload=pack_u64(addend)
    )


def cas_packet(addr: int, compare: int, swap: int, rkey: int) -> Packet:
    return Packet(
        Opcode.CAS, rkey=rkey, addr=addr, length=8, dtype=DType.U64, payload=pack_cas(compare, swap)
    )
