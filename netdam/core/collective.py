"""The collective engine of one node: START_COLL descriptors, chunking, and the engine's state.

Rules of this file:
1. Collectives run in the NIC: after START_COLL the node originates chain heads, stores and
   spreads its block, and repairs what was lost, with no host on the data path. The per-packet
   side is in ``netdam.kernels.datapath`` (chain stores, all-gather writes, ACK capture, repair
   replies); the clock side in ``netdam.kernels.collective._coll_tick``. This class owns the
   arrays both share, validates descriptors and sets a collective up.
2. Layout, for N ranks and ``count`` elements: block j = elements [j*count//N, (j+1)*count//N);
   it is owned by rank j; its chains start at rank j+1 and travel j+2, ..., j (SR list), so the
   sum is folded in that order (tests/reference.py reproduces it). Blocks are cut into chunks
   of at most ``max_elements(mtu, dtype, N-1)`` elements; chunk ids (the ``seq`` field) number
   all chunks of all blocks in block order.
3. A node holds MAX_COLLECTIVES collectives at once, one per slot (``CollectiveSlots``), each
   of its own group (``coll_id`` names the group, ``epoch`` the call; a group's calls run one
   after another, so a slot stays its group's while other groups come and go). A START_COLL
   when every slot runs is answered NACK BUSY: the host asks again, nothing queues here.
4. Slots never deadlock a chained collective: nodes that got START_COLLs in different orders
   can each hold collectives that another member has not started (4 slots, 6 collectives, 3
   nodes: every collective waits on a node full of others). A START_COLL that finds every slot
   taken therefore takes the slot of a collective with a higher coll_id that has done nothing
   here a peer relies on (no chain ACKed, no chunk stored, no DONE, no member asking for one)
   and whose chains a member refused (it is stuck). That one's host is answered BUSY and asks
   again: to its peers it is "not started here" again (SPEC.md 4.1, "Slots"). The lowest
   coll_id among the stuck always gets a slot, so one of them always completes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from functools import lru_cache

import numpy as np

from netdam.core.chunk_plan import block_bounds, chunk_bounds
from netdam.kernels import collective as L
from netdam.kernels import optim as optim_kernels
from netdam.kernels.state import CollSlots, CollState, Kept
from netdam.protocol.constants import (
    DEFAULT_MTU,
    ELEMENT_SIZE,
    HEADER_SIZE,
    MAX_SEGMENTS,
    SEGMENT_SIZE,
    TAG_SIZE,
    DType,
    Opcode,
    ReduceOp,
    Rights,
    Status,
    enum_values,
    max_elements,
    slot_bytes,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import DESCRIPTOR, OPTIMIZER_BYTES
from netdam.protocol.packet import Endpoint, Packet, endpoint_to_u64
from netdam.protocol.payloads import (
    FLAG_AWAIT_STARTED,
    FLAG_SPARSE,
    FLAG_UPDATE,
    NO_PHASE_US,
    Algo,
    CompletionPhases,
    Descriptor,
    OptimizerDescriptor,
    pack_completion,
    pack_completion_phases,
    unpack_descriptor,
)

#: Chunks one collective may have (chunk ids index per-chunk state arrays).
MAX_CHUNKS = L.MAX_CHUNKS
#: Collectives a node holds at once (SPEC.md 4.1).
MAX_COLLECTIVES = L.MAX_COLLECTIVES
#: Watchdog: a collective fails after this long without progress (START_COLL may say less).
DEFAULT_TIMEOUT_MS = L.DEFAULT_TIMEOUT_MS
#: coll_ids whose last epoch a node remembers (SPEC.md 6.5): a process's groups, and the groups
#: of every job before it on these nodes, up to this many.
EPOCHS_KEPT = 4096
#: Credit window bounds, chunks in flight per originator.
MIN_WINDOW, MAX_WINDOW, DEFAULT_WINDOW = 4, 128, 32
TOTAL_IN_FLIGHT = 512
#: ...and at most the bytes of TOTAL_IN_FLIGHT default-MTU chains: at an emulation MTU (SPEC.md
#: 2.7) a chain carries 7.5x the bytes, and 128 of them per originator queued ~30 MB at 4 x 64
#: MiB, whose waits outran the 20 ms RTO floor (~500 chains re-sent a call, none lost).
TOTAL_IN_FLIGHT_BYTES = TOTAL_IN_FLIGHT * slot_bytes(DEFAULT_MTU)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CollectiveSlots:
    """The node's collective slots: the arrays the kernels take (one row per slot, and the spare
    row, netdam.kernels.collective.SPARE_SLOT), a CollectiveEngine over each slot's rows, and
    the epochs every START_COLL is checked against."""

    def __init__(self) -> None:
        self._state: Kept[CollSlots] = Kept()
        rows = L.SLOT_ROWS
        self.cfg = np.zeros((rows, L.CFG_LEN), np.int64)
        self.fcfg = np.zeros((rows, L.F_LEN), np.float64)
        self.ring = np.zeros((rows, MAX_SEGMENTS), np.uint64)
        self.bounds = np.zeros((rows, MAX_SEGMENTS + 1), np.int64)
        self.cb = np.zeros((rows, MAX_SEGMENTS + 1), np.int64)
        self.acked = np.zeros((rows, MAX_CHUNKS), np.uint8)
        self.sent = np.zeros((rows, MAX_CHUNKS), np.float64)
        self.tries = np.zeros((rows, MAX_CHUNKS), np.uint8)
        self.agsent = np.zeros((rows, MAX_CHUNKS), np.uint8)
        self.done = np.zeros((rows, L.DONE_LEN), np.uint8)  # + sparse tables, coll_layout
        #: The last epoch started here of each coll_id (the EPOCHS_KEPT most recent): a group
        #: can run between two calls of another, so the collectives held cannot tell that a
        #: (coll_id, epoch) was used before.
        self.epochs: OrderedDict[int, int] = OrderedDict()
        self.engines = [CollectiveEngine(self, s) for s in range(MAX_COLLECTIVES)]
        #: Collectives that gave up their slot (rule 4 above) since the owner last looked: their
        #: START_COLL and its source, and their tag key; the owner answers each host BUSY.
        self.yielded: list[tuple[Packet, int, bytes]] = []

    def state(self) -> CollSlots:
        """The slots' arrays as the kernels take them (made here, and only here; the same
        object while they are the same arrays)."""
        return self._state.of(
            CollSlots,
            self.cfg,
            self.done,
            self.acked,
            self.fcfg,
            self.ring,
            self.bounds,
            self.cb,
            self.sent,
            self.tries,
            self.agsent,
        )

    def set_host_turn(self, seconds: float) -> None:
        """The longest recent wait between two turns of this NIC in its process (the host loop
        measures it): every slot's timers cover HOST_TURNS_PER_RTO of them from now on, those
        of the collectives running too (kernels.collective._rto_bounds)."""
        fcfg = self.fcfg
        fcfg[:, L.F_HOST_TURN] = seconds
        floor = L.HOST_TURNS_PER_RTO * seconds
        np.maximum(fcfg[:, L.F_RTO], floor, out=fcfg[:, L.F_RTO])
        np.maximum(fcfg[:, L.F_BASE_RTO], floor, out=fcfg[:, L.F_BASE_RTO])

    def engine_of(self, coll_id: int) -> CollectiveEngine | None:
        """The slot holding *coll_id* (running, or its last collective here ended in it)."""
        for engine in self.engines:
            if engine.cfg[L.CFG_STATE] != L.STATE_IDLE and engine.cfg[L.CFG_COLL] == coll_id:
                return engine
        return None

    def last_started(self) -> CollectiveEngine:
        """The slot of the collective started here last."""
        return max(self.engines, key=lambda e: e.started)

    def last_epoch(self, coll_id: int) -> int | None:
        """The epoch of *coll_id* started here last (None: none remembered): its slot's, when
        one holds it (the datapath starts epochs there too, restart_collective), else the one
        remembered when the slot went to another group."""
        engine = self.engine_of(coll_id)
        if engine is not None:
            return int(engine.cfg[L.CFG_EPOCH])
        return self.epochs.get(coll_id)

    def _remember_epoch(self, coll_id: int, epoch: int) -> None:
        self.epochs[coll_id] = epoch
        self.epochs.move_to_end(coll_id)
        if len(self.epochs) > EPOCHS_KEPT:
            self.epochs.popitem(last=False)

    @property
    def needs_tick(self) -> bool:
        return any(engine.needs_tick for engine in self.engines)

    def ticking(self) -> list[CollectiveEngine]:
        return [engine for engine in self.engines if engine.needs_tick]

    def stale_epoch_of(self, coll_id: int) -> int:
        """The epoch a STALE_EPOCH answer names for *coll_id*: its last one started here."""
        return self.last_epoch(coll_id) or 0

    def settled_epoch_of(self, coll_id: int) -> int:
        """The last epoch of *coll_id* settled here (COUNTERS_EPOCH): the last one started, less
        one while that one still runs, since a member that asks then may not have started it
        yet and must still start it (SPEC.md 6.5, "Epochs"); 0 when none is remembered."""
        engine = self.engine_of(coll_id)  # its epoch is the last one (last_epoch)
        last = self.last_epoch(coll_id) or 0
        return last - 1 if engine is not None and engine.running else last

    def final_reply(self, packet: Packet, src: int) -> tuple[Opcode, Status, bytes] | None:
        engine = self.engine_of(packet.coll_id)
        return engine.final_reply(packet, src) if engine is not None else None

    def start(
        self,
        packet: Packet,
        src: int,
        memory: np.ndarray,
        mtu: int,
        self_endpoint: int,
        regions: dict[int, tuple[int, int, int]],
        rcvbuf: int,
    ) -> Status:
        """Set up the collective *packet* describes in its group's slot, or a free one; returns
        the status to answer with (BUSY: its group's last call still runs here, or every slot
        runs a collective)."""
        held = self.engine_of(packet.coll_id)
        if held is not None and held.is_retry(packet, src):
            return Status.OK  # a retried START_COLL: already running or finished
        last = self.last_epoch(packet.coll_id)
        if last is not None and (last - packet.epoch) & 0xFFFFFFFF < 0x80000000:
            # Not newer than this coll_id's last collective here (a new process group counts
            # from epoch 1 again): never run it under a reused (coll_id, epoch), which peers
            # would take for the old one. The NACK tells that epoch (stale_epoch_of).
            return Status.STALE_EPOCH
        engine = (
            held if held is not None else self._free_slot() or self._take_stuck_slot(packet.coll_id)
        )
        if engine is None or engine.running:
            return Status.BUSY
        held_coll = int(engine.cfg[L.CFG_COLL])
        if held_coll not in (0, packet.coll_id) and engine.cfg[L.CFG_STATE] != L.STATE_IDLE:
            # The slot goes to another group: its group's last epoch is remembered here now.
            self._remember_epoch(held_coll, int(engine.cfg[L.CFG_EPOCH]))
        status = engine.start(packet, src, memory, mtu, self_endpoint, regions, rcvbuf)
        if status == Status.OK:
            L.number_start(self.cfg[L.SPARE_SLOT], engine.cfg)
            engine.cfg[L.CFG_EPOCH_BEFORE] = -1 if last is None else last
            self._remember_epoch(packet.coll_id, packet.epoch)
        return status

    def _free_slot(self) -> CollectiveEngine | None:
        """A slot for a group no slot holds: a never used one, else the one whose collective
        ended longest ago, preferring one no member waits on for a repeated DONE."""
        ended = [e for e in self.engines if not e.running]
        if not ended:
            return None
        return min(
            ended, key=lambda e: (e.cfg[L.CFG_STATE] != L.STATE_IDLE, e.needs_tick, e.started)
        )

    def _take_stuck_slot(self, coll_id: int) -> CollectiveEngine | None:
        """The slot of the stuck collective with the highest coll_id above *coll_id* (rule 4),
        emptied for *coll_id*'s START_COLL; None when no running collective may give way."""
        stuck = [
            e
            for e in self.engines
            if e.running and int(e.cfg[L.CFG_COLL]) > coll_id and e.may_yield
        ]
        if not stuck:
            return None
        engine = max(stuck, key=lambda e: int(e.cfg[L.CFG_COLL]))
        cfg = engine.cfg
        victim = int(cfg[L.CFG_COLL])
        # Its epoch may start here again: this node never ran it to any end.
        if engine.epoch_before is None:
            self.epochs.pop(victim, None)
        else:
            self.epochs[victim] = engine.epoch_before
        request = engine.request
        if request is not None:
            self.yielded.append(
                (request, engine.started_by[0], cfg[L.CFG_TAG_K0 : L.CFG_TAG_K1 + 1].tobytes())
            )
        cfg[L.CFG_STATE] = L.STATE_IDLE
        cfg[L.CFG_COLL] = 0  # nothing of it carries over into the next collective of this slot
        return engine


class CollectiveEngine:
    """One slot of the node's collective engine: one collective at a time, its state in row
    *slot* of the CollectiveSlots arrays (views: the kernels change them in place)."""

    def __init__(self, slots: CollectiveSlots, slot: int) -> None:
        self.slots = slots
        self.slot = slot
        self.cfg, self.fcfg, self.ring = slots.cfg[slot], slots.fcfg[slot], slots.ring[slot]
        self.bounds, self.cb, self.acked = slots.bounds[slot], slots.cb[slot], slots.acked[slot]
        self.sent, self.tries, self.agsent = slots.sent[slot], slots.tries[slot], slots.agsent[slot]
        self.done = slots.done[slot]
        #: The slot's rows as the kernels take one collective's state (CollSlots' arrays and
        #: CollState's fields come in the same order).
        self.state = CollState(*(rows[slot] for rows in slots.state()))
        #: The START_COLL the control plane set this slot up with last (the datapath starts
        #: later epochs of the same shape: ``request`` rebuilds theirs from it).
        self._request: Packet | None = None

    # What the slot's START_COLL was, from its cfg words: the datapath sets them up too.

    @property
    def started_by(self) -> tuple[int, int]:
        """(UDP source, client id) of the START_COLL that began the current collective: only the
        same requester's START_COLL of the same (coll_id, epoch) is a retry."""
        return int(self.cfg[L.CFG_STARTER]), int(self.cfg[L.CFG_CLIENT])

    @property
    def started(self) -> int:
        """Which START_COLL set this slot up last (the node's count): the oldest goes first."""
        return int(self.cfg[L.CFG_START_NO])

    @property
    def epoch_before(self) -> int | None:
        """The epoch of its coll_id started here before the current one (None: none)."""
        before = int(self.cfg[L.CFG_EPOCH_BEFORE])
        return None if before < 0 else before

    @property
    def request(self) -> Packet | None:
        """The START_COLL that began the current collective (its epoch, txn and keys)."""
        request, cfg = self._request, self.cfg
        if request is None or request.epoch == cfg[L.CFG_EPOCH]:
            return request
        payload = bytearray(request.payload)
        DESCRIPTOR.write(payload, "rkey", int(cfg[L.CFG_RKEY]))
        payload[DESCRIPTOR.size :] = cfg[L.CFG_TAG_K0 : L.CFG_TAG_K1 + 1].tobytes()
        return replace(
            request, epoch=int(cfg[L.CFG_EPOCH]), txn_id=int(cfg[L.CFG_TXN]), payload=bytes(payload)
        )

    @property
    def running(self) -> bool:
        return bool(self.cfg[L.CFG_STATE] == L.STATE_RUNNING)

    @property
    def needs_tick(self) -> bool:
        """Running, or owing a member a repeated DONE."""
        return bool(self.running or self.cfg[L.CFG_PREV_ASK] or self.cfg[L.CFG_CUR_ASK])

    @property
    def may_yield(self) -> bool:
        """Its chained collective is stuck and nothing of it here is relied on by a peer (rule
        4): no chain it started was ACKed, no chunk is stored here, no member said DONE or
        asks for this node's, and some chain of it went out more than once unanswered (a hop
        refused it: BUSY, not started there) or waits refused now."""
        cfg = self.cfg
        if (
            cfg[L.CFG_ALGO] not in (Algo.ALL_REDUCE, Algo.REDUCE_SCATTER)
            or cfg[L.CFG_ORIG_BLOCK] < 0
        ):
            return False
        own = np.int64(1) << cfg[L.CFG_RANK]
        if (
            cfg[L.CFG_ACKED]
            or cfg[L.CFG_DONE_COUNT]
            or cfg[L.CFG_PEERS_DONE] & ~own
            or cfg[L.CFG_BM_GOT] & ~own
            or cfg[L.CFG_PREV_ASK]
            or cfg[L.CFG_CUR_ASK]
            or cfg[L.CFG_FATAL]
        ):
            return False
        lo, hi = int(cfg[L.CFG_LOW_UNACKED]), int(cfg[L.CFG_NEXT_SEND])
        return bool(np.any((self.acked[lo:hi] == 2) | (self.tries[lo:hi] > 1)))

    def is_retry(self, packet: Packet, src: int) -> bool:
        """*packet* is a repeat of the START_COLL that set this slot's collective up."""
        cfg = self.cfg
        return bool(
            cfg[L.CFG_STATE] != L.STATE_IDLE
            and cfg[L.CFG_COLL] == packet.coll_id
            and cfg[L.CFG_EPOCH] == packet.epoch
            and self.started_by == (src, packet.client_id)
        )

    def start(
        self,
        packet: Packet,
        src: int,
        memory: np.ndarray,
        mtu: int,
        self_endpoint: int,
        regions: dict[int, tuple[int, int, int]],
        rcvbuf: int,
    ) -> Status:
        """Set up the collective *packet* describes in this slot (CollectiveSlots.start checked
        it is free and the epoch new); returns the status to answer with."""
        try:
            d = unpack_descriptor(packet.payload)
        except RemoteProtocolError:
            return Status.BAD_LENGTH
        # Fields one by one: dataclasses.astuple deep-copies (a fifth of a START_COLL's cost).
        algo, flags, rank, count, in_addr, out_addr, rkey, root = (
            d.algo,
            d.flags,
            d.rank,
            d.count,
            d.in_addr,
            d.out_addr,
            d.rkey,
            d.root,
        )
        world = len(packet.segments)
        ring, distinct = _ring_of(packet.segments)
        dtype = packet.dtype
        esize = ELEMENT_SIZE[dtype]
        status = _validate(
            algo, world, rank, ring, distinct, self_endpoint, count, dtype, packet.coll_id, root
        )
        if status != Status.OK:
            return status
        sparse = bool(flags & FLAG_SPARSE)
        chained = algo in (Algo.ALL_REDUCE, Algo.REDUCE_SCATTER)
        if flags & ~(FLAG_SPARSE | FLAG_UPDATE | FLAG_AWAIT_STARTED) or (
            flags & (FLAG_SPARSE | FLAG_AWAIT_STARTED) and not chained
        ):
            return Status.BAD_FIELD
        bounds = block_bounds(algo, count, world, root)
        in_len = _input_elements(algo, count, bounds, rank, root)
        status = _check_ranges(
            regions, rkey, in_addr, in_len * esize, out_addr, count * esize, esize
        )
        if status != Status.OK:
            return status
        optimizer: OptimizerDescriptor | None = None
        if flags & FLAG_UPDATE:
            status, optimizer = _fused_status(
                packet, algo, sparse, memory, regions, rkey, int(bounds[rank + 1] - bounds[rank])
            )
            if status != Status.OK:
                return status
        # A tagged collective's datagrams end with the tag: its payloads are that much smaller.
        mtu -= TAG_SIZE if d.tag_key else 0
        per_packet = max_elements(mtu, dtype, segments=max(world - 1, 0))
        cb = chunk_bounds(algo, count, world, root, per_packet)
        n_chunks = int(cb[-1])
        if n_chunks > MAX_CHUNKS:
            return Status.TOO_LARGE
        if sparse and (n_chunks + 7) // 8 > max_elements(mtu, DType.RAW):
            return Status.TOO_LARGE  # the bitmap must fit one datagram
        self._setup(packet, src, d, world, ring, bounds, cb, per_packet, rcvbuf)
        if optimizer is not None:
            self.cfg[L.CFG_OPT_DESC], self.cfg[L.CFG_OPT_STEP] = packet.addr, packet.aux_addr
            # The step table says the step from now on: an UPDATE of it is a duplicate, and
            # the next fused call must name the step after (each chunk is stepped once, at
            # the collective's guarded store).
            _step_table(memory, packet.addr, optimizer)[:] = packet.aux_addr
        copied_to = L.copy_local_part(self.state, self.slots.cfg[L.SPARE_SLOT], memory)
        if copied_to >= 0 and self.cfg[L.CFG_OPT_STEP]:
            # One rank's fused all-reduce: its own gradient steps it.
            optim_kernels.fused_step(
                memory,
                int(self.cfg[L.CFG_OPT_DESC]),
                count,
                int(self.cfg[L.CFG_OPT_STEP]),
                copied_to,
                int(dtype),
            )
        if sparse and world > 1:
            self._local_bitmap(memory, in_addr, count, esize)
        return Status.OK

    def _setup(
        self,
        packet: Packet,
        src: int,
        d: Descriptor,
        world: int,
        ring: np.ndarray,
        bounds: np.ndarray,
        cb: np.ndarray,
        per_packet: int,
        rcvbuf: int,
    ) -> None:
        """Write the collective's shape words, ring and plan, then set its epoch up
        (kernels.collective.set_up_epoch: begin_epoch, which the datapath's restarts share)."""
        cfg = self.cfg
        self._request = packet
        if cfg[L.CFG_COLL] != packet.coll_id:
            cfg[:] = 0  # a slot another group held: nothing of its collectives carries over
        self.ring[:world] = ring
        self.bounds[: world + 1] = bounds
        self.cb[: world + 1] = cb
        window = d.window
        if not window:
            packet_bytes = (
                HEADER_SIZE + SEGMENT_SIZE * (world - 1) + per_packet * ELEMENT_SIZE[packet.dtype]
            )
            # Credit window: every node may hold N originators' windows in its receive queue;
            # keep that under half the granted buffer (SPEC.md "Flow control").
            window = DEFAULT_WINDOW if rcvbuf <= 0 else rcvbuf // (2 * max(world, 1) * packet_bytes)
            # ...and all originators together keep at most TOTAL_IN_FLIGHT chains out: more only
            # lengthens the queues (and RTTs) without adding throughput.
            window = min(
                window,
                TOTAL_IN_FLIGHT // max(world, 1),
                TOTAL_IN_FLIGHT_BYTES // (max(world, 1) * packet_bytes),
            )
        shape = {
            L.CFG_COLL: packet.coll_id,
            L.CFG_RANK: d.rank,
            L.CFG_WORLD: world,
            L.CFG_ALGO: d.algo,
            L.CFG_DTYPE: int(packet.dtype),
            L.CFG_OP: int(packet.reduce_op),
            L.CFG_COUNT: d.count,
            L.CFG_IN: d.in_addr,
            L.CFG_OUT: d.out_addr,
            L.CFG_WINDOW: min(max(window, MIN_WINDOW), MAX_WINDOW),
            L.CFG_PER_PACKET: per_packet,
            L.CFG_CHUNKS: int(cb[-1]),
            L.CFG_GROUP: d.group,
            L.CFG_HOST: d.host or src,
            L.CFG_CLIENT: packet.client_id,
            L.CFG_ROOT: d.root,
            L.CFG_REQ_WINDOW: d.window,
            L.CFG_TIMEOUT_MS: d.timeout_ms,
            L.CFG_FLAGS: d.flags,
            L.CFG_STARTER: src,
            # The collective's key is its node's to install (NodeCore.install_collective_key).
            L.CFG_SPAN_LO: 0,
            L.CFG_SPAN_HI: 0,
            L.CFG_CKEY: 0,
            L.CFG_CKEY_RIGHTS: 0,
        }
        for index, value in shape.items():
            cfg[index] = value
        L.set_up_epoch(
            self.state, self.slots.cfg[L.SPARE_SLOT], packet.epoch, d.rkey, packet.txn_id, d.tag_key
        )

    def _local_bitmap(self, memory: np.ndarray, in_addr: int, count: int, esize: int) -> None:
        """Sparse mode: which chunks of this node's input hold a non-zero element (any bit set:
        -0.0 and denormals count), for the bitmap round the engine's clock runs first."""
        cfg, bounds, cb = self.cfg, self.bounds, self.cb
        world, per_packet, n_chunks = (
            int(cfg[L.CFG_WORLD]),
            int(cfg[L.CFG_PER_PACKET]),
            int(cfg[L.CFG_CHUNKS]),
        )
        words = memory[in_addr : in_addr + count * esize].view(_UINT[esize])
        nonzero = (words != 0).view(np.uint8)
        starts = np.concatenate(
            [
                np.arange(bounds[j], bounds[j + 1], per_packet)
                for j in range(world)
                if cb[j + 1] > cb[j]
            ]
        ).astype(np.int64)
        local = np.maximum.reduceat(nonzero, starts)
        self.done[L.NZ_BASE : L.NZ_BASE + n_chunks] = local
        packed = np.packbits(local, bitorder="little")
        self.done[L.BM_BASE : L.BM_BASE + packed.size] = packed
        cfg[L.CFG_SPARSE] = 1
        cfg[L.CFG_BM_GOT] = cfg[L.CFG_BM_HAS] = 1 << int(cfg[L.CFG_RANK])

    def final_reply(self, packet: Packet, src: int) -> tuple[Opcode, Status, bytes] | None:
        """The completion to repeat for a START_COLL of the collective that already ended here."""
        cfg = self.cfg
        if (
            cfg[L.CFG_STATE] < L.STATE_DONE
            or cfg[L.CFG_COLL] != packet.coll_id
            or cfg[L.CFG_EPOCH] != packet.epoch
        ):
            return None
        if self.started_by != (src, packet.client_id):
            return None  # someone else's collective: start() answers STALE_EPOCH
        if cfg[L.CFG_STATE] == L.STATE_DONE:
            stats = pack_completion(int(cfg[L.CFG_RETRANSMITS]), int(cfg[L.CFG_READS]))
            return Opcode.ACK, Status.OK, stats + pack_completion_phases(self.phases())
        missing = np.flatnonzero(self.done[: int(cfg[L.CFG_CHUNKS])] == 0)
        first, last = (
            (int(missing[0]), int(missing[-1])) if missing.size else (2**64 - 1, 2**64 - 1)
        )
        return (
            Opcode.NACK,
            Status(int(cfg[L.CFG_FATAL]) or Status.TIMEOUT),
            pack_completion(first, last),
        )

    def phases(self) -> CompletionPhases:
        """The phases the completion reports (SPEC.md 4.1), from the engine's clock stamps."""
        f = self.fcfg
        start = float(f[L.F_START])

        def us(slot: int) -> int:
            if f[slot] < 0.0 or start < 0.0:
                return int(NO_PHASE_US)
            return int(min(max((float(f[slot]) - start) * 1e6, 0.0), NO_PHASE_US - 1))

        return CompletionPhases(
            int(max(start, 0.0) * 1e9), us(L.F_T_CHAINS), us(L.F_T_CHUNKS), us(L.F_T_DONE)
        )

    def status(self) -> dict[str, object]:
        """Progress of the current (or last) collective, for watchdogs and stats."""
        cfg = self.cfg
        n = int(cfg[L.CFG_CHUNKS])
        missing = np.flatnonzero(self.done[:n] == 0)
        return {
            "state": L.EngineState(int(cfg[L.CFG_STATE])).name.lower(),
            "coll_id": int(cfg[L.CFG_COLL]),
            "epoch": int(cfg[L.CFG_EPOCH]),
            "chunks": n,
            "done": int(cfg[L.CFG_DONE_COUNT]),
            "needed": int(cfg[L.CFG_NEEDED]),
            "missing_first": int(missing[0]) if missing.size else None,
            "missing_last": int(missing[-1]) if missing.size else None,
            "acked": int(cfg[L.CFG_ACKED]),
            "retransmits": int(cfg[L.CFG_RETRANSMITS]),
            "reads": int(cfg[L.CFG_READS]),
            "fatal_status": int(cfg[L.CFG_FATAL]),
        }


def collective_buffer_span(packet: Packet, memory: np.ndarray) -> tuple[int, int, int] | None:
    """(rkey, lo, hi) of a START_COLL: the descriptor's key and the bytes its input and output
    cover here, [lo, hi), and for a fused reduce and update the optimizer's descriptor and
    everything it names (the node steps them under the collective's key); None when the
    descriptor cannot be read or run (the engine answers)."""
    try:
        d = unpack_descriptor(packet.payload)
    except RemoteProtocolError:
        return None
    world = len(packet.segments)
    if (
        d.algo not in enum_values(Algo)
        or not 0 <= d.rank < world
        or not 0 <= d.root < world
        or d.count <= 0
    ):
        return None
    esize = ELEMENT_SIZE[packet.dtype]
    bounds = block_bounds(d.algo, d.count, world, d.root)
    in_bytes = _input_elements(d.algo, d.count, bounds, d.rank, d.root) * esize
    ranges = [(d.in_addr, d.in_addr + in_bytes), (d.out_addr, d.out_addr + d.count * esize)]
    if d.flags & FLAG_UPDATE:
        ranges += _optimizer_ranges(memory, packet.addr)
    used = [r for r in ranges if r[1] > r[0]]
    return d.rkey, min(lo for lo, _ in used), max(hi for _, hi in used)


def _input_elements(algo: int, count: int, bounds: np.ndarray, rank: int, root: int) -> int:
    """Elements of the input a rank's node reads: its block (all-gather), nothing (a broadcast's
    non-root), else the whole buffer."""
    if algo == Algo.ALL_GATHER:
        return int(bounds[rank + 1] - bounds[rank])
    return count if algo != Algo.BROADCAST or rank == root else 0


@lru_cache(maxsize=256)
def _ring_of(segments: tuple[Endpoint, ...]) -> tuple[np.ndarray, bool]:
    """The SR list's members as endpoints (ip << 16 | port) in chain order, read-only, and whether
    they are distinct. Cached: a group's START_COLLs name the same list every call."""
    ring = np.array([endpoint_to_u64(ep) for ep in segments], np.uint64)
    ring.setflags(write=False)
    return ring, len(set(ring.tolist())) == len(ring)


def _validate(
    algo: int,
    world: int,
    rank: int,
    ring: np.ndarray,
    distinct: bool,
    me: int,
    count: int,
    dtype: DType,
    coll_id: int,
    root: int,
) -> Status:
    if algo not in enum_values(Algo) or coll_id == 0:
        return Status.BAD_FIELD
    if not 1 <= world <= MAX_SEGMENTS or not 0 <= rank < world or ring[rank] != me:
        return Status.BAD_SEGMENT
    if not distinct or not 0 <= root < world:
        return Status.BAD_SEGMENT
    if count <= 0:
        return Status.BAD_LENGTH
    if algo in (Algo.ALL_REDUCE, Algo.REDUCE_SCATTER) and dtype == DType.RAW:
        return Status.BAD_DTYPE
    return Status.OK


def _fused_status(
    packet: Packet,
    algo: int,
    sparse: bool,
    memory: np.ndarray,
    regions: dict[int, tuple[int, int, int]],
    rkey: int,
    elements: int,
) -> tuple[Status, OptimizerDescriptor | None]:
    """Whether a fused reduce and update (descriptor flags bit 1, SPEC.md 4.1) can start here,
    and the optimizer descriptor it steps: a dense SUM all-reduce of floats, the descriptor at
    the header's ``addr`` well formed and covering this node's block, everything it names
    readable and writable under the collective's rkey, and every entry of its step table one
    short of the header's step."""
    if algo != Algo.ALL_REDUCE or sparse or packet.reduce_op != ReduceOp.SUM:
        return Status.BAD_FIELD, None  # sparse mode skips chunks; an update must see every one
    if packet.dtype not in (DType.F32, DType.F16, DType.BF16):
        return Status.BAD_DTYPE, None
    desc, step = packet.addr, packet.aux_addr
    if not 0 < step <= 0xFFFFFFFF:
        return Status.BAD_FIELD, None
    status = _check_ranges(regions, rkey, desc, OPTIMIZER_BYTES, desc, OPTIMIZER_BYTES, 8)
    if status != Status.OK:
        return status, None
    d = _optimizer_at(memory, desc)
    if d is None or d.count != elements:
        return Status.BAD_FIELD, None  # malformed, or not this node's block
    for at, nbytes in _named_ranges(desc, d):
        status = _check_ranges(regions, rkey, at, nbytes, at, nbytes, 4)
        if status != Status.OK:
            return status, None
    if np.any(_step_table(memory, desc, d) != step - 1):
        return Status.OUT_OF_STEP, None  # a step skipped, repeated, or a block stepped in part
    return Status.OK, d


def _optimizer_at(memory: np.ndarray, desc: int) -> OptimizerDescriptor | None:
    """The optimizer descriptor at *desc* when it lies in *memory*, 8-aligned and well formed."""
    if not 0 <= desc <= memory.size - OPTIMIZER_BYTES or desc % 8:
        return None
    if optim_kernels.descriptor_problem(memory, desc) != 0:
        return None
    return OptimizerDescriptor.decode(memory[desc : desc + OPTIMIZER_BYTES].tobytes())


def _named_ranges(desc: int, d: OptimizerDescriptor) -> list[tuple[int, int]]:
    """(address, bytes) of what the descriptor at *desc* names: its masters, the moments its
    rule keeps, its step table."""
    state = [(d.params, 4 * d.count), (d.moment1, 4 * d.count), (d.moment2, 4 * d.count)]
    named = [(desc + at, nbytes) for at, nbytes in state if at]
    return [*named, (desc + d.steps, 4 * _step_entries(d))]


def _optimizer_ranges(memory: np.ndarray, desc: int) -> list[tuple[int, int]]:
    """[lo, hi) of the optimizer descriptor at *desc* and of what it names, when it lies in
    *memory* and is well formed; else none (the engine refuses the START_COLL)."""
    d = _optimizer_at(memory, desc)
    if d is None:
        return []
    return [(desc, desc + OPTIMIZER_BYTES)] + [
        (at, at + nbytes) for at, nbytes in _named_ranges(desc, d)
    ]


def _step_entries(d: OptimizerDescriptor) -> int:
    return -(-int(d.count) // int(d.chunk))


def _step_table(memory: np.ndarray, desc: int, d: OptimizerDescriptor) -> np.ndarray:
    at = desc + d.steps
    return memory[at : at + 4 * _step_entries(d)].view("<u4")


def _check_ranges(
    regions: dict[int, tuple[int, int, int]],
    rkey: int,
    in_addr: int,
    in_bytes: int,
    out_addr: int,
    out_bytes: int,
    esize: int,
) -> Status:
    """The collective's rkey must grant READ on the input and WRITE on the output here."""
    if rkey not in regions:
        return Status.BAD_RKEY
    base, size, rights = regions[rkey]
    if (rights & (Rights.READ | Rights.WRITE)) != (Rights.READ | Rights.WRITE):
        return Status.NO_RIGHTS
    for addr, nbytes in ((in_addr, in_bytes), (out_addr, out_bytes)):
        if addr < base or addr + nbytes > base + size:
            return Status.OUT_OF_BOUNDS
        if addr % esize:
            return Status.MISALIGNED
    return Status.OK
