"""A small blocking client for control and test traffic: one request, one reply, with a timeout.

Plain ``socket``, no event loop: used by ``netdam stats``/``ping``, cluster start-up and tests.
The pool clients with pipelining and retries come with the switch.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from netdam.cluster.clusterfile import ClusterFile
from netdam.cluster.tenants import TenantKeys, tenant_keys_of
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    COUNTERS_EPOCH,
    COUNTERS_TRACE,
    POOL_OPCODES,
    REGISTER_ANYWHERE,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.errors import NetdamError, ProtocolError, RemoteProtocolError
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import INFO, pack_key_rights, pack_register
from netdam.protocol.tag import is_control, seal_control, verify_control
from netdam.protocol.trace import TracePage, parse_trace_reply

INFO_FIELDS = (
    "version",
    "mtu",
    "memory_bytes",
    "max_payload",
    "max_segments",
    "rank",
    "world_size",
)


class ControlError(NetdamError):
    """A control request failed: timeout (``status`` None) or NACK (``status`` set; ``payload``:
    the NACK's, e.g. the switch allocator's UTF-8 explanation, SPEC.md 11.9)."""

    def __init__(self, message: str, status: int | None = None, payload: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.payload = payload


class ControlClient:
    """Requests to nodes over UDP, matched to replies by transaction id."""

    def __init__(
        self,
        admin_key: int = 0,
        client_id: int | None = None,
        bind: str = "0.0.0.0",
        admin_tag_key: bytes = b"",
        tenant: TenantKeys | None = None,
    ) -> None:
        if admin_tag_key and len(admin_tag_key) != 16:
            raise ValueError(f"the admin tag key is 16 bytes, not {len(admin_tag_key)}")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((bind, 0))
        self.admin_key = admin_key
        #: The cluster's admin tag key (SPEC.md 2.6, "Control tags"): with it, every control
        #: opcode that names the admin key leaves sealed with its control tag instead (rkey 0),
        #: and only answers sealed under the same key are taken.
        self.admin_tag_key = admin_tag_key
        #: A pool tenant's id and tag key (SPEC.md 11.9, "Tenant tags"): with them, ALLOC, FREE
        #: and QUERY without the admin key leave sealed under the tenant's key (rkey its id),
        #: and only answers sealed under it are taken.
        self.tenant = tenant
        #: Answers to sealed requests that were not sealed (a forger, or a process that does
        #: not hold the key): ignored, counted here and named when the request times out.
        self.unsealed = 0
        # Random ids; the duplicate window keys on (client id, requester) anyway (SPEC.md 7).
        self.client_id = (
            client_id if client_id is not None else int.from_bytes(os.urandom(4), "big") | 1
        )
        self._txn = itertools.count(int.from_bytes(os.urandom(2), "big") + 1)
        #: Address-validation tokens by endpoint (SPEC.md 12.4): INFO's aux_addr, sent in READs.
        self.tokens: dict[Endpoint, int] = {}

    @classmethod
    def for_cluster(
        cls, cluster: ClusterFile, client_id: int | None = None, bind: str = "0.0.0.0"
    ) -> ControlClient:
        """A client with *cluster*'s admin key and admin tag key: the admin's."""
        return cls(
            admin_key=cluster.admin_key,
            client_id=client_id,
            bind=bind,
            admin_tag_key=cluster.admin_tag_key,
        )

    @classmethod
    def for_tenant(cls, credential: int, bind: str = "0.0.0.0") -> ControlClient:
        """A client of the pool tenant whose credential is *credential*: its ALLOC, FREE and
        QUERY leave sealed under the tenant's tag key, and the credential never travels."""
        return cls(bind=bind, tenant=tenant_keys_of(credential))

    def close(self) -> None:
        self.sock.close()

    def sealing(self, packet: Packet) -> tuple[bytes, int] | None:
        """The key *packet* leaves sealed under and the rkey it then carries, or None (sent as
        it is): a control opcode naming the admin key, from a client that holds the admin tag
        key, under that key with rkey 0 (SPEC.md 2.6, "Control tags"); a pool request without a
        key, from a tenant's client, under the tenant's tag key with rkey its id (11.9)."""
        if self.admin_tag_key and is_control(packet.opcode) and packet.rkey == self.admin_key != 0:
            return self.admin_tag_key, 0
        if self.tenant is not None and packet.opcode in POOL_OPCODES and packet.rkey == 0:
            return self.tenant.tag_key, self.tenant.id
        return None

    def encode(self, packet: Packet, encoded: bytes | None = None) -> bytes:
        """*packet* as this client sends it: sealed with its control tag when ``sealing`` names
        a key (the admin key or the tenant's credential then stays off the wire), else as it is.
        *encoded*: encode_packet(packet), when the caller has it."""
        data: bytes = encode_packet(packet) if encoded is None else encoded
        sealing = self.sealing(packet)
        if sealing is None:
            return data
        key, rkey = sealing
        sealed = bytearray(data)
        HEADER.write(sealed, "rkey", rkey)  # in the bytes: a Packet copy costs ~11 us a call
        return _seal_control(key, bytes(sealed))

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def answering(
        self, nodes: Sequence[Endpoint], timeout: float = 0.25, rounds: int = 2
    ) -> set[Endpoint]:
        """Which of *nodes* answer PING: every one asked at once, then the silent ones again,
        each round waiting at most *timeout*. A dead node costs the rounds' wait once, however
        many nodes are asked (asking one after another cost it per node, and per dead node)."""
        heard: set[Endpoint] = set()
        for _round in range(rounds):
            asked: dict[int, Endpoint] = {}
            for node in nodes:
                if node not in heard:
                    txn = next(self._txn) & 0xFFFFFFFF
                    asked[txn] = node
                    self.sock.sendto(
                        self.encode(_with_ids(Packet(Opcode.PING), self.client_id, txn)), node
                    )
            if not asked:
                break
            for _, reply in self._replies(time.monotonic() + timeout):
                if reply.client_id == self.client_id and reply.opcode != Opcode.NACK:
                    node = asked.pop(reply.txn_id, None)
                    if node is not None:
                        heard.add(node)
                if not asked:
                    break
        return heard

    def _replies(self, deadline: float) -> Iterator[tuple[bytes, Packet]]:
        """Each datagram that decodes, as it arrives, until *deadline* (time.monotonic()).
        The socket is left in the mode it had: CPython polls before every send on a socket with
        a timeout, and a collective's host sends its START_COLLs on this one (netdam.api: ~6 us
        more a rank's call, 4 x 4 KiB, once a timeout stayed on it)."""
        mode = self.sock.gettimeout()
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                try:
                    reply_bytes, _ = self.sock.recvfrom(65536)
                except TimeoutError:
                    return
                try:
                    yield reply_bytes, decode_packet(reply_bytes)
                except RemoteProtocolError:
                    continue
        finally:
            self.sock.settimeout(mode)

    def request(
        self, node: Endpoint, packet: Packet, timeout: float = 1.0, retries: int = 2
    ) -> Packet:
        """Send *packet* (its txn_id replaced), wait for the reply with the same txn id.

        Retries re-send the same txn id, so a mutating request applies at most once.
        """
        txn = next(self._txn) & 0xFFFFFFFF
        sealing = self.sealing(packet)
        data = self.encode(_with_ids(packet, self.client_id, txn))
        unsealed = self.unsealed
        for _attempt in range(retries + 1):
            # A switch refuses a tenant id it does not know UNAUTHORIZED, unsealed (it has no
            # key to seal with). Taken once this attempt's wait is over and no sealed answer
            # came: a forged refusal cannot overtake the switch's real answer.
            refused: Packet | None = None
            self.sock.sendto(data, node)
            for reply_bytes, reply in self._replies(time.monotonic() + timeout):
                if reply.txn_id == txn and reply.client_id == self.client_id:
                    if sealing is not None and not _verify_control(sealing[0], reply_bytes):
                        self.unsealed += 1
                        if (
                            sealing[1]
                            and reply.opcode == Opcode.NACK
                            and reply.status == Status.UNAUTHORIZED
                        ):
                            refused = reply
                        continue
                    if reply.opcode == Opcode.NACK:
                        raise ControlError(
                            f"{packet.opcode.name} to {node[0]}:{node[1]} refused: {reply.status.name}",
                            int(reply.status),
                            bytes(reply.payload),
                        )
                    return reply
            if refused is not None:
                raise ControlError(
                    f"{packet.opcode.name} to {node[0]}:{node[1]} refused: UNAUTHORIZED, unsealed: it knows no "
                    "tenant with this credential",
                    int(Status.UNAUTHORIZED),
                    bytes(refused.payload),
                )
        ignored = self.unsealed - unsealed
        holder = (
            "the tenant's tag key"
            if sealing is not None and sealing[1]
            else "this cluster's admin tag key"
        )
        why = f" ({ignored} unsealed answers ignored: does it hold {holder}?)" if ignored else ""
        raise ControlError(
            f"no answer from {node[0]}:{node[1]} to {packet.opcode.name} "
            f"within {timeout * (retries + 1):.1f} s{why}: is the node running?"
        )

    def requests(
        self,
        node: Endpoint,
        packets: Sequence[Packet],
        timeout: float = 1.0,
        retries: int = 2,
        window: int = 64,
    ) -> list[Packet]:
        """Send *packets* to *node* (txn_ids replaced), at most *window* unanswered at a time,
        and return each one's answer, ACK or NACK, in order. Unanswered ones go again under the
        same txn_id (so each applies at most once), *retries* times, each wait *timeout*."""
        answers: list[Packet] = []
        for first in range(0, len(packets), window):
            part = packets[first : first + window]
            got = self._exchange([(node, p) for p in part], timeout, retries)
            missing = sum(1 for a in got if a is None)
            if missing:
                raise ControlError(
                    f"no answer from {node[0]}:{node[1]} to {missing} of {len(part)} "
                    f"{packets[first].opcode.name}s within {timeout * (retries + 1):.1f} s: "
                    "is the node running?"
                )
            answers += [a for a in got if a is not None]
        return answers

    def _exchange(
        self,
        asks: Sequence[tuple[Endpoint, Packet]],
        timeout: float,
        retries: int,
        key: bytes | None = None,
    ) -> list[Packet | None]:
        """Send each (node, packet) of *asks* under a txn_id of its own, all at once, and take
        their answers; the unanswered go again under the same txn_id, *retries* times, each
        wait *timeout*. Each one's answer in order, None where none came (or, with *key*, none
        that carries its control tag under it)."""
        answers: list[Packet | None] = [None] * len(asks)
        txns = {next(self._txn) & 0xFFFFFFFF: k for k in range(len(asks))}
        data = {k: self.encode(_with_ids(asks[k][1], self.client_id, t)) for t, k in txns.items()}
        for _attempt in range(retries + 1):
            waiting = [k for k in range(len(asks)) if answers[k] is None]
            if not waiting:
                break
            for k in waiting:
                self.sock.sendto(data[k], asks[k][0])
            left = len(waiting)
            for raw, reply in self._replies(time.monotonic() + timeout):
                k = txns.get(reply.txn_id, -1) if reply.client_id == self.client_id else -1
                if k < 0 or answers[k] is not None:
                    continue
                if key is not None and not _verify_control(key, raw):
                    self.unsealed += 1
                    continue
                answers[k] = reply
                left -= 1
                if not left:
                    break
        return answers

    def ping(self, node: Endpoint, timeout: float = 1.0) -> tuple[dict[str, int], float]:
        """INFO fields of *node* and the round-trip time in seconds."""
        start = time.perf_counter()
        reply = self.request(node, Packet(Opcode.PING), timeout=timeout)
        rtt = time.perf_counter() - start
        values = INFO.unpack(reply.payload)
        return dict(zip(INFO_FIELDS, values, strict=True)), rtt

    def counters(self, node: Endpoint, timeout: float = 1.0, retries: int = 2) -> np.ndarray:
        request = Packet(Opcode.COUNTERS, rkey=self.admin_key)
        reply = self.request(node, request, timeout=timeout, retries=retries)
        values = np.frombuffer(reply.payload, "<u8").astype(np.uint64)
        if values.shape[0] < C.NUM_COUNTERS:
            raise ControlError(
                f"COUNTERS reply from {node[0]}:{node[1]} has {values.shape[0]} values"
            )
        return values[: C.NUM_COUNTERS]  # a switch's reply goes on with its own sections

    def settled_epochs(
        self, nodes: Sequence[Endpoint], coll_id: int, timeout: float = 0.5, retries: int = 1
    ) -> dict[int, int]:
        """The last epoch of collective *coll_id* each of *nodes* settled (the admin's COUNTERS
        with ``aux_addr`` COUNTERS_EPOCH, SPEC.md 6.5, "Epochs"), asked of all at once; by index
        into *nodes*, for those that answered in time under this cluster's admin tag (a node
        that predates the question answers BAD_FIELD and is left out, as a silent one is)."""
        packet = Packet(
            Opcode.COUNTERS, rkey=self.admin_key, coll_id=coll_id, aux_addr=COUNTERS_EPOCH
        )
        sealing = self.sealing(packet)
        answers = self._exchange(
            [(node, packet) for node in nodes],
            timeout,
            retries,
            sealing[0] if sealing is not None else None,
        )
        return {
            k: int(a.aux_addr)
            for k, a in enumerate(answers)
            if a is not None and a.opcode == Opcode.ACK
        }

    def trace_page(self, node: Endpoint, first: int, timeout: float = 1.0) -> TracePage:
        """Records of *node*'s trace ring from number *first* on (SPEC.md 6.7): the admin's
        COUNTERS with ``aux_addr`` COUNTERS_TRACE."""
        request = Packet(Opcode.COUNTERS, rkey=self.admin_key, addr=first, aux_addr=COUNTERS_TRACE)
        reply = self.request(node, request, timeout=timeout)
        try:
            return parse_trace_reply(reply.payload)
        except ProtocolError as exc:
            raise ControlError(f"{node[0]}:{node[1]}: {exc}") from None

    def register(
        self,
        node: Endpoint,
        base: int,
        size: int,
        rights: Rights,
        rkey: int = 0,
        tag_key: bytes = b"",
    ) -> int:
        """REGISTER [base, base+size) (SPEC.md 6.1); returns the rkey. With a 16-byte *tag_key*
        the region is tagged: it takes only datagrams sealed under that key (2.6)."""
        return self._register(node, base, size, rights, rkey, tag_key)[0]

    def register_anywhere(
        self, node: Endpoint, size: int, rights: Rights, rkey: int = 0, tag_key: bytes = b""
    ) -> tuple[int, int]:
        """REGISTER *size* bytes wherever the node has room (SPEC.md 6.1); returns (rkey, base)."""
        return self._register(node, REGISTER_ANYWHERE, size, rights, rkey, tag_key)

    def _register(
        self, node: Endpoint, base: int, size: int, rights: Rights, rkey: int, tag_key: bytes
    ) -> tuple[int, int]:
        payload = pack_register(rkey, int(rights), tag_key)
        reply = self.request(
            node,
            Packet(
                Opcode.REGISTER,
                rkey=self.admin_key,
                addr=base,
                aux_addr=size,
                length=len(payload),
                payload=payload,
            ),
        )
        return int(reply.rkey), int(reply.addr)

    def deregister(self, node: Endpoint, rkey: int, timeout: float = 1.0) -> None:
        """DEREGISTER *rkey* (the node zeroes its bytes)."""
        self.request(
            node,
            Packet(
                Opcode.DEREGISTER, rkey=self.admin_key, length=8, payload=pack_key_rights(rkey, 0)
            ),
            timeout=timeout,
        )

    def write(
        self, node: Endpoint, rkey: int, addr: int, data: bytes, dtype: DType = DType.RAW
    ) -> None:
        self.request(
            node,
            Packet(
                Opcode.WRITE,
                flags=Flags.ACK_REQ,
                rkey=rkey,
                addr=addr,
                dtype=dtype,
                length=len(data),
                payload=data,
            ),
        )

    def read(self, node: Endpoint, rkey: int, addr: int, length: int) -> bytes:
        """READ; the first READ to *node* asks it for an address-validation token (a PING)."""
        if node not in self.tokens:
            self.tokens[node] = self.request(node, Packet(Opcode.PING)).aux_addr
        reply = self.request(
            node,
            Packet(Opcode.READ, rkey=rkey, addr=addr, length=length, aux_addr=self.tokens[node]),
        )
        return bytes(reply.payload)


def _with_ids(packet: Packet, client_id: int, txn: int) -> Packet:

    return replace(packet, client_id=client_id, txn_id=txn)


def _compiled_tags() -> bool:
    """Whether this process seals and checks control tags with the compiled kernels: when it has
    loaded them already (a host process, a node: ~50x faster than plain Python, and a host seals
    a START_COLL per collective). Otherwise with protocol/tag.py's plain-Python reference: a CLI
    command seals a handful of requests (~0.2 ms each), and loading numba and the kernels for
    them cost every `netdam stats` or `down` ~1.5 s. Both give the same bytes
    (tests/core/test_control_tags.py)."""
    return "netdam.kernels.tag" in sys.modules


def _seal_control(key: bytes, data: bytes) -> bytes:
    if _compiled_tags():
        from netdam.kernels.tag import seal_control_bytes  # loaded already (_compiled_tags)

        return bytes(seal_control_bytes(key, data))
    return bytes(seal_control(key, data))


def _verify_control(key: bytes, data: bytes) -> bool:
    if _compiled_tags():
        from netdam.kernels.tag import verify_control_bytes  # loaded already (_compiled_tags)

        return bool(verify_control_bytes(key, data))
    return bool(verify_control(key, data))
