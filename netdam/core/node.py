"""NodeCore: one emulated NetDAM NIC, sans-I/O and batch-shaped.

The core never touches a socket or a clock. Its owner (an I/O shell, or the in-memory fabric in
tests) hands it a batch of received datagrams with ``receive_batch(buf, lens, srcs, n, now)`` and
collects what to send with ``fill_send_batch(out, out_lens, out_dsts, now) -> n``. Addresses are
``ip << 16 | port`` as uint64 (``netdam.protocol.packet.endpoint_to_u64``).

The data opcodes run in one numba call per batch (``netdam.kernels.datapath.process_batch``);
the rare control opcodes, PINGs and replies addressed to the node are *punted*
to ``_handle_punted`` here, in Python.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from netdam.core.authority import ControlProof, control_authority, refusal_text
from netdam.core.base import CoreBase, check_batch
from netdam.core.collective import CollectiveSlots, collective_buffer_span
from netdam.core.events import (
    Event,
    GroupJoined,
    GroupLeft,
    RegionDeregistered,
    RegionRegistered,
    ReplyReceived,
)
from netdam.core.guard import GuardConfig, set_admin_tag_key
from netdam.core.sendqueue import SendQueue
from netdam.kernels import collective as coll_kernels
from netdam.kernels import datapath
from netdam.kernels.guard import G_NOW, address_token, record_failure
from netdam.kernels.state import TXQ_TAIL, DupWindow, Kept, NodeState, Regions, RxBatch, TraceRing
from netdam.kernels.wire import install_rkey, uninstall_rkey
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    COUNTERS_EPOCH,
    COUNTERS_TRACE,
    DEFAULT_MTU,
    DUP_REPLY_BYTES,
    DUP_WINDOW,
    DUP_WINDOW_CLIENTS,
    HEADER_SIZE,
    IP_UDP_OVERHEAD,
    MAX_SEGMENTS,
    MIN_MTU,
    PROTOCOL_VERSION,
    REGISTER_ALIGN,
    REGISTER_ANYWHERE,
    REPLY_OPCODES,
    RIGHTS_ALL,
    RIGHTS_DEFINED,
    TAG_SIZE,
    TRACE_RECORDS_PER_REPLY,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Rights,
    Status,
    TraceKind,
    enum_values,
    max_payload,
    slot_bytes,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import (
    H_DTYPE,
    H_OPCODE,
    H_REDUCE_OP,
    H_RESERVED1,
    H_SEG_COUNT,
    H_SEG_TYPE,
    H_SEGMENTS_LEFT,
    H_STATUS,
    H_VERSION,
    HEADER,
    TRACE_RECORD,
    TRACE_RECORD_BYTES,
    TRACE_REPLY,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, endpoint_to_u64, u64_to_endpoint
from netdam.protocol.payloads import (
    INFO,
    KEY_RIGHTS,
    TAG_KEY_SIZE,
    descriptor_tag_key,
    unpack_register,
)
from netdam.protocol.tag import is_control
from netdam.protocol.trace import DEFAULT_TRACE_RECORDS

#: Open-addressed rkey table size (power of two); at most half is used so probes stay short.
RKEY_SLOTS = 1024
MAX_REGIONS = RKEY_SLOTS // 2
#: Events waiting for the owner; beyond it replies are dropped and counted.
MAX_EVENTS = 1 << 16


#: Control opcodes the trace records on arrival (not COUNTERS: reading the trace would fill it).
TRACED_CONTROL = frozenset(
    {Opcode.START_COLL, Opcode.REGISTER, Opcode.DEREGISTER, Opcode.JOIN, Opcode.LEAVE}
)
_TRACED_OPCODES = np.array(sorted(int(op) for op in TRACED_CONTROL), np.uint8)


@dataclass
class NodeConfig:
    """Settings of one node."""

    #: This node's own address (replies and forwards name it as source).
    endpoint: Endpoint
    #: Bytes of node memory.
    memory_bytes: int = 64 << 20
    #: Key that authorises control opcodes (SPEC.md "Rights"). Random when not given.
    admin_key: int = field(default_factory=lambda: secrets.randbits(32) | 1)
    #: The cluster's 128-bit admin tag key (SPEC.md 2.6, "Control tags"). Given one, the node
    #: takes control opcodes only with their control tag, never on the 32-bit admin key alone.
    admin_tag_key: bytes = b""
    #: Addresses this node may forward to and whose return segments it trusts (itself included).
    members: tuple[Endpoint, ...] = ()
    #: IP MTU; packets that would not fit are refused at the source.
    mtu: int = DEFAULT_MTU
    rank: int = 0
    world_size: int = 1
    #: Initial send-queue slots (grows up to MAX_TX_QUEUE).
    tx_slots: int = 256
    #: Lockout and anti-amplification (SPEC.md 12); off unless the owner asks (processes do).
    guard: GuardConfig = field(default_factory=GuardConfig)
    #: Records of the trace ring (SPEC.md 6.7; 0: tracing off).
    trace_records: int = DEFAULT_TRACE_RECORDS


class NodeCore(CoreBase):
    """The sans-I/O core of one node: memory, rkeys, duplicate window, counters, datapath."""

    def __init__(self, config: NodeConfig, memory: np.ndarray | None = None) -> None:
        if config.mtu < MIN_MTU:
            raise ValueError(
                f"MTU {config.mtu} is too small: NetDAM needs at least {MIN_MTU} (--mtu)"
            )
        if memory is None:
            memory = np.zeros(config.memory_bytes, dtype=np.uint8)
        if memory.dtype != np.uint8 or memory.ndim != 1 or not memory.flags.c_contiguous:
            raise ValueError("node memory must be a 1-D C-contiguous uint8 array")
        self.config = config
        #: The bundles node_state hands out: NodeState, Regions, DupWindow.
        self._kept: tuple[Kept[NodeState], Kept[Regions], Kept[DupWindow]] = (
            Kept(),
            Kept(),
            Kept(),
        )
        self.memory = memory
        self.counters = C.new_counters()
        if config.trace_records < 0:
            raise ValueError(f"trace ring of {config.trace_records} records: 0 turns tracing off")
        self.trace = TraceRing(
            np.zeros((config.trace_records, TRACE_RECORD_BYTES), np.uint8), np.zeros(1, np.int64)
        )
        self.endpoint_u64 = endpoint_to_u64(config.endpoint)
        #: Largest datagram accepted: the UDP payload of one MTU-sized IP packet; longer ones are
        #: dropped and counted, as a NIC drops frames over its MTU.
        self.max_datagram = config.mtu - IP_UDP_OVERHEAD
        self.set_members(config.members)
        self._rk_key = np.zeros(RKEY_SLOTS, np.uint32)
        self._rk_base = np.zeros(RKEY_SLOTS, np.int64)
        self._rk_len = np.zeros(RKEY_SLOTS, np.int64)
        self._rk_rights = np.zeros(RKEY_SLOTS, np.uint8)
        self._rk_tag = np.zeros((RKEY_SLOTS, 2), np.uint64)
        #: rkey -> 16-byte tag key of every tagged region (SPEC.md 2.6, "Region tags").
        self._tag_keys: dict[int, bytes] = {}
        #: rkey -> (base, size, rights) of every registered region: the owners of node memory,
        #: which never overlap (SPEC.md 6.1).
        self._regions: dict[int, tuple[int, int, int]] = {}
        # A running collective's own key, and the (base, size, rights) it opens (not an owner, a
        # members-only window on buffers inside one, SPEC.md 4.1), live in its slot's cfg words
        # (CFG_CKEY, CFG_SPAN_*): the datapath installs a restarted collective's key too.
        # The at-most-once window's client table (SPEC section 7): key, rkey, highest txn, last use.
        self._cl_id = np.zeros(DUP_WINDOW_CLIENTS, np.uint64)
        self._cl_key = np.zeros(DUP_WINDOW_CLIENTS, np.uint32)
        self._cl_hi = np.zeros(DUP_WINDOW_CLIENTS, np.uint32)
        self._cl_used = np.zeros(DUP_WINDOW_CLIENTS, np.int64)
        self._w_txn = np.zeros((DUP_WINDOW_CLIENTS, DUP_WINDOW), np.uint32)
        self._w_state = np.zeros((DUP_WINDOW_CLIENTS, DUP_WINDOW), np.uint8)
        self._w_len = np.zeros((DUP_WINDOW_CLIENTS, DUP_WINDOW), np.int32)
        self._w_reply = np.zeros((DUP_WINDOW_CLIENTS, DUP_WINDOW, DUP_REPLY_BYTES), np.uint8)
        self.guard = config.guard.build()
        set_admin_tag_key(self.guard, config.admin_tag_key)
        self.collective = CollectiveSlots()
        self._ticks = 0  # clock calls: which slot's clock goes first (coll_kernels.coll_tick)
        self.sendq = SendQueue(config.tx_slots, self.counters, slot_bytes(config.mtu))
        self._punt = np.zeros(0, np.int32)
        self._events: deque[Event] = deque()
        self.groups: set[Endpoint] = set()
        self._handlers: dict[Opcode, Callable[[Packet, int], None]] = {
            Opcode.PING: self._on_ping,
            Opcode.REGISTER: self._on_register,
            Opcode.DEREGISTER: self._on_deregister,
            Opcode.JOIN: self._on_join,
            Opcode.LEAVE: self._on_leave,
            Opcode.START_COLL: self._on_start_collective,
            Opcode.COUNTERS: self._on_counters,
        }

    # ------------------------------------------------------------------ the batch verbs

    def receive_batch(
        self,
        buf: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        srcs: np.ndarray,
        n: int,
        now: float,
    ) -> None:
        """Execute datagrams ``buf[offs[i] : offs[i] + lens[i]]`` from ``srcs[i]`` for i < n."""
        check_batch(buf, offs, lens, srcs, n)
        if n == 0:
            return
        self._reserve_tx(n)
        self.guard.cfg[G_NOW] = now
        self._trace_control(buf, offs, lens, srcs, n)
        if self._punt.shape[0] < n:
            self._punt = np.zeros(max(n, 64), np.int32)
        tx_n, n_punt = datapath.process_batch(
            RxBatch(buf, offs, lens, srcs),
            n,
            self.max_datagram,
            self.node_state(),
            self.guard,
            self.tx_bundle(),
            int(self._txq[TXQ_TAIL]),
            self._punt,
        )
        self._txq[TXQ_TAIL] = tx_n
        self.handle_punted(buf, offs, lens, srcs, self._punt, int(n_punt))
        self.release_collective_key()

    def node_state(self) -> NodeState:
        """What the datapath reads and changes besides the batches (made here, and only here).

        For I/O shells that run the datapath inside their own compiled loop; the core stays the
        only owner (shells must call ``reserve`` before and ``handle_punted`` after). The same
        object while every array in it is the same (Kept): a new one when any was replaced."""
        kept = self._kept
        return kept[0].of(
            NodeState,
            self.memory,
            self._regions_table(),
            self._members,
            self._dup_window(),
            self.collective.state(),
            self.counters,
            self.trace,
        )

    def _dup_window(self) -> DupWindow:
        return self._kept[2].of(
            DupWindow,
            self._cl_id,
            self._cl_key,
            self._cl_hi,
            self._cl_used,
            self._w_txn,
            self._w_state,
            self._w_len,
            self._w_reply,
        )

    @property
    def tx_queue(self) -> np.ndarray:
        """``[head, tail]`` of the send queue (shared with compiled I/O loops)."""
        return self._txq

    def reserve(self, n: int) -> None:
        """Guarantee room in the send queue for the answers to *n* received datagrams."""
        self._reserve_tx(n)

    def get_timer(self) -> float | None:
        """When the collective engine wants its next tick (None: no collective running)."""
        ticking = self.collective.ticking()
        if not ticking:
            return None
        return min(
            float(e.fcfg[coll_kernels.F_NOW] + min(e.fcfg[coll_kernels.F_RTO] / 4.0, 0.001))
            for e in ticking
        )

    def handle_timer(self, now: float) -> None:
        """Run the collective engine's clock: chain heads, retransmits, all-gather, repair."""
        ticking = self.collective.ticking()
        if not ticking:
            return
        self._reserve_tx(
            sum(
                2 * int(e.cfg[coll_kernels.CFG_WINDOW]) * max(1, int(e.cfg[coll_kernels.CFG_WORLD]))
                for e in ticking
            )
        )
        self._ticks += 1  # each slot first in turn
        self._txq[TXQ_TAIL] = coll_kernels.coll_tick(
            now,
            self.collective.state(),
            self.memory,
            self.counters,
            self.trace,
            self.tx_bundle(),
            int(self._txq[TXQ_TAIL]),
            self._ticks,
        )
        self.release_collective_key()

    # ------------------------------------------------------------------ one-datagram helpers

    # ------------------------------------------------------------------ host-side control

    def set_members(self, members: tuple[Endpoint, ...] | list[Endpoint]) -> None:
        """Replace the cluster member list (this node is always a member)."""
        values = {endpoint_to_u64(m) for m in members} | {self.endpoint_u64}
        self._members = np.array(sorted(values), dtype=np.uint64)
        self._trusted = values

    def register_region(
        self, base: int, size: int, rights: Rights, rkey: int = 0, tag_key: bytes = b""
    ) -> int:
        """Make [base, base+size) reachable under an rkey (random when 0); return the rkey.
        With a 16-byte *tag_key* the region is tagged: it takes only datagrams sealed under it."""
        result = self._register(base, size, int(rights), rkey, announce=False, tag_key=tag_key)
        if isinstance(result, Status):
            raise ValueError(f"cannot register region: {result.name}")
        return result[0]

    def deregister_region(self, rkey: int) -> None:
        """Remove *rkey*; raises KeyError when unknown."""
        if self._deregister(rkey, announce=False) != Status.OK:
            raise KeyError(f"unknown rkey 0x{rkey:08x}")

    def regions(self) -> dict[int, tuple[int, int, int]]:
        """rkey -> (base, size, rights) of every registered region."""
        return dict(self._regions)

    # ------------------------------------------------------------------ internals

    def _handle_punted(self, data: bytes, src: int) -> None:
        try:
            packet = decode_packet(data)
        except RemoteProtocolError as exc:
            # The datapath validates what it punts; should anything reach here unvalidated,
            # answer as the datapath would.
            if data[H_OPCODE] in REPLY_OPCODES:
                self.counters[C.DROP_BAD_REPLY] += 1
                return
            self._nack_raw(data, src, exc.status)
            return
        if packet.opcode in REPLY_OPCODES:
            if len(self._events) >= MAX_EVENTS:
                self.counters[C.DROP_UNEXPECTED_REPLY] += 1
                return
            self._events.append(ReplyReceived(packet, u64_to_endpoint(src)))
            return
        if packet.opcode == Opcode.PING:
            self._on_ping(packet, src)
            return
        handler = self._handlers.get(packet.opcode)
        proof = (
            control_authority(self.config.admin_key, self.config.admin_tag_key, packet, data)
            if is_control(packet.opcode)
            else ControlProof.NONE
        )
        if proof is ControlProof.FORGED:
            self.counters[C.DROP_CONTROL_FORGED] += 1  # the datapath drops these before us
            return
        if handler is None:
            # Pool opcodes go to a switch (SPEC.md 11.9), whoever asks (a proven request hears it
            # sealed); data opcodes (the datapath executes them) never get here.
            self._answer(self._seal_for(proof), lambda: self._nack(packet, src, Status.BAD_FIELD))
            return
        if proof in (ControlProof.REFUSED, ControlProof.NONE):
            self._reply(
                packet,
                src,
                Opcode.NACK,
                Status.UNAUTHORIZED,
                payload=refusal_text(self.config.admin_tag_key),
            )
            if src not in self._trusted:
                record_failure(self.guard, src, self.counters)
            return
        if proof is ControlProof.TAG and self._replayed(data, src):
            return
        self._answer(self._seal_for(proof), lambda: handler(packet, src))

    def _seal_for(self, proof: ControlProof) -> bytes:
        """The key answers to a request with *proof* are sealed under (b"": none)."""
        return self.config.admin_tag_key if proof is ControlProof.TAG else b""

    def set_admin_keys(self, admin_key: int, admin_tag_key: bytes) -> None:
        """The cluster's admin key and admin tag key (a launcher's rendezvous hands them over
        after start)."""
        set_admin_tag_key(self.guard, admin_tag_key)
        self.config.admin_key = admin_key
        self.config.admin_tag_key = admin_tag_key

    def _nack_raw(self, data: bytes, src: int, status: Status) -> None:
        """NACK a packet the codec refused: echo its fixed header as the datapath does."""
        header = bytearray(data[:HEADER_SIZE])
        header[H_VERSION] = PROTOCOL_VERSION
        header[H_OPCODE] = Opcode.NACK
        header[H_DTYPE] = header[H_DTYPE] if header[H_DTYPE] in enum_values(DType) else 0
        header[H_REDUCE_OP] = (
            header[H_REDUCE_OP] if header[H_REDUCE_OP] in enum_values(ReduceOp) else 0
        )
        header[H_RESERVED1] = 0
        HEADER.write(header, "reserved2", 0)
        HEADER.write(header, "flags", HEADER.read(header, "flags") & (Flags.RELAYED | Flags.MCAST))
        HEADER.write(header, "length", 0)
        header[H_STATUS] = status
        header[H_SEG_TYPE] = header[H_SEGMENTS_LEFT] = header[H_SEG_COUNT] = 0
        ret = HEADER.read(header, "ret_ip") << 16 | HEADER.read(header, "ret_port")
        self._push(bytes(header), ret if ret and src in self._trusted else src)
        self.counters[C.NACK_BASE + status] += 1

    def _on_ping(self, packet: Packet, src: int) -> None:
        info = INFO.pack(
            PROTOCOL_VERSION,
            self.config.mtu,
            self.memory.shape[0],
            max_payload(self.config.mtu),
            MAX_SEGMENTS,
            self.config.rank,
            self.config.world_size,
        )
        # aux_addr: the address-validation token of the PING's source (SPEC.md 12.4).
        self._reply(packet, src, Opcode.INFO, payload=info, aux_addr=address_token(self.guard, src))

    def _windowed(
        self, packet: Packet, src: int, execute: Callable[[], tuple[Status, int, int]]
    ) -> None:
        """Run a mutating control opcode at most once per (client, txn), like the datapath.
        *execute* returns (status, rkey, addr) for the ACK's header (addr: where REGISTER put
        the region)."""
        verdict, c, w = datapath.window_check(
            self._dup_window(),
            packet.client_id,
            self._reply_dst(packet, src),
            packet.rkey,
            packet.txn_id,
            self._window_stamp(),
        )
        if verdict == datapath.WIN_STALE:
            self._nack(packet, src, Status.STALE)
            return
        if verdict == datapath.WIN_BUSY:
            self._nack(packet, src, Status.BUSY)
            return
        if verdict == datapath.WIN_DUP:
            length = int(self._w_len[c, w])
            self.counters[C.DUP_REPLAYS] += 1
            self._push(bytes(self._w_reply[c, w, :length]), self._reply_dst(packet, src))
            return
        status, rkey, addr = execute()
        if status != Status.OK:
            self._nack(packet, src, status)
            return
        reply = self._reply(packet, src, Opcode.ACK, rkey=rkey, addr=addr)
        if verdict == datapath.WIN_NEW:
            datapath.window_record(
                self._dup_window(), c, w, packet.txn_id, np.frombuffer(reply, np.uint8)
            )

    def _window_stamp(self) -> int:
        """The duplicate window's clock: microseconds of the batch's time, never 0."""
        return int(self.guard.cfg[G_NOW] * 1e6) + 1

    def _on_register(self, packet: Packet, src: int) -> None:
        requested, rights, tag_key = unpack_register(packet.payload)

        def execute() -> tuple[Status, int, int]:
            result = self._register(
                packet.addr, packet.aux_addr, rights, requested, tag_key=tag_key
            )
            if isinstance(result, Status):
                return result, packet.rkey, packet.addr
            rkey, base = result
            return Status.OK, rkey, base

        self._windowed(packet, src, execute)

    def _on_deregister(self, packet: Packet, src: int) -> None:
        rkey, _ = KEY_RIGHTS.unpack(packet.payload)
        self._windowed(packet, src, lambda: (self._deregister(rkey), packet.rkey, packet.addr))

    def _register(
        self,
        base: int,
        size: int,
        rights: int,
        rkey: int,
        announce: bool = True,
        tag_key: bytes = b"",
    ) -> tuple[int, int] | Status:
        """Make [base, base+size) the region of a new rkey (base REGISTER_ANYWHERE: the node
        picks); returns (rkey, base) or the status to NACK with (SPEC.md 6.1). One owner per
        byte: a range overlapping a registered region is IN_USE. A *tag_key* (16 bytes, not
        all zeros) makes the region tagged (SPEC.md 2.6)."""
        anywhere = base == REGISTER_ANYWHERE
        if (
            size <= 0
            or size > self.memory.shape[0]
            or (not anywhere and base + size > self.memory.shape[0])
        ):
            return Status.OUT_OF_BOUNDS
        if not rights & RIGHTS_ALL or rights & ~int(RIGHTS_DEFINED):
            return Status.BAD_FIELD
        if tag_key and (
            len(tag_key) != TAG_KEY_SIZE or not any(tag_key) or rights & Rights.MEMBERS
        ):
            return Status.BAD_FIELD
        if rkey and rkey in self._keys():
            return Status.EXISTS
        if len(self._regions) >= MAX_REGIONS:
            return Status.NO_SPACE
        if anywhere:
            found = self._first_fit(size)
            if found is None:
                return Status.NO_SPACE
            base = found
        elif self._overlaps(base, size):
            return Status.IN_USE
        while rkey == 0 or rkey in self._keys():
            rkey = secrets.randbits(32)
        self._regions[rkey] = (base, size, rights)
        if tag_key:
            self._tag_keys[rkey] = bytes(tag_key)
        self._install_rkey(rkey, (base, size, rights))
        if announce:  # the host that called register_region knows already
            self._events.append(RegionRegistered(rkey, base, size, rights))
        return rkey, base

    def _overlaps(self, base: int, size: int) -> bool:
        """Whether a registered region shares a byte with [base, base+size)."""
        return any(b < base + size and base < b + n for b, n, _ in self._regions.values())

    def _owner_containing(self, base: int, size: int) -> tuple[int, int, int] | None:
        """The registered region that holds all of [base, base+size), if any."""
        for b, n, rights in self._regions.values():
            if b <= base and base + size <= b + n:
                return b, n, rights
        return None

    def _first_fit(self, size: int) -> int | None:
        """The lowest REGISTER_ALIGN-aligned base where *size* bytes touch no region."""
        candidate = 0
        for b, n, _ in sorted(self._regions.values()):
            if candidate + size <= b:
                break
            candidate = max(candidate, -(-(b + n) // REGISTER_ALIGN) * REGISTER_ALIGN)
        return candidate if candidate + size <= self.memory.shape[0] else None

    def _deregister(self, rkey: int, announce: bool = True) -> Status:
        if rkey not in self._regions:
            return Status.BAD_RKEY
        base, size, _ = self._regions.pop(rkey)
        self._tag_keys.pop(rkey, None)
        # Memory reaches its next owner zeroed: wiped the moment it has no owner.
        self.memory[base : base + size] = 0
        uninstall_rkey(self._regions_table(), rkey)
        if announce:
            self._events.append(RegionDeregistered(rkey))
        return Status.OK

    def _keys(self) -> dict[int, tuple[int, int, int]]:
        """Every rkey the node answers to -> (base, size, rights): the registered regions and
        the keys of the collectives running here."""
        keys = dict(self._regions)
        for cfg in self._keyed_slots():
            lo, hi = int(cfg[coll_kernels.CFG_SPAN_LO]), int(cfg[coll_kernels.CFG_SPAN_HI])
            keys[int(cfg[coll_kernels.CFG_CKEY])] = (
                lo,
                hi - lo,
                int(cfg[coll_kernels.CFG_CKEY_RIGHTS]),
            )
        return keys

    def _keyed_slots(self) -> list[np.ndarray]:
        """The cfg rows of the slots whose collective's own key is installed."""
        cfg = self.collective.cfg
        return [
            cfg[s] for s in range(coll_kernels.MAX_COLLECTIVES) if cfg[s, coll_kernels.CFG_CKEY]
        ]

    def _rebuild_rkeys(self) -> None:
        """The datapath's rkey table anew from the registered regions and the collectives'
        keys: after a stuck collective yields its slot, whose key's record the set-up cleared."""
        self._rk_key[:] = 0
        self._rk_tag[:] = 0
        for key, span in self._keys().items():
            self._install_rkey(key, span)

    def _install_rkey(self, key: int, span: tuple[int, int, int]) -> None:
        """Add *key* (base, size, rights) and its tag key to the datapath's table, which does
        not hold it."""
        install_rkey(self._regions_table(), key, span, self._tag_keys.get(key, b""))

    def _regions_table(self) -> Regions:
        """The rkey table as the datapath reads it: node_state's own bundle (Kept)."""
        return self._kept[1].of(
            Regions, self._rk_key, self._rk_base, self._rk_len, self._rk_rights, self._rk_tag
        )

    # ------------------------------------------------------------------ a collective's key

    def _collective_scope(
        self, span: tuple[int, int, int] | None
    ) -> tuple[int, tuple[int, int, int]] | None:
        """A START_COLL whose descriptor rkey is no key of this node names a key for this
        collective alone (SPEC.md 4.1): (rkey, (base, size, rights)) over the collective's
        buffers (and a fused update's optimizer state), which must lie in one registered
        region, usable only in datagrams from members; None: a registered region's key (v1
        use, checked by the engine), or no region holds the buffers (the engine answers).
        *span*: its (rkey, lo, hi), collective_buffer_span's answer."""
        if span is None:
            return None
        rkey, lo, hi = span
        if rkey == 0 or rkey in self._keys():
            return None
        owner = self._owner_containing(lo, hi - lo)
        if owner is None:
            return None
        return rkey, (
            lo,
            hi - lo,
            (owner[2] & int(Rights.READ | Rights.WRITE)) | int(Rights.MEMBERS),
        )

    def _key_collective(
        self,
        packet: Packet,
        span: tuple[int, int, int] | None,
        scope: tuple[int, tuple[int, int, int]] | None,
    ) -> None:
        """Record in the slot of the collective *packet* just set up the bytes its key covers,
        and install its own key over them (*scope*), removed when it ends
        (release_collective_key): what the datapath's restarts of it read and do alike."""
        engine = self.collective.engine_of(packet.coll_id)
        if engine is None or span is None:
            return
        cfg = engine.cfg
        cfg[coll_kernels.CFG_SPAN_LO], cfg[coll_kernels.CFG_SPAN_HI] = span[1], span[2]
        if scope is not None:
            rkey, (_, _, rights) = scope
            cfg[coll_kernels.CFG_CKEY], cfg[coll_kernels.CFG_CKEY_RIGHTS] = rkey, rights
            self._install_rkey(rkey, scope[1])  # one START_COLL, one insert: no rebuild

    def release_collective_key(self) -> None:
        """Remove the key of every collective no longer running (called after every serve
        round and tick: a key outlives its collective by one round), and take the control tags
        of the START_COLLs the datapath started into the replay memory."""
        self._note_datapath_starts()
        ended = [
            cfg
            for cfg in self._keyed_slots()
            if cfg[coll_kernels.CFG_STATE] != coll_kernels.STATE_RUNNING
        ]
        for cfg in ended:
            uninstall_rkey(self._regions_table(), int(cfg[coll_kernels.CFG_CKEY]))
            cfg[coll_kernels.CFG_CKEY] = cfg[coll_kernels.CFG_CKEY_RIGHTS] = 0

    def _note_datapath_starts(self) -> None:
        """The control tags of the START_COLLs the datapath started (restart_collective, kept
        in each slot's row) go into the replay memory, as the control plane's own do (SPEC.md
        2.6); the rows are empty again."""
        cfg, base = self.collective.cfg, coll_kernels.CFG_TAKEN_BASE
        for s in range(coll_kernels.MAX_COLLECTIVES):
            taken = int(cfg[s, coll_kernels.CFG_TAKEN])
            starter = int(cfg[s, coll_kernels.CFG_STARTER])
            for tag in cfg[s, base : base + taken].tolist():
                self._remember_tag(tag.to_bytes(TAG_SIZE, "little", signed=True), starter)
            cfg[s, coll_kernels.CFG_TAKEN] = 0

    def _replayed(self, data: bytes, src: int) -> bool:
        self._note_datapath_starts()
        return super()._replayed(data, src)

    def _runs(self, coll_id: int) -> bool:
        engine = self.collective.engine_of(coll_id)
        return engine is not None and engine.running

    def _on_join(self, packet: Packet, src: int) -> None:
        group = u64_to_endpoint(packet.addr)
        if not ipaddress.IPv4Address(group[0]).is_multicast:
            self._nack(packet, src, Status.BAD_FIELD)
            return
        # Answered once the shell has bound the group's port (answer_join), which may fail.
        self._events.append(GroupJoined(group, packet, src, self._seal_key))

    def answer_join(self, event: GroupJoined, status: Status = Status.OK) -> None:
        """The shell's word on *event*: subscribed (OK, ACKed), or not (NACK *status*, IN_USE
        when another socket holds the group's port; the node keeps the group it had)."""
        if status == Status.OK:
            self.groups.add(event.group)
        opcode = Opcode.ACK if status == Status.OK else Opcode.NACK

        def respond() -> None:
            self._reply(event.request, event.src, opcode, status)

        self._answer(event.seal_key, respond)

    def _on_leave(self, packet: Packet, src: int) -> None:
        group = u64_to_endpoint(packet.addr)
        self.groups.discard(group)
        self._events.append(GroupLeft(group))
        self._reply(packet, src, Opcode.ACK)

    def _on_start_collective(self, packet: Packet, src: int) -> None:
        # Every answer to a tagged START_COLL carries a tag under its key: the host takes no
        # other, so nobody without the key can end or fail its wait (SPEC.md 2.6).
        key = descriptor_tag_key(packet.payload)
        final = self.collective.final_reply(packet, src)
        if final is not None:
            # A retried START_COLL of a finished collective: the host may have lost the
            # completion, so it gets it again (SPEC.md "START_COLL").
            self._reply(packet, src, final[0], final[1], payload=final[2], aux_addr=1, tag_key=key)
            return
        self.release_collective_key()
        span = collective_buffer_span(packet, self.memory)
        scope = None if self._runs(packet.coll_id) else self._collective_scope(span)
        regions = self._keys()
        if scope is not None:
            regions[scope[0]] = scope[1]
        engine = self.collective.engine_of(packet.coll_id)
        retry = engine is not None and engine.is_retry(packet, src)
        status = self.collective.start(
            packet,
            src,
            self.memory,
            self.config.mtu,
            self.endpoint_u64,
            regions,
            int(self.counters[C.RCVBUF_BYTES]),
        )
        if self.collective.yielded:
            # A stuck collective gave its slot up, and its key's record went with the slot's
            # words (this set-up cleared them): the table is rebuilt without its key.
            self._rebuild_rkeys()
        if status == Status.OK and not retry:
            self._key_collective(packet, span, scope)
        for request, host, tag_key in self.collective.yielded:
            # A stuck collective gave its slot to this one: its host asks again (BUSY).
            # (Counted with every NACK BUSY: no counter of its own, the COUNTERS layout stays.)
            self._nack(request, host, Status.BUSY, tag_key=tag_key if any(tag_key) else b"")
        self.collective.yielded.clear()
        if status == Status.OK:
            # aux_addr 0 "running", whatever the request's (a fused update's step, 4.1).
            self._reply(packet, src, Opcode.ACK, aux_addr=0, tag_key=key)
        elif status == Status.STALE_EPOCH:  # aux_addr: this node's epoch, the host's next is above
            epoch = self.collective.stale_epoch_of(packet.coll_id)
            self._reply(packet, src, Opcode.NACK, status, aux_addr=epoch, tag_key=key)
        else:
            self._nack(packet, src, status, tag_key=key)

    def _on_counters(self, packet: Packet, src: int) -> None:
        if packet.aux_addr == COUNTERS_TRACE:
            self._reply(packet, src, Opcode.ACK, payload=self.trace_records(packet.addr))
        elif packet.aux_addr == COUNTERS_EPOCH:
            epoch = self.collective.settled_epoch_of(packet.coll_id)
            self._reply(packet, src, Opcode.ACK, aux_addr=epoch)
        elif packet.aux_addr != 0:
            self._reply(packet, src, Opcode.NACK, Status.BAD_FIELD)
        else:
            self._reply(packet, src, Opcode.ACK, payload=self.counters.astype("<u8").tobytes())

    def _trace_control(
        self, buf: np.ndarray, offs: np.ndarray, lens: np.ndarray, srcs: np.ndarray, n: int
    ) -> None:
        """An RX record of each control datagram of a batch the control plane passes to the
        datapath (the compiled loop records the data socket's itself; these come through the
        management port, SPEC.md 6.7), whatever becomes of it."""
        rows = self.trace.rec
        if rows.shape[0] == 0 or n == 0:
            return
        # Picked out with numpy: a batch of data datagrams (the in-memory fabric's, the
        # one-process datapath bench's) costs no Python per datagram here.
        whole = np.flatnonzero((lens[:n] >= HEADER_SIZE) & (offs[:n] + HEADER_SIZE <= buf.shape[0]))
        control = whole[np.isin(buf[offs[whole] + H_OPCODE], _TRACED_OPCODES)]
        for i in control.tolist():
            length, at = int(lens[i]), int(offs[i])
            head = bytes(buf[at : at + HEADER_SIZE])
            written = int(self.trace.cursor[0])
            TRACE_RECORD.pack_into(
                rows,
                (written % rows.shape[0]) * TRACE_RECORD_BYTES,
                t_ns=int(self.guard.cfg[G_NOW] * 1e9),
                kind=TraceKind.RX,
                opcode=head[H_OPCODE],
                length=length,
                peer=int(srcs[i]),
                coll_id=HEADER.read(head, "coll_id"),
                epoch=HEADER.read(head, "epoch"),
                seq=HEADER.read(head, "seq"),
            )
            self.trace.cursor[0] = written + 1

    def trace_records(self, first: int) -> bytes:
        """The trace reply (SPEC.md 6.7): records from number *first* on, or from the oldest the
        ring still holds, at most TRACE_RECORDS_PER_REPLY of them."""
        rows = self.trace.rec
        slots = rows.shape[0]
        written = int(self.trace.cursor[0])
        start = min(max(first, written - slots, 0), written)
        count = min(TRACE_RECORDS_PER_REPLY, written - start)
        picked = rows[np.arange(start, start + count, dtype=np.int64) % max(slots, 1)]
        head = TRACE_REPLY.struct.pack(start, written, slots, TRACE_RECORD_BYTES, 0)
        return bytes(head + picked.tobytes())
