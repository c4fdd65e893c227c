"""Named state bundles the kernels take instead of dozens of positional arrays.

numba passes a NamedTuple of arrays (nested ones too) as one argument, typed by its fields, and
caches kernels keyed by those types (``cache=True`` works). Each bundle is made in one place, by
its Python owner (``NodeCore.node_state``, ``SwitchCore.switch_state``, the shells' serve
buffers), which allocates and checks every array once; the kernels unpack the fields they use
in their first lines and trust them.
"""

from __future__ import annotations

import operator
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

B = TypeVar("B", bound=tuple[Any, ...])


class Kept(Generic[B]):
    """One bundle, made again only when one of its parts is another object than last time.

    An owner hands its kernels the same bundle object while its arrays stay the same objects,
    so a caller can tell an unchanged bundle by identity (netdam.kernels.serve.NicLoop skips
    numba's type dispatch for arguments it typed before). Every part is compared, not a flag an
    owner must remember to set: an array replaced anywhere makes a new bundle."""

    __slots__ = ("_bundle", "_parts")

    def __init__(self) -> None:
        self._bundle: B | None = None
        self._parts: tuple[Any, ...] = ()

    def of(self, make: type[B], *parts: Any) -> B:
        """``make(*parts)``, or the bundle made last time when every part is the same object."""
        bundle = self._bundle
        if (
            bundle is not None
            and len(parts) == len(self._parts)
            and all(map(operator.is_, parts, self._parts))
        ):
            return bundle
        made = make(*parts)
        self._bundle, self._parts = made, parts
        return made


class RxBatch(NamedTuple):
    """A received batch: datagram k is buf[off[k] : off[k] + len[k]], from src[k] (ip << 16 | port)."""

    buf: np.ndarray  # uint8
    off: np.ndarray  # int64
    len: np.ndarray  # int32
    src: np.ndarray  # uint64


class TxQueue(NamedTuple):
    """The send queue's arrays (netdam.core.sendqueue.SendQueue): datagrams packed back to back."""

    buf: np.ndarray  # uint8
    off: np.ndarray  # int64, off[n] is the next free byte
    len: np.ndarray  # int32
    dst: np.ndarray  # uint64
    slot: int  # room one datagram may need: constants.slot_bytes of the core's MTU


class Regions(NamedTuple):
    """The node's rkey table, open-addressed by key (wire.find_rkey; SPEC.md 6.1)."""

    key: np.ndarray  # uint32
    base: np.ndarray  # int64
    len: np.ndarray  # int64
    rights: np.ndarray  # uint8
    tag: (
        np.ndarray
    )  # uint64 (slots, 2): the region's tag key (k0, k1), zeros when untagged (SPEC.md 2.6)


class DupWindow(NamedTuple):
    """The at-most-once window per (client id, reply address, rkey) (SPEC.md section 7)."""

    cl_id: np.ndarray
    cl_key: np.ndarray  # u32 the rkey (the authority) each client slot belongs to
    cl_hi: np.ndarray
    cl_used: np.ndarray
    txn: np.ndarray
    state: np.ndarray
    len: np.ndarray
    reply: np.ndarray


class CollState(NamedTuple):
    """The collective engine's arrays (layout: the CFG_* and F_* words of netdam.kernels.collective)."""

    cfg: np.ndarray  # int64 CFG_* words
    done: np.ndarray  # uint8 per chunk (+ sparse tables)
    acked: np.ndarray  # uint8 per chunk
    f: np.ndarray  # float64 F_* clock words
    ring: np.ndarray  # uint64 members in ring order
    bounds: np.ndarray  # int64 block bounds
    cb: np.ndarray  # int64 chunk bounds per block
    sent: np.ndarray  # float64 last send time per chunk
    tries: np.ndarray  # uint8 per chunk
    agsent: np.ndarray  # uint8 all-gather sent per chunk


class CollSlots(NamedTuple):
    """The collective engine's slots (netdam.core.collective.CollectiveSlots): CollState's
    arrays with one row per slot, MAX_COLLECTIVES slots and the spare row last
    (netdam.kernels.collective); row s of every array is slot s's CollState."""

    cfg: np.ndarray  # int64 (rows, CFG_LEN)
    done: np.ndarray  # uint8 (rows, DONE_LEN)
    acked: np.ndarray  # uint8 (rows, MAX_CHUNKS)
    f: np.ndarray  # float64 (rows, F_LEN)
    ring: np.ndarray  # uint64 (rows, MAX_SEGMENTS)
    bounds: np.ndarray  # int64 (rows, MAX_SEGMENTS + 1)
    cb: np.ndarray  # int64 (rows, MAX_SEGMENTS + 1)
    sent: np.ndarray  # float64 (rows, MAX_CHUNKS)
    tries: np.ndarray  # uint8 (rows, MAX_CHUNKS)
    agsent: np.ndarray  # uint8 (rows, MAX_CHUNKS)


class Guard(NamedTuple):
    """Source guard of a node or switch (netdam.kernels.guard): lockout table and token key."""

    cfg: np.ndarray  # float64 G_* words: now, lockout on, burst, rate, t0, tmax, forget, factor
    key: np.ndarray  # uint64 [2]: SipHash key of address-validation tokens
    ep: np.ndarray  # uint64 per entry: source endpoint (0 = free)
    tokens: np.ndarray  # float64 per entry: failures left in the bucket
    seen: np.ndarray  # float64 per entry: time of the last failure
    until: np.ndarray  # float64 per entry: locked out until
    set_until: np.ndarray  # float64 per set: the whole set locked until
    set_strikes: np.ndarray  # int64 per set: lockouts since the set was last quiet
    set_last: np.ndarray  # float64 per set: end of the last lockout


class TraceRing(NamedTuple):
    """The NIC's trace (netdam.kernels.trace, SPEC.md 6.7): record k of those written lives in
    row k % slots, laid out as the wire's trace record; no rows: tracing is off."""

    rec: np.ndarray  # uint8 (slots, TRACE_RECORD_BYTES)
    cursor: np.ndarray  # int64 [1]: records written so far (the next record's number)


class NodeState(NamedTuple):
    """Everything a node's datapath reads or changes besides the batches."""

    mem: np.ndarray  # uint8 node memory
    regions: Regions
    members: np.ndarray  # uint64 sorted cluster members
    window: DupWindow
    coll: CollSlots  # the per-packet code gets one slot's CollState in its place (collective.for_collective)
    counters: np.ndarray  # uint64 (protocol/counters.py)
    trace: TraceRing


class HoldTable(NamedTuple):
    """Datagrams fault injection holds aside (reorder, delay) until their release (kernels/faults.py)."""

    buf: np.ndarray  # uint8 (slots, SLOT_BYTES)
    len: np.ndarray  # int32, 0 = free slot
    ep: np.ndarray  # uint64 source (receive side) or destination (transmit side)
    tag: np.ndarray  # int64 which side holds it (the switch: DIR_RX / DIR_TX; a node: 0)
    time: np.ndarray  # float64 release time
    gen: np.ndarray  # int64 batch generation it was held in


#: FaultState.cfg (float64) indices; cfg[FC_LOSS : FC_DELAY_S + 1] is the rates vector that
#: faults.decide_fate takes (its P_* order).
FC_ACTIVE, FC_LOSS, FC_DUP, FC_REORDER, FC_DELAY, FC_DELAY_S, FC_NOW, FC_GEN = range(8)
FC_LEN = 8
#: FaultState.keys (uint64) and LinkFaults.fkeys indices: the seed, then the own endpoint.
FK_SEED, FK_ME = 0, 1
#: LinkFaults.fclock (float64) indices: the clock (s) and the batch generation.
FCLOCK_NOW, FCLOCK_GEN = 0, 1
#: The send queue's cursor (int64[2], beside a TxQueue): datagrams TXQ_HEAD .. TXQ_TAIL - 1 wait.
TXQ_HEAD, TXQ_TAIL = 0, 1


class FaultState(NamedTuple):
    """Receive-side fault injection of a node process (netdam.kernels.faults): the spec as
    floats, the (seed, own endpoint) keys, the attempt-count table and the held datagrams."""

    cfg: np.ndarray  # float64 FC_*: active, loss, dup, reorder, delay, delay_s, now, generation
    keys: np.ndarray  # uint64 FK_*: seed, own endpoint
    table_key: np.ndarray  # uint64
    table_count: np.ndarray  # uint32
    hold: HoldTable


class ServeIO(NamedTuple):
    """One compiled serve call's sockets and limits."""

    fd: int  # data socket
    mfd: int  # joined multicast group's socket, -1: none
    cfd: int  # management socket (traffic there ends the call)
    recv_bytes: int  # the first recv_bytes of the receive buffer take GRO runs
    max_n: int  # datagrams per round
    max_len: int  # largest datagram the MTU allows
    timeout_ms: int  # longest wait for traffic
    max_rounds: int  # rounds before the control plane's turn
    io_state: np.ndarray  # int64 (netdam.kernels.udp_io STATE_LEN)
    scratch: np.ndarray  # int64 sendmmsg scratch


class SwitchPorts(NamedTuple):
    """The switch's configuration words and its nodes (port p = node p-1; port 0 = clients)."""

    cfg: np.ndarray  # int64 CFG_* words (netdam.kernels.switch_path)
    nodes_ep: np.ndarray  # uint64 node endpoints by rank
    node_sorted: np.ndarray  # uint64 node endpoints, sorted
    node_port: np.ndarray  # int64 port of each sorted endpoint


class RegionTable(NamedTuple):
    """The pool's address map as the translate kernel reads it (switch/addrmap.py)."""

    base: np.ndarray
    end: np.ndarray
    rkey: np.ndarray
    rights: np.ndarray
    stride: np.ndarray
    ways: np.ndarray
    way0: np.ndarray
    way_node: np.ndarray
    way_local: np.ndarray
    tag: np.ndarray  # uint64 (regions, 2): a tagged region's key (k0, k1), zeros when untagged


class Groups(NamedTuple):
    """Multicast groups the switch replicates to: key -> member[first : first + size]."""

    key: np.ndarray
    first: np.ndarray
    size: np.ndarray  # members per group
    member: np.ndarray


class SwitchCounters(NamedTuple):
    """The node counter layout, the switch's own section, per-port and per-region counters."""

    counters: np.ndarray
    sw: np.ndarray
    port_ctr: np.ndarray
    reg_ctr: np.ndarray


class LinkFaults(NamedTuple):
    """Per-link, per-direction fault injection of the switch and its held datagrams."""

    fcfg: np.ndarray  # float64 (ports, 2, F_*)
    fkeys: np.ndarray  # uint64 FK_*: seed, VIP
    fclock: np.ndarray  # float64 FCLOCK_*: now, generation
    fstate: np.ndarray  # int64 FS_* flags and held counts
    ftab_key: np.ndarray
    ftab_count: np.ndarray
    kctr: np.ndarray  # int64 (ports, 2, 64) packets per opcode, for k-th drops
    hold: HoldTable


class Tenants(NamedTuple):
    """The pool's tenants as the switch's datapath checks their sealed ALLOC/FREE/QUERY
    (SPEC.md 11.9, "Tenant tags"; netdam.cluster.tenants derives both)."""

    ids: np.ndarray  # uint32, sorted: each tenant's id (the rkey of its sealed requests)
    keys: np.ndarray  # uint64 (tenants, 2): its tag key (k0, k1), in the order of ids


class SwitchState(NamedTuple):
    """Everything the switch's datapath reads or changes besides the batches."""

    ports: SwitchPorts
    regions: RegionTable
    groups: Groups
    ctrs: SwitchCounters
    faults: LinkFaults
    guard: Guard
    tenants: Tenants


class TimeWindow(NamedTuple):
    """A benchmark phase in monotonic ns: counting inside [start, end), running until stop."""

    start: int
    end: int
    stop: int


class SinkCheck(NamedTuple):
    """What a benchmark sink verifies: each datagram's payload words against *expect64*."""

    expect64: np.ndarray  # uint64 expected payload words per packet id
    pkt_len: int
    payload_off: int
    verify: bool
    tag: int  # the phase's seq tag (udp_io.SEQ_TAG_SHIFT); earlier tags are stale, not wrong


class GenPlan(NamedTuple):
    """A closed-loop request generator's requests (netdam.kernels.pool_gen)."""

    templates: np.ndarray  # uint8 (n, width) request templates
    t_len: np.ndarray  # int64 length of each
    n_templates: int
    window: int  # requests in flight
    dst: int  # uint64 endpoint
    id_off: int  # where the request id sits in a template, and its bytes
    id_bytes: int
    ok_off: int  # a reply is good when reply[ok_off] == ok_byte (ok_off < 0: any reply)
    ok_byte: int
    timeout_ns: int
    tag: np.ndarray  # uint64 [2]: the region's tag key (k0, k1); zeros: requests go unsealed
