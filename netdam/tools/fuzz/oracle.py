"""The fuzzer's oracle and checks, sans-I/O (the generator and the layout: netdam/tools/fuzz/generator.py).

- ``Oracle``: what protocol/SPEC.md says each datagram causes at each process (structural
  verdict by the codec, then rkey, rights, bounds, alignment, membership, collective state,
  chain hops, switch translation): per process the opcodes counted, NACKs, drops, forwards,
  and which memory bytes it may change. The duplicate window is the one thing it leaves open
  (a windowed request executes, replays, or is answered STALE or BUSY: WINDOW_STATUSES).
- ``Expectation`` sums outcomes; ``counter_checks`` holds it against the processes' counters
  (exact, up to datagrams the kernel dropped: loopback loses nothing else); ``MemoryGuard``
  finds bytes that changed outside every authorized write.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from netdam.protocol import counters as C
from netdam.protocol.constants import (
    CONTROL_OPCODES,
    HEADER_SIZE,
    POOL_OPCODES,
    REPLY_OPCODES,
    SEGMENT_SIZE,
    TAG_SIZE,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import ALLOC, H_SEG_COUNT, HEADER, OPTIMIZER_BYTES
from netdam.protocol.packet import Packet, decode_packet, endpoint_to_u64
from netdam.protocol.payloads import ALLOC_TAGGED
from netdam.protocol.tag import is_control
from netdam.switch.addrmap import Region
from netdam.tools.fuzz.generator import (
    DROP_COUNTERS,
    ELEMENT_BYTES,
    EV_DROP,
    EV_FWD,
    EV_NACK,
    EV_OP,
    EV_OPEN,
    EV_REPL,
    EV_RX,
    EV_STORED,
    EV_WINDOW,
    O_OPCODE,
    WINDOWED_OPCODES,
    Layout,
    expected_opcodes,
    expected_statuses,
)

# ---------------------------------------------------------------- the oracle


@dataclass
class Outcome:
    """What one datagram causes, per SPEC.md: events per process and memory it may change.

    ``kind``: "accepted" (executed, forwarded or answered), "nack", "drop", or "windowed"
    (executes, replays, or is answered STALE or BUSY: the duplicate window decides)."""

    kind: str = "accepted"
    status: int = 0  # the first NACK's status
    events: list[tuple[int, int, int]] = field(default_factory=list)
    writes: list[tuple[int, int, int]] = field(default_factory=list)  # (node, start, end)

    def nack(self, process: int, status: int) -> None:
        self.events.append((process, EV_NACK, status))
        if self.kind != "nack":
            self.kind, self.status = "nack", status

    def drop(self, process: int, counter: int) -> None:
        self.events.append((process, EV_DROP, counter))
        if self.kind == "accepted":
            self.kind = "drop"


class Oracle:
    """SPEC.md's verdict on each datagram a layout's fuzzer sends (see the module docstring)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._node_index = {endpoint_to_u64(ep): k for k, ep in enumerate(layout.nodes)}
        self._members = set(self._node_index)
        if layout.vip is not None:
            self._members.add(endpoint_to_u64(layout.vip))
        self._tables = [{r.rkey: r for r in regions} for regions in layout.node_regions]
        self._pool = sorted(layout.pool, key=lambda r: r.gaddr)
        self._pool_starts = [r.gaddr for r in self._pool]
        self._group = endpoint_to_u64(layout.group) if layout.group is not None else -1
        self.switch = len(layout.nodes)

    def outcome(self, data: bytes, dst: int) -> Outcome:
        """What *data*, sent by the fuzzer (not a cluster member) to destination *dst*, causes."""
        out = Outcome()
        if self.layout.target == "switch":
            self._at_switch(data, out)
        else:
            self._at_node(dst, data, out)
        return out

    # ------------------------------------------------------------ structure (the codec)

    def _structure(
        self, process: int, data: bytes, out: Outcome, count: bool = True
    ) -> Packet | None:
        """Counters and verdict of the checks of SPEC.md 5 up to "payload size"; the packet
        when it passes (counted as received per opcode unless *count* is False)."""
        out.events.append((process, EV_RX, 0))
        if len(data) > self.layout.max_datagram:
            out.drop(process, C.DROP_OVERSIZE)
            return None
        if len(data) < HEADER_SIZE:
            out.drop(process, C.DROP_TRUNCATED)
            return None
        if HEADER.read(data, "flags") & Flags.TAGGED and not self._tag_checks(process, data, out):
            return None
        try:
            packet = decode_packet(data)
        except RemoteProtocolError as exc:
            if data[O_OPCODE] in REPLY_OPCODES:
                out.drop(process, C.DROP_BAD_REPLY)
            else:
                out.nack(process, int(exc.status))
            return None
        if (
            packet.flags & Flags.TAGGED
            and is_control(packet.opcode)
            and self.layout.target != "switch"
        ):
            out.nack(process, Status.UNAUTHORIZED)  # a control tag where no admin tag key is set
            return None
        if packet.flags & Flags.TAGGED and not packet.coll_id and self.layout.target != "switch":
            # Under no tagged region's rkey (the fuzzer's regions are untagged): a wrong key,
            # never executed; a reply is never answered.
            if packet.opcode in REPLY_OPCODES:
                out.drop(process, C.DROP_BAD_REPLY)
            else:
                out.nack(process, Status.BAD_RKEY)
            return None
        if count:
            out.events.append((process, EV_OP, int(packet.opcode)))
        return packet

    def _tag_checks(self, process: int, data: bytes, out: Outcome) -> bool:
        """SPEC.md 2.6 for a TAGGED datagram from the fuzzer, which holds no collective's key:
        too short for its tag, dropped as truncated; at a node, one of no collective goes on to
        the structural checks and is then refused BAD_RKEY (it names no tagged region: the
        fuzzer's are untagged), and one of a collective not started there (none ever is, here)
        goes on only as CHAIN_ADD, ALL_WRITE or READ (BUSY or dropped: never executed). True:
        go on."""
        if len(data) < HEADER_SIZE + SEGMENT_SIZE * data[H_SEG_COUNT] + TAG_SIZE:
            out.drop(process, C.DROP_TRUNCATED)
            return False
        if self.layout.target == "switch":
            return True  # structure first, then refused (_at_switch)
        if is_control(data[O_OPCODE]):
            # A control tag is checked under the admin tag key, which the fuzzer never holds:
            # dropped as forged where the node has one; else refused after the structure.
            if self.layout.admin_tagged:
                out.drop(process, C.DROP_CONTROL_FORGED)
                return False
            return True
        if HEADER.read(data, "coll_id") == 0:
            return True
        if data[O_OPCODE] not in (Opcode.CHAIN_ADD, Opcode.ALL_WRITE, Opcode.READ):
            out.drop(process, C.DROP_COLL_EARLY)
            return False
        return True

    # ------------------------------------------------------------ a node

    def access(self, node: int, rkey: int, addr: int, nbytes: int, need: int, align: int) -> int:
        """SPEC.md 8: BAD_RKEY, NO_RIGHTS, OUT_OF_BOUNDS, MISALIGNED in that order; 0 when ok."""
        region = self._tables[node].get(rkey) if rkey else None
        if region is None:
            return int(Status.BAD_RKEY)
        if region.rights & need != need:
            return int(Status.NO_RIGHTS)
        if addr < region.base or addr - region.base + nbytes > region.size:
            return int(Status.OUT_OF_BOUNDS)
        if addr % align:
            return int(Status.MISALIGNED)
        return 0

    def _at_node(self, node: int, data: bytes, out: Outcome) -> None:
        packet = self._structure(node, data, out)
        if packet is not None:
            self._execute(node, packet, packet.addr, out, windowed=packet.client_id != 0)

    def _execute(self, node: int, packet: Packet, addr: int, out: Outcome, windowed: bool) -> None:
        """A structurally valid packet at *node* (operand address *addr*, node-local)."""
        op = packet.opcode
        if op in REPLY_OPCODES or op == Opcode.PING:
            return  # replies go to the control plane (events); PING is answered with INFO
        if op in CONTROL_OPCODES:
            out.nack(node, Status.UNAUTHORIZED)  # the fuzzer never holds the admin key
            return
        if op in POOL_OPCODES:
            out.nack(node, Status.BAD_FIELD)  # pool control goes to a switch (SPEC.md 11.9)
            return
        if op == Opcode.CHAIN_ADD:
            self._chain(node, packet, out)
            return
        esize = ELEMENT_BYTES[packet.dtype]
        if packet.coll_id and op in (Opcode.READ, Opcode.ALL_WRITE):
            # SPEC.md 4.1 and 5: a collective this node has not started (none ever is, here) is
            # answered before the rkey check: a repair READ BUSY, all-gather data dropped.
            if op == Opcode.READ:
                out.nack(node, Status.BUSY)
            else:
                out.drop(node, C.DROP_COLL_EARLY)
            return
        if op == Opcode.READ:
            status = self.access(node, packet.rkey, addr, packet.length, Rights.READ, esize)
            if status:
                out.nack(node, status)
            return
        if op == Opcode.UPDATE:
            self._update(node, packet, addr, out, windowed)
            return
        if op in (Opcode.FETCH_ADD, Opcode.CAS):
            status = self.access(node, packet.rkey, addr, packet.length, Rights.ATOMIC, 8)
        else:
            status = self.access(node, packet.rkey, addr, packet.length, Rights.WRITE, esize)
        if status:
            out.nack(node, status)
            return
        out.writes.append((node, addr, addr + packet.length))
        if op in WINDOWED_OPCODES and windowed:
            out.events.append((node, EV_WINDOW, 0))
            if out.kind == "accepted":
                out.kind = "windowed"

    def _update(self, node: int, packet: Packet, addr: int, out: Outcome, windowed: bool) -> None:
        """SPEC.md 6.8: READ on the optimizer descriptor; past it the verdict depends on the
        descriptor's bytes in node memory, which the fuzzer's own WRITEs change, so it is left
        open (one NACK of OPEN_STATUSES, or executed within the rkey's region)."""
        status = self.access(node, packet.rkey, addr, OPTIMIZER_BYTES, Rights.READ, 8)
        if status:
            out.nack(node, status)
            return
        region = self._tables[node][packet.rkey]
        out.writes.append((node, region.base, region.base + region.size))
        out.events.append((node, EV_OPEN, 0))
        if windowed:
            out.events.append((node, EV_WINDOW, 0))
        if out.kind == "accepted":
            out.kind = "windowed"

    def _chain(self, node: int, packet: Packet, out: Outcome) -> None:
        """SPEC.md 4: READ on the operand at every hop, forward to members, store at the last."""
        esize = ELEMENT_BYTES[packet.dtype]
        left = packet.segments_left
        hops = [endpoint_to_u64(ep) for ep in packet.segments]
        if packet.coll_id:
            out.nack(node, Status.BUSY)  # not started here: before the rkey check (SPEC.md 5)
            return
        while True:
            status = self.access(node, packet.rkey, packet.addr, packet.length, Rights.READ, esize)
            if status == 0 and left == 0:
                status = self.access(
                    node, packet.rkey, packet.aux_addr, packet.length, Rights.WRITE, esize
                )
            nxt = -1
            if status == 0 and left > 0:
                nxt = self._node_index.get(hops[len(hops) - left], -1)
                if hops[len(hops) - left] not in self._members:
                    status = Status.NOT_MEMBER
            if status:
                out.nack(node, status)
                return
            if left == 0:
                out.events.append((node, EV_STORED, 0))
                out.writes.append((node, packet.aux_addr, packet.aux_addr + packet.length))
                return
            out.events.append((node, EV_FWD, 0))
            if nxt < 0:
                # A member that is not a node: the switch, which answers chains NO_ROUTE.
                out.events.append((self.switch, EV_RX, 0))
                out.events.append((self.switch, EV_OP, int(Opcode.CHAIN_ADD)))
                out.nack(self.switch, Status.NO_ROUTE)
                return
            node, left = nxt, left - 1
            out.events.append((node, EV_RX, 0))
            out.events.append((node, EV_OP, int(Opcode.CHAIN_ADD)))

    # ------------------------------------------------------------ the switch

    def _at_switch(self, data: bytes, out: Outcome) -> None:
        sw = self.switch
        packet = self._structure(sw, data, out, count=False)
        if packet is None:
            return
        op = packet.opcode
        tagged = bool(packet.flags & Flags.TAGGED)
        punted = (
            op in REPLY_OPCODES or op in CONTROL_OPCODES or op in POOL_OPCODES or op == Opcode.PING
        )
        if tagged and is_control(op):
            # SPEC.md 2.6 "Control tags": under the admin tag key, which the fuzzer never holds;
            # a pool request with an rkey names a tenant (11.9, "Tenant tags"), and the fuzzer's
            # switch has none: UNAUTHORIZED.
            if op in POOL_OPCODES and packet.rkey:
                out.nack(sw, Status.UNAUTHORIZED)
            elif self.layout.admin_tagged:
                out.drop(sw, C.DROP_CONTROL_FORGED)
            else:
                out.nack(sw, Status.UNAUTHORIZED)
            return
        if tagged and (punted or op == Opcode.CHAIN_ADD or packet.flags & Flags.MCAST):
            # SPEC.md 11.3: only a pool request may carry a tag; a collective's run between nodes.
            if op in REPLY_OPCODES:
                out.drop(sw, C.DROP_BAD_REPLY)
            else:
                out.nack(sw, Status.BAD_FIELD)
            return
        if packet.flags & Flags.SPARSE:
            # SPEC.md 11.3: v1 switches do not relay sparse payloads; refused before the
            # by-opcode table (not counted per opcode).
            out.nack(sw, Status.BAD_FIELD)
            return
        out.events.append((sw, EV_OP, int(op)))
        if op in REPLY_OPCODES:
            out.drop(sw, C.DROP_UNEXPECTED_REPLY)
            return
        if op == Opcode.PING:
            return
        if op in CONTROL_OPCODES:
            out.nack(sw, Status.UNAUTHORIZED)
            return
        if op in POOL_OPCODES:
            # SPEC.md 11.9's order: a wrong admin key, ALLOC's undefined flags, then the
            # caller, who never holds the admin key nor a tenant's credential here.
            if (
                packet.rkey == 0
                and op == Opcode.ALLOC
                and ALLOC.read(packet.payload, "flags") & ~ALLOC_TAGGED
            ):
                out.nack(sw, Status.BAD_FIELD)
            else:
                out.nack(sw, Status.UNAUTHORIZED)
            return
        if op in (Opcode.CHAIN_ADD, Opcode.UPDATE):
            out.nack(sw, Status.NO_ROUTE)  # chains go to their first hop, UPDATEs to their node
            return
        if packet.flags & Flags.MCAST:
            if op != Opcode.ALL_WRITE:
                out.nack(sw, Status.BAD_FIELD)
            elif packet.aux_addr != self._group:
                out.nack(sw, Status.NO_ROUTE)
            else:
                for member in self.layout.group_members:
                    out.events.append((sw, EV_REPL, 0))
                    self._forwarded(member, packet, packet.addr, out)
            return
        status, node, local = self.translate(packet)
        region = self._region_of(packet.addr)
        if region is not None and status != Status.BAD_RKEY:
            # SPEC.md 11.3's tags, once the rkey is the region's: a tagged region needs a tag
            # under its key, which the fuzzer never holds (made up: dropped); an untagged one
            # takes no tag.
            if region.tag_key and tagged:
                out.drop(sw, C.DROP_REGION_FORGED)
                return
            if bool(region.tag_key) != tagged:
                status = Status.BAD_RKEY
        if status:
            out.nack(sw, status)
            return
        out.events.append((sw, EV_FWD, 0))
        self._forwarded(node, packet, local, out)

    def _region_of(self, addr: int) -> Region | None:
        k = bisect.bisect_right(self._pool_starts, addr) - 1
        return self._pool[k] if k >= 0 and addr < self._pool[k].end else None

    def translate(self, packet: Packet) -> tuple[int, int, int]:
        """SPEC.md 11.2-11.3 checks of a pool request, in order: (status, node, local)."""
        op = packet.opcode
        need, align = int(Rights.WRITE), ELEMENT_BYTES[packet.dtype]
        if op == Opcode.READ:
            need = int(Rights.READ)
        elif op in (Opcode.FETCH_ADD, Opcode.CAS):
            need, align = int(Rights.ATOMIC), 8
        k = bisect.bisect_right(self._pool_starts, packet.addr) - 1
        if k < 0 or packet.addr >= self._pool[k].end:
            return Status.NO_ROUTE, -1, -1
        region = self._pool[k]
        offset = packet.addr - region.gaddr
        if packet.rkey != region.rkey:
            return Status.BAD_RKEY, -1, -1
        if region.rights & need != need:
            return Status.NO_RIGHTS, -1, -1
        if offset + packet.length > region.size:
            return Status.OUT_OF_BOUNDS, -1, -1
        if offset % align:
            return Status.MISALIGNED, -1, -1
        if (
            region.stride
            and offset // region.stride != (offset + packet.length - 1) // region.stride
        ):
            return Status.SPANS_NODES, -1, -1
        node, local = region.locate(offset)
        return 0, node, local

    def _forwarded(self, node: int, packet: Packet, local: int, out: Outcome) -> None:
        """A request the switch forwards: the node sees the same packet with ``addr`` local,
        RELAYED and the client id filled (so always windowed), from a member (the VIP)."""
        out.events.append((node, EV_RX, 0))
        out.events.append((node, EV_OP, int(packet.opcode)))
        self._execute(node, packet, local, out, windowed=True)


# ---------------------------------------------------------------- tallies and checks


#: What a windowed request may be answered instead of executing or replaying (SPEC.md
#: "Memory semantics"): STALE, behind its client's window; BUSY, its set of the window held by
#: other rkeys' clients, which the clock decides (an entry idle for 2 s may be taken:
#: kernels.datapath._HOLD_US), so a run's timing can turn one into BUSY.
WINDOW_STATUSES = frozenset({Status.STALE, Status.BUSY})
#: What an UPDATE past its descriptor's access check may be answered (SPEC.md 6.8's later
#: checks), as node memory decides.
OPEN_STATUSES = frozenset(
    {
        Status.BAD_FIELD,
        Status.BAD_LENGTH,
        Status.NO_RIGHTS,
        Status.OUT_OF_BOUNDS,
        Status.MISALIGNED,
        Status.OUT_OF_STEP,
    }
)


def uncertain_nacks(expect: Expectation, deltas: Sequence[np.ndarray]) -> int:
    """NACKs the oracle left open that the processes sent: STALE and BUSY from the duplicate
    window and an UPDATE's later checks (counter_checks bounds them)."""
    statuses = (*WINDOW_STATUSES, *OPEN_STATUSES)
    sent = sum(int(d[C.NACK_BASE + s]) for d in deltas for s in statuses)
    predicted = sum(expect.count(p, EV_NACK, s) for p in range(len(deltas)) for s in statuses)
    return max(sent - predicted, 0)


@dataclass
class Expectation:
    """Sum of outcomes: per (process, event code, value), and per outcome kind."""

    events: Counter[tuple[int, int, int]] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    sent_by_opcode: Counter[int] = field(default_factory=Counter)

    def add(self, data: bytes, outcome: Outcome) -> None:
        self.events.update(outcome.events)
        self.kinds[outcome.kind] += 1
        self.sent_by_opcode[data[O_OPCODE] if len(data) > O_OPCODE else -1] += 1

    def count(self, process: int, code: int, value: int = 0) -> int:
        return self.events[(process, code, value)]


@dataclass(frozen=True)
class CounterCheck:
    """One identity between what the fuzzer predicts and what a process counted."""

    name: str
    counted: int
    low: int
    high: int

    @property
    def ok(self) -> bool:
        return self.low <= self.counted <= self.high

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "counted": self.counted,
            "expected": [self.low, self.high] if self.low != self.high else self.low,
            "ok": self.ok,
        }


@dataclass
class ProcessTraffic:
    """Traffic of the fuzzer's own besides the fuzz datagrams, per process."""

    pings: int = 0  # sync PINGs to the data port
    replies_received: int = 0  # datagrams the fuzzer's socket got from this process
    nacks_received: Counter[int] = field(default_factory=Counter)  # by status
    #: What reading the counters adds to them (node layout): the "after" request, the reply to
    #: the "before" one if it leaves through the data socket. Measured by reading them twice.
    overhead: np.ndarray = field(default_factory=lambda: np.zeros(C.NUM_COUNTERS, np.int64))


def counter_checks(
    layout: Layout,
    expect: Expectation,
    deltas: Sequence[np.ndarray],
    extra: Sequence[np.ndarray],
    traffic: Sequence[ProcessTraffic],
    slack: int,
) -> list[CounterCheck]:
    """Hold every process's counter deltas (node layout, netdam.protocol.counters) to the expectation.

    *extra*: per process the words beyond the node layout that matter (switch: forwarded,
    replicated; nodes: empty). *slack*: datagrams lost to full receive queues (the kernels'
    SO_RXQ_OVFL counts, every socket involved); with 0 every identity must hold exactly.
    """
    checks: list[CounterCheck] = []
    for p, (d, t) in enumerate(zip(deltas, traffic, strict=True)):
        name = layout.process_name(p)

        def add(what: str, counted: int, want: int, uncertain: int = 0, name: str = name) -> None:
            checks.append(
                CounterCheck(
                    f"{name}: {what}", int(counted), want - slack, want + uncertain + slack
                )
            )

        o = [int(v) for v in t.overhead]
        add("rx_packets", d[C.RX_PACKETS], expect.count(p, EV_RX) + t.pings + o[C.RX_PACKETS])
        for op in Opcode:
            want = (
                expect.count(p, EV_OP, op)
                + (t.pings if op == Opcode.PING else 0)
                + o[C.OPCODE_BASE + op]
            )
            if want or d[C.OPCODE_BASE + op]:
                add(f"received {op.name}", d[C.OPCODE_BASE + op], want)
        windowed = expect.count(p, EV_WINDOW)
        opened = expect.count(p, EV_OPEN)
        for status in Status:
            want = expect.count(p, EV_NACK, status) + o[C.NACK_BASE + status]
            uncertain = windowed if status in WINDOW_STATUSES else 0
            uncertain += opened if status in OPEN_STATUSES else 0
            if want or uncertain or d[C.NACK_BASE + status]:
                add(f"NACK {status.name}", d[C.NACK_BASE + status], want, uncertain)
        for index in DROP_COUNTERS:
            want = expect.count(p, EV_DROP, index) + o[index]
            if want or d[index]:
                add(C.counter_names()[index], d[index], want)
        nacks_sent = int(sum(int(d[C.NACK_BASE + s]) for s in Status))
        add("NACKs received by the fuzzer", sum(t.nacks_received.values()), nacks_sent)
        if p < len(layout.nodes):
            add("forwarded", d[C.FORWARDED], expect.count(p, EV_FWD))
            add("stored", d[C.STORED], expect.count(p, EV_STORED))
            sent_elsewhere = int(d[C.FORWARDED])
        else:
            forwarded, replicated = (int(v) for v in extra[p][:2])
            add("forwarded by the switch", forwarded, expect.count(p, EV_FWD))
            add("replicated by the switch", replicated, expect.count(p, EV_REPL))
            sent_elsewhere = forwarded + replicated
        # Every other datagram a process sent went to the fuzzer: nothing to third parties.
        add(
            "replies received by the fuzzer",
            t.replies_received,
            int(d[C.TX_PACKETS]) - sent_elsewhere - o[C.TX_PACKETS],
        )
    return checks


def unreached(
    target: str, reached_opcodes: Counter[int], nack_statuses: Counter[int]
) -> dict[str, list[str]]:
    """Opcodes and NACK statuses the run was expected to reach but did not."""
    return {
        "opcodes": [op.name for op in expected_opcodes(target) if not reached_opcodes[int(op)]],
        "statuses": [s.name for s in expected_statuses(target) if not nack_statuses[int(s)]],
    }


class MemoryGuard:
    """Bytes each node may legitimately change (the union of authorized writes so far), and a
    snapshot of node memory to compare everything else with."""

    def __init__(self, memories: Sequence[np.ndarray]) -> None:
        self.snapshots = [np.array(m, dtype=np.uint8, copy=True) for m in memories]
        self.masks = [np.zeros(m.shape[0], dtype=bool) for m in memories]
        self.violation_bytes = 0
        self.ranges: list[tuple[int, int, int]] = []  # (node, start, end), the first few

    def authorize(self, writes: Sequence[tuple[int, int, int]]) -> None:
        for node, start, end in writes:
            mask = self.masks[node]
            start, end = max(0, start), min(end, mask.shape[0])
            if start < end:
                mask[start:end] = True

    def read_matches(self, node: int, addr: int, data: bytes) -> bool | None:
        """Whether a READ_RESP's bytes from *node* at *addr* are the memory's: None when some
        byte of the range may have been written (unknown), else the comparison with the
        snapshot (bytes nobody may write never change)."""
        mask = self.masks[node]
        end = addr + len(data)
        if addr < 0 or end > mask.shape[0] or mask[addr:end].any():
            return None
        return bytes(self.snapshots[node][addr:end]) == data

    def check(self, memories: Sequence[np.ndarray], limit: int = 16) -> int:
        """Count bytes changed outside the authorized ones since the last check (each byte
        once: the snapshot takes the new value); return the new ones."""
        found = 0
        for node, (memory, snap, mask) in enumerate(
            zip(memories, self.snapshots, self.masks, strict=True)
        ):
            current = np.asarray(memory)
            bad = np.flatnonzero((current != snap) & ~mask)
            if bad.size == 0:
                continue
            snap[bad] = current[bad]
            found += int(bad.size)
            breaks = np.flatnonzero(np.diff(bad) != 1)
            starts = np.concatenate([[bad[0]], bad[breaks + 1]])
            ends = np.concatenate([bad[breaks], [bad[-1]]]) + 1
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                if len(self.ranges) < limit:
                    self.ranges.append((node, int(s), int(e)))
        self.violation_bytes += found
        return found
