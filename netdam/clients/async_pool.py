"""asyncio pool client (asyncio-dgram): the same operations as ``netdam.clients.pool.PoolClient``.

One unconnected datagram socket (replies come from the nodes, not from the VIP); a reader task
matches replies to waiting requests by transaction id. Every coroutine may run concurrently:
at most ``window`` requests are in flight, retries re-send the same transaction id (at most
once per node, SPEC.md section 7), and transaction ids stay within 192 of the oldest
unanswered one. Tagged regions as in PoolClient: requests under an rkey of ``tag_keys`` are
sealed, and only replies sealed under the same key are taken.

    async with await AsyncPoolClient.open(vip) as pool:
        await pool.write(gaddr, b"hello", rkey)
        old = await pool.fetch_add(gaddr + 64, 1, rkey)
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace

import asyncio_dgram

from netdam.clients.pool import (
    TXN_SPAN,
    PoolError,
    PoolTimeout,
    TaggedRegion,
    cas_packet,
    fetch_add_packet,
    needs_token,
    random_client_id,
    split,
)
from netdam.kernels.tag import seal_bytes, verify_bytes
from netdam.protocol.constants import (
    DEFAULT_MTU,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    Flags,
    Opcode,
    largest_payload,
    max_payload,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import (
    REPLY_IDS,
    REPLY_IDS_OFFSET,
    Endpoint,
    Packet,
    decode_packet,
    encode_packet,
    with_retry_flag,
)
from netdam.protocol.payloads import unpack_u64


class AsyncPoolClient:
    """asyncio client of the pool at a VIP; create with ``await AsyncPoolClient.open(vip)``."""

    def __init__(
        self,
        stream: asyncio_dgram.aio.DatagramServer,
        vip: Endpoint,
        client_id: int,
        timeout: float,
        retries: int,
        window: int,
    ) -> None:
        self.vip = vip
        self.client_id = client_id
        self.max_payload = MAX_PAYLOAD_BYTES
        self.tagged_payload = MAX_PAYLOAD_BYTES  # a tagged region's pieces: room for the tag
        self.codec_payload = MAX_PAYLOAD_BYTES  # what the codec lets a datagram carry
        self.timeout = timeout
        self.retries = retries
        self._stream = stream
        self._window = asyncio.Semaphore(window)
        self._waiting: dict[int, asyncio.Future[Packet]] = {}
        self._open: set[int] = set()  # unwrapped ids of unanswered requests
        self._next = 1
        self._progress = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self.retransmits = 0
        #: The switch's address-validation token for this socket (SPEC.md 12.4), from a PING
        #: before the first READ; READs carry it in aux_addr. None: not asked yet.
        self.token: int | None = None
        self._token_lock = asyncio.Lock()
        #: rkey -> tag key of each tagged region this client uses (SPEC.md 2.6).
        self.tag_keys: dict[int, bytes] = {}
        self._keys: dict[int, bytes] = {}  # txn -> the key its reply must be sealed under
        #: Answers to sealed requests that were not sealed under their key: ignored.
        self.unsealed = 0
        self._unsealed_seen = ""

    def add_region(self, region: TaggedRegion) -> None:
        """Use *region*'s tag key for its rkey (nothing for an untagged region)."""
        if region.tag_key:
            self.tag_keys[region.rkey] = region.tag_key

    @classmethod
    async def open(
        cls,
        vip: Endpoint,
        *,
        client_id: int | None = None,
        timeout: float = 0.05,
        retries: int = 20,
        window: int = 32,
        bind: str = "0.0.0.0",
        mtu: int = DEFAULT_MTU,
        tag_keys: Mapping[int, bytes] | None = None,
    ) -> AsyncPoolClient:
        """*mtu*: the cluster's (its file's `mtu`); reads and writes are split to fit it.
        *tag_keys*: rkey -> tag key of the tagged regions it uses."""
        stream = await asyncio_dgram.bind((bind, 0))
        client = cls(stream, vip, client_id or random_client_id(), timeout, retries, window)
        client.max_payload = max_payload(mtu)
        client.tagged_payload = max_payload(mtu, tagged=True)
        client.codec_payload = largest_payload(mtu)
        client.tag_keys.update(tag_keys or {})
        return client

    async def close(self) -> None:
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, asyncio_dgram.TransportClosed):
            pass
        self._stream.close()

    async def __aenter__(self) -> AsyncPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ operations

    async def read(self, addr: int, length: int, rkey: int, *, stride: int = 0) -> bytes:
        replies = await asyncio.gather(
            *(
                self.request(Packet(Opcode.READ, rkey=rkey, addr=a, length=n))
                for a, n in split(addr, length, stride, self._limit(rkey))
            )
        )
        return b"".join(r.payload for r in replies)

    async def write(self, addr: int, data: bytes, rkey: int, *, stride: int = 0) -> None:
        await asyncio.gather(
            *(
                self.request(
                    Packet(
                        Opcode.WRITE,
                        flags=Flags.ACK_REQ,
                        rkey=rkey,
                        addr=a,
                        length=n,
                        payload=data[a - addr : a - addr + n],
                    )
                )
                for a, n in split(addr, len(data), stride, self._limit(rkey))
            )
        )

    def _limit(self, rkey: int) -> int:
        return int(
            min(self.max_payload, self.tagged_payload)
            if rkey in self.tag_keys
            else self.max_payload
        )

    async def fetch_add(self, addr: int, addend: int, rkey: int) -> int:
        reply = await self.request(fetch_add_packet(addr, addend, rkey))
        return int(unpack_u64(reply.payload))

    async def cas(self, addr: int, compare: int, swap: int, rkey: int) -> int:
        reply = await self.request(cas_packet(addr, compare, swap, rkey))
        return int(unpack_u64(reply.payload))

    async def read_many(self, requests: Sequence[tuple[int, int, int]]) -> list[bytes]:
        replies = await asyncio.gather(
            *(self.request(Packet(Opcode.READ, rkey=k, addr=a, length=n)) for a, n, k in requests)
        )
        return [r.payload for r in replies]

    # ------------------------------------------------------------------ one request

    async def request(self, packet: Packet) -> Packet:
        """Send *packet* (ids replaced) and return its reply; retries on timeout, NACK raises.
        A READ carries the address-validation token (asked for once, with a PING)."""
        if needs_token(packet) and packet.aux_addr == 0:
            if self.token is None:
                async with self._token_lock:
                    if self.token is None:
                        self.token = (await self.request(Packet(Opcode.PING))).aux_addr
            packet = replace(packet, aux_addr=self.token)
        async with self._window:
            while self._open and self._next - min(self._open) >= TXN_SPAN:
                self._progress.clear()
                await self._progress.wait()
            seq = self._next
            self._next += 1
            txn = seq & 0xFFFFFFFF
            data = encode_packet(
                replace(packet, client_id=self.client_id, txn_id=txn), self.codec_payload
            )
            key = self.tag_keys.get(packet.rkey, b"") if packet.opcode != Opcode.PING else b""
            future: asyncio.Future[Packet] = asyncio.get_running_loop().create_future()
            self._waiting[txn] = future
            if key:
                self._keys[txn] = key
            self._open.add(seq)
            try:
                for attempt in range(self.retries + 1):
                    if attempt == 1:
                        data = with_retry_flag(data)
                    if attempt:
                        self.retransmits += 1
                    await self._stream.send(seal_bytes(key, data) if key else data, self.vip)
                    try:
                        reply = await asyncio.wait_for(asyncio.shield(future), self.timeout)
                    except asyncio.TimeoutError:
                        continue
                    if reply.opcode == Opcode.NACK:
                        text = (
                            f" ({reply.payload.decode(errors='replace')})" if reply.payload else ""
                        )
                        raise PoolError(
                            f"{packet.opcode.name} at 0x{packet.addr:x} refused: "
                            f"{reply.status.name}{text}",
                            reply.status,
                        )
                    return reply
                if key and self._unsealed_seen:
                    raise PoolTimeout(
                        f"no sealed answer from the pool at {self.vip[0]}:{self.vip[1]} after "
                        f"{self.retries + 1} tries; {self.unsealed} unsealed answer(s) were ignored, "
                        f"the last {self._unsealed_seen}: is the region freed, or its tag key "
                        "wrong?"
                    )
                sealed = (
                    (
                        ", and is the region's tag key right (a request with a wrong tag is dropped "
                        "unanswered, SPEC 2.6)"
                    )
                    if key
                    else ""
                )
                raise PoolTimeout(
                    f"no answer from the pool at {self.vip[0]}:{self.vip[1]} after "
                    f"{self.retries + 1} tries of {self.timeout * 1000:.0f} ms: is the "
                    f"switch running (netdam up --switch){sealed}?"
                )
            finally:
                self._waiting.pop(txn, None)
                self._keys.pop(txn, None)
                self._open.discard(seq)
                self._progress.set()

    async def _read_loop(self) -> None:
        while True:
            data, _ = await self._stream.recv()
            if len(data) < HEADER_SIZE:
                continue
            client, txn = REPLY_IDS.unpack_from(data, REPLY_IDS_OFFSET)
            future = self._waiting.get(txn)
            if client != self.client_id or future is None or future.done():
                continue
            key = self._keys.get(txn)
            if key and not verify_bytes(key, data):
                self.unsealed += 1  # not from a holder of the region's key: not taken
                try:
                    seen = decode_packet(data, self.codec_payload)
                    self._unsealed_seen = f"{seen.opcode.name} {seen.status.name}"
                except RemoteProtocolError:
                    self._unsealed_seen = "a malformed datagram"
                continue
            try:
                future.set_result(decode_packet(data, self.codec_payload))
            except RemoteProtocolError:
                continue
