"""Host API with torch.distributed names: ``init``, ``all_reduce``, ``reduce_scatter``,
``all_gather``, ``broadcast``, ``barrier``, and ``empty`` arrays that live in NIC memory.

The host only stages data and starts collectives: it stores its input into its node's memory
through the shared mapping (the CXL/PCIe stand-in), sends START_COLL to its node, and waits for
the completion the node sends back. The NICs run the collective among themselves.

Every rank must call the same collectives in the same order (each call is one epoch of the
group), as with torch.distributed and MPI.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import fcntl
import heapq
import math
import os
import re
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from netdam.cluster.clusterfile import (
    ClusterFile,
    NodeEntry,
    derive,
    derived_key,
    group_secret,
    load_cluster,
)
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.tracing import collect, mark, nics_of, write_trace
from netdam.core.chunk_plan import chunk_bounds
from netdam.core.host import Call, CallQueue, Heard, txn_for
from netdam.core.timeline import HostCall, chrome_trace
from netdam.core.torus import TorusStep, splits, torus_groups, torus_shape, torus_steps
from netdam.kernels.host_calls import AnswerReader, StartStamper
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    MAX_SEGMENTS,
    NUMPY_DTYPE,
    TAG_SIZE,
    DType,
    Opcode,
    Rights,
    Status,
    max_elements,
)
from netdam.protocol.constants import ReduceOp as WireOp
from netdam.protocol.elements import BFLOAT16, bf16_round, bf16_values, is_bf16
from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Endpoint, Packet, StartCollTemplate, endpoint_to_u64
from netdam.protocol.payloads import (
    FLAG_AWAIT_STARTED,
    FLAG_SPARSE,
    FLAG_UPDATE,
    Algo,
    CollectiveDescriptor,
    unpack_completion,
    unpack_descriptor,
)
from netdam.shell.shm import attach
from netdam.shell.startup import CORES as _CORES
from netdam.shell.udp import MULTICAST_PORTS

__all__ = [
    "CollectiveError",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "bfloat16",
    "broadcast",
    "destroy_process_group",
    "empty",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init",
    "init_process_group",
    "is_initialized",
    "new_group",
    "NON_GROUP_MEMBER",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "trace",
]

#: Where a job's name comes from when init() is given none: two jobs on one cluster file
#: (one process per rank each) run side by side when their names differ.
ENV_JOB = "NETDAM_JOB"
#: Issue lanes of a rank (each its own staging room): the default group's, and 3 that the
#: groups new_group makes take in turn. A lane runs one collective at a time, in issue order;
#: lanes run side by side on the node (4: its MAX_COLLECTIVES slots, SPEC.md 4.1).
LANES = 4
#: The share of the arena's staging half the default group keeps once new_group was called
#: (a torus makes its rows' and columns' groups): the rest is cut into the groups' lanes
#: (ProcessGroup._staging_region).
GROUPS_STAGING_SHARE = (3, 4)
#: Seconds the progress thread drives a rank after its last call ended (_ProgressHub).
PROGRESS_LINGER_S = 1.0
#: What a closed group holds in place of its node's memory (ProcessGroup.close).
_DETACHED = np.zeros(0, np.uint8)
#: Early chains the shipped node holds for a collective its host has not started yet
#: (netdam.kernels.collective.EARLY_SLOTS, SPEC.md 4.1 "Early chains"); past them, BUSY.
EARLY_CHAINS_HELD = 64
#: Seconds a PING round's answer names the silent nodes in the errors of other calls of the
#: process (_SilentNames): one node's death fails every rank a process plays at once, and a
#: round costs 0.5 s with a node silent. Each rank's wait asking again, one thread waiting on
#: 7 ranks of 8 (node 7 stopped) raised the last error 4.6 s after the call; sharing the
#: round, 1.6 s, every error with the first.
NAMING_REUSE_S = 1.0
#: Seconds per try (3 tries) of the DEREGISTER that gives a rank's arena back at close: a live
#: node answers in well under a millisecond; the next job re-deregisters an arena left behind.
DEREGISTER_TIMEOUT_S = 0.25
#: Tries (1 s each) of the JOIN that moves a rank's node to its torus row's multicast group,
#: made once per group. On a loaded 2-core machine running the whole suite, a node starting 8
#: NICs' worth of groups once left a JOIN unanswered for the default 3 tries, and the group
#: failed to build; a JOIN again under the same txn_id is answered, not applied twice.
JOIN_TRIES = 6


class ReduceOp(IntEnum):
    """torch.distributed's reduce operations. SUM, MIN and MAX run in the NICs (their values are
    the wire's, SPEC.md: a protocol ReduceOp passes as well). AVG is SUM in the NICs, then each
    host divides by the world size (floating dtypes only: every rank divides the same bits by
    the same number, so ranks stay bitwise identical). PRODUCT has no operation on the wire
    (the NIC's datapath adds, takes minima and maxima): the NICs all-gather every rank's tensor
    and each host multiplies them in rank order, so every rank computes the same bits; it moves
    world_size times the bytes of a SUM (numeric dtypes)."""

    SUM = int(WireOp.SUM)
    MIN = int(WireOp.MIN)
    MAX = int(WireOp.MAX)
    AVG = 100
    PRODUCT = 101


def _wire_op(op: int, array: np.ndarray) -> WireOp:
    """The operation the NICs run for *op* on *array*'s dtype; ValueError when none can."""
    if op == ReduceOp.AVG:
        if not _is_floating(array):
            raise ValueError(
                f"ReduceOp.AVG needs a floating dtype, not {array.dtype}: the average of "
                "integers is not an integer (reduce with SUM and divide yourself)"
            )
        return WireOp.SUM
    if op == ReduceOp.PRODUCT:
        if array.dtype.kind not in "fiu":
            raise ValueError(f"ReduceOp.PRODUCT needs a numeric dtype, not {array.dtype}")
        return WireOp.SUM  # never sent: PRODUCT runs as an all-gather (_product_of_ranks)
    try:
        return WireOp(int(op))
    except ValueError:
        raise ValueError(
            f"unknown reduce op {op!r}: use netdam.ReduceOp.SUM, MIN, MAX, AVG or PRODUCT"
        ) from None


def _as_array(tensor: Any, name: str) -> np.ndarray:
    """A numpy view of *tensor*: numpy arrays as they are, CPU torch tensors without a copy
    (results written into the view land in the tensor)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    module = type(tensor).__module__
    if module.startswith("torch"):
        if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
            raise ValueError(
                f"{name} is on {tensor.device}: netdam reduces CPU tensors (call .cpu())"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name} is not contiguous: call .contiguous() first (results are written in place)"
            )
        if tensor.requires_grad:
            tensor = tensor.detach()
        if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16: its bits, marked
            return np.asarray(tensor.view(sys.modules["torch"].int16).numpy()).view(bfloat16)
        return np.asarray(tensor.numpy())
    raise TypeError(
        f"{name} must be a numpy array or a CPU torch tensor, not {type(tensor).__name__}"
    )


_ALIGN = 64


#: Seconds without progress before a collective fails (--timeout overrides). Issue 8 asks for an
#: error naming a dead node within 5 s: 2.5 s of stall, plus up to 1 s to PING the members and
#: name the dead ones, leaves room on a loaded machine; a live chain never stalls for 2.5 s (the
#: longest retransmission timeout is 100 ms, SPEC section 4.1).
DEFAULT_WATCHDOG_S = 2.5


class CollectiveError(NetdamError, RuntimeError):
    """A collective failed; ``waiting_for`` names what never arrived (node, block, seq range)."""

    def __init__(
        self, message: str, waiting_for: dict[str, object] | None = None, status: int = 0
    ) -> None:
        super().__init__(message)
        self.waiting_for = waiting_for
        #: The node's status when it refused or failed the collective (0: none was given).
        self.status = status


# bf16's numpy stand-in is uint16, which must not reduce as bf16 unmarked: it is told apart below.
_DTYPES = {
    np.dtype(v): DType(k) for k, v in NUMPY_DTYPE.items() if k not in (DType.RAW, DType.BF16)
}

#: bfloat16 for numpy, which has none: 16-bit patterns marked so the NICs reduce them as bf16
#: (SPEC.md 2.4), e.g. ``netdam.empty(n, netdam.bfloat16)``. CPU ``torch.bfloat16`` tensors and
#: ``ml_dtypes.bfloat16`` arrays are taken as they are.
bfloat16 = BFLOAT16


def wire_dtype(array: np.ndarray) -> DType:
    """The NIC datatype of *array*'s elements (SPEC.md 2.4); TypeError for one the NIC lacks."""
    if is_bf16(array):
        return DType.BF16
    try:
        return _DTYPES[
            array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        ]
    except KeyError:
        raise TypeError(
            f"dtype {array.dtype} is not supported: use float32, float16, bfloat16 (netdam.bfloat16 "
            "for numpy), int32, int64 or float64"
        ) from None


def _is_floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or is_bf16(array)


def _divide(array: np.ndarray, divisor: int) -> None:
    """*array* /= *divisor* in place; bf16 in float32, rounded once (as torch divides bf16)."""
    if is_bf16(array):
        bits = array.view(np.uint16)
        bits[...] = bf16_round(bf16_values(bits) / np.float32(divisor))
    else:
        np.divide(array, divisor, out=array, casting="unsafe")


def _multiply(product: np.ndarray, factor: np.ndarray) -> None:
    """*product* *= *factor* in place; bf16 in float32, rounded once per product."""
    if is_bf16(product):
        bits = product.view(np.uint16)
        with np.errstate(over="ignore", invalid="ignore"):
            bits[...] = bf16_round(bf16_values(bits) * bf16_values(factor.view(np.uint16)))
    else:
        np.multiply(product, factor, out=product)


def collective_tag_key(secret: bytes, coll_id: int, epoch: int) -> bytes:
    """The 128-bit tag key of one collective (SPEC.md 2.6), the same on every rank: its members'
    datagrams carry SipHash tags under it, which nobody without it can make."""
    return derive(secret, "collective-tag", coll_id, epoch)[:16]


def collective_key(secret: bytes, coll_id: int, epoch: int) -> int:
    """The rkey of one collective (group *coll_id*, call *epoch*), the same on every rank: its
    node installs it over that collective's buffers alone, for members only, until it ends
    (SPEC.md 4.1)."""
    return derived_key(secret, "collective", coll_id, epoch)


class ArenaInUseError(NetdamError, RuntimeError):
    """Another live process (another job on the same cluster file) holds this rank's arena."""


def arena_lock_path(node: NodeEntry, job: str = "") -> Path:
    """The lock file of rank *node*'s arena of *job*: beside its memory file, on the host that
    runs it (``netdam down`` removes every job's)."""
    return Path(f"{node.memory_file}.arena.{job}.lock" if job else f"{node.memory_file}.arena.lock")


def check_job_name(job: str) -> str:
    """*job*, when it is a job name: up to 32 letters, digits, '-', '_' or '.' ('' is the
    cluster file's default job)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{0,32}", job):
        raise ValueError(
            f"job name {job!r}: use up to 32 letters, digits, '-', '_' or '.' "
            f"(init(..., job='b') or ${ENV_JOB}=b)"
        )
    return job


#: The arena locks this process holds: lock file -> [open file, groups using it]. A process
#: is one job: its groups of one rank share the lock (the newest takes the arena, as before).
_ARENA_LOCKS: dict[Path, list[Any]] = {}
#: ProcessGroup._polls_before_sleeping's answers by (cluster, job, members), asked on every
#: wake of a wait(): cleared whenever this process takes or lets go of an arena (the ranks it
#: plays change). Computed on each wake, the answer took ~30 us of the call.
_POLLS: dict[tuple[str, str, tuple[int, ...]], bool] = {}


def _hold_arena_lock(node: NodeEntry, rank: int, job: str) -> Path:
    """An exclusive flock on the arena's lock file, held until the last group of this process
    for that rank closes (the kernel drops it when the process dies, so a crashed job's arena
    is taken back as before). The holder's pid is written in it, for the error another job
    gets. Returns the lock file, for _release_arena_lock."""
    path = arena_lock_path(node, job)
    held = _ARENA_LOCKS.get(path)
    if held is not None:
        held[1] += 1
        return path
    lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ArenaInUseError(
            f"rank {rank}: another process (pid {holder}) runs this rank of job {job or '(default)'!r} on node "
            f"{node.address}:{node.port}: one process per rank and job; give the second job a name of its "
            f"own (init(..., job='b') or ${ENV_JOB}=b) to run beside the first, or wait for it to end"
        ) from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _ARENA_LOCKS[path] = [lock, 1]
    _POLLS.clear()  # the ranks this process plays changed
    return path


def _release_arena_lock(path: Path) -> None:
    held = _ARENA_LOCKS.get(path)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _ARENA_LOCKS[path]
        _POLLS.clear()  # the ranks this process plays changed
        held[0].close()  # releases the flock


@dataclass
class _Attached:
    """A rank's mapping of its node's memory (shm.attach), shared by its default group and the
    groups new_group copies from it, so that closing the default group detaches them all."""

    memory: np.ndarray
    view: np.ndarray


class _StartShape(NamedTuple):
    """Every input of a group's START_COLL but its per-call fields (epoch, txn_id, the keys:
    StartCollTemplate.moved). ProcessGroup.start keeps the template of the last shape and
    builds one again when the shape changes, so no field can be left stale."""

    algo: Algo
    rank: int
    elements: int  # count (a tuple's method takes that name)
    in_addr: int
    out_addr: int
    root: int
    timeout_ms: int
    flags: int
    group: Endpoint | None  # the multicast group of the all-gather, or None
    client_id: int
    admin_key: int
    coll_id: int
    dtype: DType
    op: WireOp
    segments: tuple[Endpoint, ...]
    update: tuple[int, int]  # the header's addr and aux_addr (a fused update)

    def template(self, epoch: int, key: int, tag_key: bytes) -> StartCollTemplate:
        """The START_COLL of this shape (with a call's *epoch* and keys), as a template."""
        payload = CollectiveDescriptor(
            self.algo,
            self.rank,
            self.elements,
            self.in_addr,
            self.out_addr,
            key,
            root=self.root,
            group=self.group,
            timeout_ms=self.timeout_ms,
            flags=self.flags,
            tag_key=tag_key,
        ).encode()
        return StartCollTemplate.of(
            Packet(
                Opcode.START_COLL,
                client_id=self.client_id,
                rkey=self.admin_key,
                coll_id=self.coll_id,
                epoch=epoch,
                dtype=self.dtype,
                reduce_op=self.op,
                segments=self.segments,
                addr=self.update[0],
                aux_addr=self.update[1],
                length=len(payload),
                payload=payload,
            )
        )


@dataclass
class ProcessGroup:
    """One rank's view of the cluster: its node, its memory there (the arena), the group's keys.

    The arena is the part of node memory this rank owns (one REGISTER, placed by the node, so
    it never overlaps a pool tenant's or another client's region): ``empty()`` arrays fill its
    lower half, collectives stage their buffers in its upper half. Default size: half of node
    memory (the rest stays free for pool regions and other clients); ``arena_bytes`` sets it."""

    cluster: ClusterFile
    rank: int
    multicast: bool = True
    #: Watchdog override, seconds without progress; None: DEFAULT_WATCHDOG_S.
    timeout_s: float | None = None
    epoch: int = 0
    arena_bytes: int | None = None
    #: The job this process's ranks belong to ('' the default; ENV_JOB when not given): its
    #: collectives have keys and coll_ids of their own, and its own arena on each node.
    job: str | None = None
    #: The most ranks one collective's chain names (its SR list, SPEC.md 4): past it,
    #: all_reduce runs as a torus of chains (SPEC.md 4.2, core/torus.py). Lower it to study
    #: the torus on a small cluster.
    max_chain: int = MAX_SEGMENTS
    #: True once a START_COLL of this group was ACKed: its epochs follow the nodes'.
    _epoch_settled: bool = field(init=False, default=False)
    _attached: _Attached = field(init=False, repr=False)
    client: ControlClient = field(init=False, repr=False)
    _next_free: int = field(init=False, default=0)
    #: Every lane of this rank (LANES) and the rules of their START_COLLs, sans-I/O
    #: (core/host.py): the default group's, shared by the groups new_group makes. A lane holds
    #: one node slot (SPEC.md 4.1): only its first call has been sent, and each next one is
    #: sent the moment the one before it ends, so several can be in flight (async_op).
    _calls: CallQueue = field(init=False, repr=False)
    #: This group's lane.
    lane: int = field(init=False, default=0)
    #: Staging room the next start() gives its Work, from _staging_room.
    _pending_room: tuple[int, int] | None = field(init=False, default=None)
    #: Works holding staging room until their results are copied out, in issue order.
    _holding: list[Work] = field(init=False, default_factory=list)
    #: Held by whoever reads this rank's control socket and moves the lanes on: a wait() and
    #: the progress thread, which sends each queued START_COLL when the one before it ended
    #: even while this rank's host is busy elsewhere (its peers' chains would stall).
    _lock: threading.RLock = field(init=False, default_factory=threading.RLock)
    #: When this default group's last call ended (the progress thread lingers after it).
    _emptied: float = field(init=False, default=0.0)
    #: Threads (idents) in a Work's wait on this default group, asleep in select() on its
    #: socket: another thread that takes answers wakes them (_take_answers).
    _waiters: set[int] = field(init=False, default_factory=set)
    #: First calls of groups not settled yet (``_epoch_settled``), on the default group: the
    #: progress thread watches the socket until each is answered (_progress_state).
    _settling: list[Work] = field(init=False, default_factory=list)
    #: Wakes the progress thread from its wait at once: set by close() (it ends) and by a torus
    #: all-reduce begun (it watches the socket).
    _closed: bool = field(init=False, default=False)
    #: The group's ranks, as ranks of the cluster (its default group), in group-rank order;
    #: ``rank`` is this process's place among them and ``global_rank`` its place in the cluster.
    members: tuple[int, ...] = field(init=False, default=())
    global_rank: int = field(init=False, default=0)
    #: The group's coll_id (SPEC.md 4.1): derived from the job's secret, the members and the
    #: group's number (group_coll_id): the same on every member, in every collective's key.
    coll_id: int = field(init=False, default=1)
    #: The default group this one was made from (itself for the default group): it owns the
    #: arena, the control socket and the lanes of every group of this rank.
    _root: ProcessGroup | None = field(init=False, default=None, repr=False)
    #: Groups new_group made on this rank (the default group's count): the staging region
    #: shrinks once there is one, and group n takes lane 1 + (n - 1) % (LANES - 1).
    _made_groups: int = field(init=False, default=0)
    #: Past max_chain ranks: the sub-groups of this group's torus (rows, columns, rows'
    #: gathers) this rank is a member of, by their index in core/torus.torus_groups.
    _torus: dict[int, ProcessGroup] = field(init=False, default_factory=dict)
    #: The SR list of this group's collectives and the members it was built for (_segments).
    _segment_list: tuple[Endpoint, ...] = field(init=False, default=(), repr=False)
    _segments_of: tuple[int, ...] = field(init=False, default=(), repr=False)
    #: The START_COLL of this group's last call and its shape (start): the next call of the
    #: same shape writes its own fields into a copy of its bytes.
    _start_template: tuple[_StartShape, StartStamper] | None = field(
        init=False, default=None, repr=False
    )
    #: The torus all-reduces of this rank in flight (the default group's list): each releases
    #: its next collective when the one before it ended, whoever drives the rank.
    _pipelines: list[TorusWork] = field(init=False, default_factory=list)
    #: As a torus's group: the failure of one of its all-reduces, which fails the later ones
    #: (their sub-groups' epochs no longer agree between ranks: shrink() makes a new group).
    _torus_failed: CollectiveError | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.cluster.nodes):
            raise ValueError(
                f"rank {self.rank} out of range: the cluster has {len(self.cluster.nodes)} nodes"
            )
        if not 2 <= self.max_chain <= MAX_SEGMENTS:
            raise ValueError(f"max_chain {self.max_chain}: give 2..{MAX_SEGMENTS} (SPEC.md 4.2)")
        node = self.cluster.nodes[self.rank]
        self.members = tuple(range(len(self.cluster.nodes)))
        self.global_rank = self.rank
        self._root = self
        memory = attach(node.memory_file)
        self._attached = _Attached(memory, np.asarray(memory))
        # Read on every call (_offset_of): the mapping's address.
        self._memory_base = int(memory.__array_interface__["data"][0])
        # One job's rank at a time owns this rank's arena: a second one gets an error here,
        # where it used to take (and wipe) the first one's arena.
        self.job = check_job_name(os.environ.get(ENV_JOB, "") if self.job is None else self.job)
        self._arena_lock: Path | None = _hold_arena_lock(node, self.rank, self.job)
        self.client = ControlClient.for_cluster(self.cluster)
        self._secret = group_secret(self.cluster)
        # The multicast group is the cluster's, whatever the job: a node joins one group, and
        # each datagram names its collective (every job's all-gathers reach the nodes).
        digest = derive(self._secret, "multicast")
        self.group: Endpoint = (
            f"239.77.{digest[4]}.{digest[5] or 1}",
            MULTICAST_PORTS[int.from_bytes(digest[6:8], "big") % len(MULTICAST_PORTS)],
        )
        if self.job:
            # A named job's keys, coll_ids and arena keys are its own (SPEC.md 4.1, "Jobs").
            self._secret = derive(self._secret, "job", self.job)[:16]
        self.coll_id = group_coll_id(self._secret, self.members, 0)
        self.epoch = self._settled_epoch()
        self._calls = CallQueue(self.client.client_id, LANES, self.client.encode)
        #: Reads the socket's answers (_take_answers; under _lock, as the lanes), which are
        #: read without waiting: non-blocking, so that no send on it polls first (CPython does
        #: on a socket with a timeout; the control client's exchanges leave the mode as it was).
        self._answers = AnswerReader()
        self.client.sock.setblocking(False)
        #: The arena's rkey on this rank's node; ring-host's WRITEs use the next rank's.
        self.arena_rkey = self.arena_key_of(self.rank)
        self.arena_base, self.arena_size = self._claim_arena()
        if self.multicast:
            try:
                self._join(self.group, retries=2)
            except ControlError:
                self.close()  # the arena, its lock and the socket go back: nothing is left held
                raise
        self._torus = self._make_torus(self.members)

    def _make_torus(self, members: Sequence[int]) -> dict[int, ProcessGroup]:
        """The sub-groups of the torus of *members* (cluster ranks) that this rank belongs to,
        made with new_group on every rank alike (member or not), in core/torus.py's order, so
        their numbers, lanes and coll_ids agree everywhere. None below max_chain ranks, and none
        for a count that does not split (all_reduce then says why)."""
        if len(members) <= self.max_chain or not splits(len(members), self.max_chain):
            return {}
        made = {}
        rows, size = torus_shape(len(members), self.max_chain)
        for index, sub in enumerate(torus_groups(len(members), self.max_chain)):
            ranks = [members[i] for i in sub]
            group = self.new_group(ranks)
            if isinstance(group, ProcessGroup):
                if not rows <= index < rows + size:  # a row's (its two groups), not a column
                    self._multicast_row(group, ranks)
                made[index] = group
        return made

    def _multicast_row(self, group: ProcessGroup, ranks: Sequence[int]) -> None:
        """A torus row's all-gathers (and first DONEs) go to a multicast group of the row's own,
        which this rank's node joins in place of the cluster's (a node joins one group, and
        past max_chain ranks no collective multicasts to the cluster's: SPEC.md 4.2), so a
        chunk of the gather is one send heard by the row's NICs only, where unicast sends it
        once per member. Derived from the cluster's secret, not the job's: every job's row of
        these NICs shares it (the coll_id tells their datagrams apart), and none leaves it."""
        if not self.multicast:
            return
        digest = derive(group_secret(self.cluster), "multicast row", *ranks)
        endpoint = (f"239.77.{digest[0]}.{digest[1] or 1}", self.group[1])
        self._join(endpoint, retries=JOIN_TRIES - 1)
        group.multicast, group.group = True, endpoint

    def _join(self, group: Endpoint, retries: int) -> None:
        """JOIN this rank's node to *group*; a refusal says what holds the group's port."""
        try:
            self.client.request(
                self.node,
                Packet(Opcode.JOIN, rkey=self.cluster.admin_key, addr=_endpoint_u64(group)),
                retries=retries,
            )
        except ControlError as exc:
            if exc.status != Status.IN_USE:
                raise
            raise ControlError(
                f"rank {self.global_rank}'s node {self.node[0]}:{self.node[1]} cannot join the "
                f"multicast group {group[0]}:{group[1]}: another socket on its machine holds UDP "
                f"port {group[1]} (see `ss -uanp sport = :{group[1]}`); close it, or pass "
                "multicast=False",
                exc.status,
                exc.payload,
            ) from None

    def arena_key_of(self, rank: int) -> int:
        return derived_key(self._secret, "arena", rank)

    def _claim_arena(self) -> tuple[int, int]:
        """(base, size) of the arena, REGISTERed wherever the node has room. Without
        ``arena_bytes``: half of node memory, or a quarter or an eighth when other owners hold
        more than half."""
        total = self.memory.shape[0]
        sizes = [self.arena_bytes] if self.arena_bytes else [total // 2, total // 4, total // 8]
        for size in sizes:
            try:
                return self._register_arena(size), size
            except ControlError as exc:
                if exc.status != Status.NO_SPACE:
                    raise
        node = self.cluster.nodes[self.rank]
        raise MemoryError(
            f"rank {self.rank}: node {node.address}:{node.port} has no free {sizes[-1]} bytes for this process "
            "group (pool regions or other clients' registrations hold its memory): free them, pass a smaller "
            "arena_bytes, or start nodes with more --memory"
        )

    def _register_arena(self, size: int) -> int:
        """The base of a *size*-byte arena under this rank's arena key. A stale arena of this
        rank (a process that died without closing) is given back first (the node zeroes it)."""
        rights = Rights.READ | Rights.WRITE
        try:
            return self.client.register_anywhere(self.node, size, rights, rkey=self.arena_rkey)[1]
        except ControlError as exc:
            if exc.status != Status.EXISTS:
                raise
        self.client.deregister(self.node, self.arena_rkey)
        return self.client.register_anywhere(self.node, size, rights, rkey=self.arena_rkey)[1]

    @property
    def arena_end(self) -> int:
        return self.arena_base + self.arena_size

    @property
    def staging_base(self) -> int:
        """Where collectives stage buffers that do not live in node memory: the arena's upper half."""
        return self.arena_base + self.arena_size // 2 // _ALIGN * _ALIGN

    def watchdog_s(self, count: int, dtype: DType) -> float:
        """How long a collective may go without progress: --timeout, else DEFAULT_WATCHDOG_S.
        The node's timer restarts on every chunk acknowledged or DONE received (a stall timer,
        not a deadline), so it need not grow with the size of the buffer."""
        del count, dtype  # the same for every size: see above
        return self.timeout_s if self.timeout_s is not None else DEFAULT_WATCHDOG_S

    def dead_nodes(self) -> list[str]:
        """Nodes that do not answer PING now (to name them when a collective fails), each with
        what this host can see of its process (_process_state)."""
        silent = self._silent(range(len(self.cluster.nodes)))
        return [
            f"rank {node.rank} ({node.address}:{node.port})" + _process_state(node)
            for node in self.cluster.nodes
            if node.rank in silent
        ]

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def node(self) -> Endpoint:
        """Where control requests go: the node's management port."""
        return self.cluster.nodes[self.global_rank].control_endpoint

    def _settled_epoch(self) -> int:
        """The highest epoch of this group's ``coll_id`` any member's node settled
        (COUNTERS_EPOCH, SPEC.md 6.5, "Epochs"), asked when the group is made: its first call
        goes on from there. Each rank's own node's STALE_EPOCH alone told the ranks different
        epochs where an earlier job's failed call had started on some members' nodes and not on
        others' (a node process stopped past the watchdog): the ranks then never met in one
        epoch again, and every later job on the cluster failed. Members that do not answer in
        time count for nothing. Asked once per ``coll_id`` while this process makes its ranks'
        groups (a driver playing 256 ranks makes 16 of each row's), again once it has started
        that group's collectives. A group past max_chain ranks runs none of its own (its
        torus's sub-groups do) and asks nothing."""
        if not 1 < len(self.members) <= self.max_chain:
            return 0
        key = (self._secret, self.coll_id)
        known = _SETTLED.get(key)
        if known is not None:
            return known
        nodes = [self.cluster.nodes[m].control_endpoint for m in self.members]
        try:
            with ControlClient.for_cluster(self.cluster) as client:
                epochs = client.settled_epochs(nodes, self.coll_id, SETTLED_WAIT_S)
        except OSError:
            return 0
        settled = max(epochs.values(), default=0)
        _SETTLED[key] = settled
        return settled

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup | NonGroupMember:
        """torch.distributed.new_group: a group of the cluster ranks *ranks* (group rank k is
        the k-th smallest). Every rank of the cluster calls it with the same ranks, in the same
        order as its other collectives; a rank outside gets NON_GROUP_MEMBER. The group shares
        this rank's arena and node; the k-th group made takes lane 1 + (k-1) % 3 (LANES), and
        its collectives run in the node beside other lanes' and take their turn, in issue
        order, with those of groups in its lane. Its collectives have their own coll_id and so
        their own keys; its all-gathers go by unicast."""
        members = sorted({int(r) for r in ranks})
        if len(members) != len(list(ranks)) or not members:
            raise ValueError(
                f"new_group: ranks must be distinct and at least one, got {list(ranks)}"
            )
        if members[0] < 0 or members[-1] >= len(self.cluster.nodes):
            raise ValueError(
                f"new_group: ranks must be 0..{len(self.cluster.nodes) - 1} (the cluster's), got {members}"
            )
        root = self._root or self
        root._made_groups += 1  # on every rank, members or not: the same numbers, lanes and regions
        number = root._made_groups
        torus = root._make_torus(members)
        if self.global_rank not in members:
            return NON_GROUP_MEMBER
        group = copy.copy(self)  # shares the arena, socket, lock and lanes (the CallQueue)
        group.members = tuple(members)
        group.rank = members.index(self.global_rank)
        group.coll_id = group_coll_id(self._secret, members, number)
        group.lane = 1 + (number - 1) % (LANES - 1)
        group.epoch = group._settled_epoch()
        group._epoch_settled = False
        group.multicast = False
        group._closed = False
        group._pending_room = None
        group._torus = torus
        group._torus_failed = None
        return group

    def empty(
        self, shape: int | tuple[int, ...], dtype: type | np.dtype = np.float32
    ) -> np.ndarray:
        """An array in this rank's NIC memory: collectives on it need no staging copy."""
        if self._root is not None and self._root is not self:
            return self._root.empty(shape, dtype)  # one allocator per arena
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        start = self.arena_base + (self._next_free + _ALIGN - 1) // _ALIGN * _ALIGN
        end = start + count * dt.itemsize
        if end > self.staging_base:
            raise MemoryError(
                f"arena exhausted: {end - self.arena_base} > {self.staging_base - self.arena_base} "
                "bytes for netdam.empty arrays (the arena's upper half is kept for staging); "
                "start nodes with more --memory"
            )
        self._next_free = end - self.arena_base
        return self.memory[start:end].view(dt).reshape(shape)

    def address_of(self, array: np.ndarray) -> int:
        """The node address of *array*, one ``empty`` handed out (ValueError for another)."""
        offset = self._offset_of(array)
        if offset is None:
            raise ValueError("the array is not in this rank's node memory: make it with empty()")
        return offset

    def _offset_of(self, array: np.ndarray) -> int | None:
        """Offset in node memory when *array* lives there, else None. (The array interface:
        ``ndarray.ctypes`` builds a ctypes object per read, ~3 us each.)"""
        if array.base is None and array.flags.owndata:
            return None  # numpy allocated it: not in the mapping (and the next line costs ~2 us)
        base = self._memory_base
        addr = array.__array_interface__["data"][0]
        if base <= addr < base + self.memory.shape[0] and array.flags.c_contiguous:
            return int(addr - base)
        return None

    def _stage(self, array: np.ndarray, nbytes_needed: int) -> tuple[int, bool]:
        """Copy *array* into the staging half of node memory (the copy is part of the call);
        its address there, and whether it was copied (False: it lives in node memory)."""
        offset = self._offset_of(array)
        if offset is not None:
            return offset, False
        self._settle_writers_of(array)
        start = self._staging_room(nbytes_needed)
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._memory_view[start : start + flat.shape[0]] = flat
        return start, True

    def _settle_writers_of(self, array: np.ndarray) -> None:
        """Complete the calls in flight whose results land in *array* before a new call reads
        it: calls on one buffer see each other's results in issue order, as on one CUDA stream
        (a staged call reads its input when it is issued, not when its node starts it)."""
        for work in list(self._holding):
            if (
                work.output is not None
                and not work.finished
                and np.may_share_memory(work.output, array)
            ):
                work._settle(None)

    def _staging_region(self) -> tuple[int, int]:
        """The part of the arena's upper half this group's lane stages in. A chain reads the
        same address on every member's node, so a call must stage at the same address on every
        rank: the default group's rooms follow from its own calls alone (every rank makes the
        same ones), and once new_group was called, the last quarter is cut in one part per
        lane of the groups it made (each group's lane follows from its number, the same on
        every rank)."""
        root = self._root or self
        num, den = GROUPS_STAGING_SHARE
        split = (
            root.staging_base + (root.arena_end - root.staging_base) * num // den // _ALIGN * _ALIGN
        )
        if root is not self:
            part = (root.arena_end - split) // (LANES - 1) // _ALIGN * _ALIGN
            lo = split + (self.lane - 1) * part
            return lo, lo + part
        return root.staging_base, split if root._made_groups else root.arena_end

    def _staging_room(self, nbytes: int) -> int:
        """Where the next collective stages *nbytes*: in this group's staging region (above),
        clear of the room of every collective of the region still in flight (its input, then
        its result, live there until its results are copied out); the groups new_group made
        take their lane's region start, one call of the lane at a time. When no room is clear, the oldest holder
        is completed first (its results copied out): a wait, in issue order, never an overlap."""
        lo, hi = self._staging_region()
        size = -(-nbytes // _ALIGN) * _ALIGN
        if lo + size > hi:
            raise MemoryError(
                f"{nbytes} bytes do not fit this group's staging area of the rank's arena "
                f"({hi - lo} bytes): start nodes with more --memory"
            )
        while True:
            self._holding[:] = [w for w in self._holding if not w.finished]
            held = [w for w in self._holding if w.group._staging_region() == (lo, hi)]
            start = lo
            if held and self._root is self:
                start = held[-1].room[1] if held[-1].room else lo
                if start + size > hi:
                    start = lo
            if all(w.room and (w.room[1] <= start or w.room[0] >= start + size) for w in held):
                self._pending_room = (start, start + size)
                return int(start)
            held[0]._settle(None)

    def start(
        self,
        algo: Algo,
        array: np.ndarray,
        op: WireOp,
        in_addr: int,
        out_addr: int,
        count: int,
        root: int = 0,
        flags: int = 0,
        settle: bool = True,
        update: tuple[int, int] = (0, 0),
        held: bool = False,
        await_started: bool = False,
    ) -> Work:
        """Send START_COLL for the next epoch to this rank's node; returns the Work to wait on.
        *flags* is the descriptor's flags byte (bit 0: sparse mode, bit 1: fused reduce and
        update, SPEC.md 4.1, with *update* its header's addr and aux_addr: this node's optimizer
        descriptor and the step). *settle*:
        wait for the node's first answer to a new group's first call (below); a torus step
        does not (TorusWork: its group's calls go one at a time, and a call moved past the
        node's epoch moves the group's next call with it). *held*: queued in its lane now, sent
        only after ``self._calls.release`` (a torus step). *await_started*: its chains wait for
        every member's STARTED whatever its size (a torus's steps; else _awaits_started)."""
        if self.world_size > self.max_chain:
            raise ValueError(
                f"{algo.name.lower()} over {self.world_size} ranks: one collective's chain names "
                f"at most {self.max_chain} (its SR list, SPEC.md 4.2); all_reduce and barrier run "
                "over more as a torus of chains, the others need groups of at most "
                f"{self.max_chain} (new_group)"
            )
        if not self._epoch_settled:
            # This process starts the group's collectives now: a group made after this asks
            # the nodes again (_settled_epoch).
            _SETTLED.pop((self._secret, self.coll_id), None)
        self.epoch += 1
        dtype = wire_dtype(array)
        watchdog = self.watchdog_s(count, dtype)
        if (
            algo in (Algo.ALL_REDUCE, Algo.REDUCE_SCATTER)
            and not flags & FLAG_SPARSE  # its round of bitmaps proves every member started
            and (await_started or _awaits_started(self.world_size, count, dtype, self.cluster.mtu))
        ):
            flags |= FLAG_AWAIT_STARTED
        shape = _StartShape(
            algo,
            self.rank,
            count,
            in_addr,
            out_addr,
            root,
            int(watchdog * 1000),
            flags,
            self.group if self.multicast else None,
            self.client.client_id,
            self.cluster.admin_key,
            self.coll_id,
            dtype,
            op,
            self._segments(),
            update,
        )
        key = collective_key(self._secret, self.coll_id, self.epoch)
        tag_key = collective_tag_key(self._secret, self.coll_id, self.epoch)
        txn = txn_for(self.coll_id, self.epoch, self.rank)
        if self._start_template is None or self._start_template[0] != shape:
            template = shape.template(self.epoch, key, tag_key)
            sealing = self.client.sealing(template.prototype)
            self._start_template = shape, StartStamper(template, sealing)
        packet, wire = self._start_template[1].stamp(self.epoch, txn, key, tag_key)
        work = Work(self, packet, algo, count, dtype, watchdog)
        work.wire = wire
        work.held = held
        with self._lock:
            work.room, self._pending_room = self._pending_room, None
            work.output = array if work.room is not None else None
            if work.room is not None:
                self._holding.append(work)
            self._send(self._calls.issue(work, self.lane, time.monotonic()))
            self._drive_in_background()  # re-sends it if lost, sends the next of its lane
            if not work.sent:
                return work  # sent when the calls before it in its lane have ended
            if settle and not self._epoch_settled:
                # A new group counts from epoch 1; the node may answer STALE_EPOCH with the
                # epoch it is at. The progress thread reads that answer and sends the call again
                # past it (CallQueue.receive), not wait(): one process may start every rank's
                # call (async) before waiting on any, and each rank's peers need it running. It
                # was read here, and each first call waited for its node's answer: 1-4 ms a
                # rank, so a driver of 4 ranks started them ~10 ms apart, past the 5 ms its
                # peers hold early chains (netdam.kernels.collective.EARLY_HOLD_S), and the
                # demo's all-reduce was answered BUSY 130-210 times.
                default = self._root or self
                default._settling.append(work)
                _HUB.add(default, wake=True)
        return work

    def _segments(self) -> tuple[Endpoint, ...]:
        """The SR list of this group's collectives: its members' endpoints in group-rank order,
        built once per group (a torus call starts three collectives per rank, and building the
        cluster's endpoint list for each cost a fifth of a 256-rank driver's time)."""
        if self._segments_of != self.members:
            endpoints = self.cluster.endpoints
            self._segment_list = tuple(endpoints[r] for r in self.members)
            self._segments_of = self.members
        return self._segment_list

    def shrink(self) -> ProcessGroup:
        """The group of this group's ranks whose nodes answer PING now, made with new_group
        (MPI_Comm_shrink, NCCL's communicator shrink): after a collective failed on a dead
        node, every survivor calls it, and the next collective on the result runs without the
        dead. Raises CollectiveError when this rank's own node is among them."""
        dead = self._silent(self.members)
        if self.global_rank in dead:
            node = self.cluster.nodes[self.global_rank]
            raise CollectiveError(
                f"rank {self.global_rank}: its own node {node.address}:{node.port} does not answer: "
                "this rank cannot go on",
                {"node": f"{node.address}:{node.port}", "rank": self.global_rank},
            )
        made = self.new_group([r for r in self.members if r not in dead])
        assert isinstance(made, ProcessGroup)  # this rank is alive, so a member
        return made

    def _silent(self, ranks: Sequence[int]) -> set[int]:
        """The cluster ranks of *ranks* whose nodes do not answer PING now (all asked at once,
        two rounds of 0.25 s: a dead node costs 0.5 s, not 0.5 s per node)."""
        nodes = {r: self.cluster.nodes[r].control_endpoint for r in ranks}
        # On a socket of its own: the rank's carries the answers to its calls in flight, and
        # waiting for PINGs there read them and dropped them (a completion then came only
        # when its START_COLL was sent again).
        with contextlib.closing(ControlClient.for_cluster(self.cluster)) as pinger:
            heard = pinger.answering(list(nodes.values()))
        return {r for r, endpoint in nodes.items() if endpoint not in heard}

    def _drive_in_background(self) -> None:
        """Have the process's progress thread drive this rank (call with _lock held)."""
        _HUB.add(self._root or self)

    def _progress_state(self, now: float) -> tuple[bool, bool, float]:
        """(keep, queued, due) of this default group for the progress thread: keep it while it
        has calls (and PROGRESS_LINGER_S after the last ended, so a loop of calls does not
        come and go); watch its socket while calls wait behind others or a torus all-reduce
        runs (its next collective starts the moment the last ended here: its peers' chains wait
        for it); otherwise wake only when a re-send is due, since a head the node has not
        answered yet is left to wait(): most are answered in a millisecond, and reading the
        socket beside wait() only trades the GIL back and forth."""
        with self._lock:  # start() adds under it too: a call started now is never left out
            busy = bool(self._calls.heads() or self._pipelines)
            if self._closed or (not busy and now - self._emptied > PROGRESS_LINGER_S):
                _HUB.discard(self, wake=False)
                return False, False, now
            if busy:
                self._emptied = now
            for work in self._settling:
                if work.started:
                    work.group._epoch_settled = True
            self._settling = [w for w in self._settling if not (w.started or w.ended)]
            queued = self._calls.queued() or bool(self._pipelines) or bool(self._settling)
            return True, queued, self._calls.next_resend() or now + 0.05

    def _send(self, datagrams: list[bytes]) -> None:
        """Send the START_COLLs the call queue gave out to this rank's node, at its data port:
        there the datapath starts a repeated collective's next epoch itself (SPEC.md 4.1,
        "Restart in the datapath"), where the management port would pass it through Python."""
        node = self.cluster.nodes[self.global_rank].endpoint
        for data in datagrams:
            self.client.sock.sendto(data, node)

    def _step(self, timeout: float | None, wait_s: float, poll: bool = False) -> None:
        """One turn of driving this rank's collectives: take the node's answers for up to
        *wait_s* (each to its Work; with *poll*, polling the socket for HOST_SPIN_S first), then
        let the call queue re-send the START_COLLs due and fail a head whose node stayed silent
        past its watchdog (or *timeout*). The wait for an answer holds no lock: a wait() and
        the progress thread both wake, one takes them (and wakes the other, _take_answers)."""
        # Called even with wait_s 0: the call lets go of the GIL, which the caller's thread
        # needs between the progress thread's turns. Without it (128 NICs x 1 MiB, 10 runs
        # each) 2 runs in 10 re-sent 20-40 column chains in their first call, and a call
        # took 0.26-0.34 s; with it, none and 0.27-0.29 s.
        with contextlib.suppress(OSError, ValueError):  # a closed socket: nothing more to take
            if poll and wait_s > 0:
                # The answer usually comes within HOST_SPIN_S.
                until = time.monotonic() + HOST_SPIN_S
                while (
                    not select.select([self.client.sock], [], [], 0)[0] and time.monotonic() < until
                ):
                    pass
            select.select([self.client.sock], [], [], wait_s)
        with self._lock:
            root = self._root or self
            if root._closed or (not self._calls.heads() and not root._pipelines):
                return  # closed: its socket is close()'s now (the progress thread may be late)
            self._take_answers(drain=True)
            self._advance_pipelines()
            # A head silent past its watchdog ends here as failed (silent_s); the error its
            # wait() raises is built there (Work._explain_failure), since it PINGs the nodes.
            datagrams, _ = self._calls.tick(time.monotonic(), timeout)
            self._send(datagrams)

    def _polls_before_sleeping(self) -> bool:
        """Whether a wait() polls the socket for HOST_SPIN_S before it sleeps: only in a process
        that plays every rank of the group (a driver), of no more ranks than the machine has
        cores. Where each rank has a process of its own, N polling processes take the cores
        their NICs need: 2 ranks of `examples/ddp_train.py` went from 318-392 to 243-280 steps
        a second with every rank polling."""
        key = (self.cluster.name, self.job or "", self.members)
        known = _POLLS.get(key)
        if known is None:
            known = _POLLS[key] = len(self.members) <= _CORES and all(
                arena_lock_path(self.cluster.nodes[m], self.job or "") in _ARENA_LOCKS
                for m in self.members
            )
        return known

    def _take_answers(self, until: Work | None = None, drain: bool = False) -> None:
        """Read the node's answers waiting on the socket (no wait) and hand each to the call
        queue; return once *until* ends, unless *drain*: then every answer waiting is taken
        first, so no other lane's call is judged silent while its answers sit unread.

        Answers taken here may end a call another thread waits for (a wait(), which checked
        its call, then sleeps up to 0.2 s in select() on this socket, now empty): those threads
        are woken (_wake_waiters). Without it the p99 of 4-node calls of 16-64 KiB was 0.20 s
        where the median was 2 ms.

        One compiled read takes every answer waiting (netdam.kernels.host_calls): a
        ``recvfrom`` per answer, one more that raised on the empty socket, and read_answer in
        Python cost a driver of 4 ranks ~20 us an answer (docs/PERFORMANCE.md)."""
        sock = self.client.sock
        reader = self._answers
        taken = 0
        while True:
            n = reader.read(sock.fileno())
            for k in range(n):
                call, heard, datagrams = self._calls.receive_answer(
                    reader.answer(k), reader.datagram(k), time.monotonic()
                )
                taken += call is not None  # a wake-up, or anything else, is no answer
                self._send(datagrams)
                # A FAILED call ends here (its nack); the error its wait() raises is built there.
                if heard is Heard.BUSY:
                    self._drive_in_background()  # asks again while nobody waits
            if n < reader.capacity or (until is not None and not drain and until.ended):
                break  # the socket was empty when read (or the call waited for ended)
        if taken and (self._root or self)._waiters - {threading.get_ident()}:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Wake the threads asleep in select() on this rank's socket: an empty datagram from
        the socket to itself (the call queue takes it for nothing, like any datagram that is no
        answer of its node)."""
        sock = self.client.sock
        address, port = sock.getsockname()[:2]
        with contextlib.suppress(OSError):  # closed under us: its waiters are woken by that
            sock.sendto(b"", ("127.0.0.1" if address == "0.0.0.0" else address, port))

    def _advance_pipelines(self) -> None:
        """Start the next collective of every torus all-reduce whose last one ended on this
        rank (call with _lock held)."""
        root = self._root or self
        if not root._pipelines:
            return
        now = time.monotonic()
        for work in list(root._pipelines):
            work.advance(now)
        root._pipelines[:] = [w for w in root._pipelines if not w.ended]

    def _silence(self, bound: float, dead: list[str] | None = None) -> CollectiveError:
        """The error of a call its node left silent for *bound* seconds, naming the nodes that
        do not answer PING (*dead*, else _SilentNames's: up to 0.5 s)."""
        node = self.cluster.nodes[self.global_rank]
        dead = _SILENT_NAMES.named(self) if dead is None else dead
        return CollectiveError(
            f"rank {self.global_rank}: no word from its node {node.address}:{node.port} for "
            f"{bound:.1f} s" + (f"; not answering: {', '.join(dead)}" if dead else ""),
            {"node": dead[0] if dead else f"{node.address}:{node.port}", "rank": self.global_rank},
        )

    def descriptor_for_epoch(self, packet: Packet, epoch: int) -> Packet:
        """*packet* (a START_COLL of this group) moved to *epoch*, with that epoch's key."""
        desc = unpack_descriptor(packet.payload)
        key = collective_key(self._secret, packet.coll_id, epoch)
        tag_key = collective_tag_key(self._secret, packet.coll_id, epoch)
        return replace(
            packet, epoch=epoch, payload=replace(desc, rkey=key, tag_key=tag_key).encode()
        )

    def close(self) -> None:
        """Give the arena back (the node zeroes it), close the control socket, and let the
        next job's rank have the arena. A group new_group made only stops here: the arena,
        the socket and the node belong to the default group."""
        self._closed = True
        if self._root is not self:
            return
        _HUB.discard(self)  # the process's progress thread drives it no more
        with self._lock:
            pass  # a turn of the progress thread under way ends before the socket is used
        try:
            # Short: a live node answers in microseconds; a dead one would hold every close
            # (and every test that kills a node) for the default 3 x 1 s.
            self.client.deregister(self.node, self.arena_rkey, timeout=DEREGISTER_TIMEOUT_S)
        except (ControlError, OSError):
            pass  # the node is gone: nothing of this rank's is left to protect
        self.client.close()
        if self._arena_lock is not None:
            _release_arena_lock(self._arena_lock)
            self._arena_lock = None
        # Detach from the node's memory (shm.attach: the mapping goes with its last
        # reference), for the groups new_group made too (they share _attached), and from the
        # calls that kept buffers in it. The group and its calls refer to each other, so
        # without this only the garbage collector let a closed group's mapping go: a tool
        # running cluster after cluster in one process (the bench) held every finished
        # cluster's memory, and 4 x 256 MiB ran the machine out of memory.
        self._holding.clear()
        self._settling.clear()
        self._attached.memory = self._attached.view = _DETACHED

    @property
    def memory(self) -> np.ndarray:
        """This rank's node memory, mapped into this process (empty once the group is closed)."""
        return self._attached.memory

    @property
    def _memory_view(self) -> np.ndarray:
        """The same as a plain ndarray, whose slices skip np.memmap's per-slice bookkeeping
        (read on every call: staging in, copying out)."""
        return self._attached.view


class Work(Call):
    """A started collective (torch.distributed's Work): ``wait()`` blocks until it ends.

    Its state as the node answers (started, BUSY, completed, failed) is the call queue's
    (core/host.py's Call); this adds what the host keeps: the staging room, the caller's array
    and the actions that copy results out, and the error ``wait()`` raises. Several may be in
    flight on one rank (``async_op=True``): the group sends each START_COLL when the call of
    its lane before it has ended (one call of a lane in the node), answers are handed to the
    Work they belong to whichever Work is being waited on, and each keeps its own staging room
    until its results are copied out. Those of one lane end in issue order."""

    def __init__(
        self,
        group: ProcessGroup,
        packet: Packet,
        algo: Algo,
        count: int,
        dtype: DType,
        watchdog_s: float,
    ) -> None:
        super().__init__(group, packet, watchdog_s)
        self.group: ProcessGroup = group
        self.algo = algo
        self.count = count
        self.dtype = dtype
        #: Why it failed (raised by wait()), once it has.
        self.error: CollectiveError | None = None
        #: Its results were copied out (the finish actions ran): its staging room is free.
        self.finished = False
        #: (start, end) of its staging room in node memory, if it has one, and the caller's
        #: array its results are copied into from there.
        self.room: tuple[int, int] | None = None
        self.output: np.ndarray | None = None
        self._finish: list[Callable[[], None]] = []
        # Phases of the call, for benchmarks: the copy into node memory (0 for NIC-resident
        # buffers), the copy back out; when START_COLL left and when the completion arrived
        # are the Call's sent_at and completed_at (time.monotonic(), CLOCK_MONOTONIC: the
        # nodes' clock on one Linux host), and the node's own phases its node_phases
        # (SPEC.md 4.1).
        self.stage_in_s = 0.0
        self.copy_out_s = 0.0
        # The host API's own time (time.monotonic()): when the caller called it (all_reduce
        # records it), when a wait on it began, and when that wait returned (host_overhead).
        self.called_at: float | None = None
        self.wait_at: float | None = None
        self.finished_at: float | None = None

    def is_completed(self) -> bool:
        with self.group._lock:
            if not self.ended:
                self.group._take_answers(until=self)
                self.group._send(self.group._calls.advance(time.monotonic()))
            return self.ended

    def wait(self, timeout: float | None = None) -> None:
        """Block until the node reports the end of the collective; raise CollectiveError when it
        failed. The node answers every re-sent START_COLL (idempotent): "running" keeps the wait
        alive, silence for a whole watchdog period means the node is gone."""
        self._settle(timeout)
        if self.error is not None:
            raise self.error

    def _settle(self, timeout: float | None) -> None:
        """Drive this rank's collectives, oldest first, until this one ended; then copy its
        results out. Failures are kept in ``error``, not raised."""
        self.heard_at = time.monotonic()
        self.wait_at = self.wait_at or self.heard_at
        self._drive(timeout)
        self._explain_failure()
        if self.done and not self.finished:
            t_copy = time.perf_counter()
            for action in self._finish:
                action()
            self._finish.clear()
            self.copy_out_s = time.perf_counter() - t_copy
        if not self.finished:
            self.finished_at = time.monotonic()
        self.finished = True

    def _explain_failure(self) -> None:
        """Build the error of a call that ended failed, in the waiting thread and outside the
        group's lock: it asks the nodes who answers (up to 0.5 s with one silent). Built where
        the end was read, under the lock, it held every other rank of the process meanwhile,
        the progress thread's turns included. The outcome is read under the lock, whichever
        thread set it: a wait that read the end before its error existed once returned as if
        the call had completed, its buffer untouched (8 ranks of one process, one node
        stopped: 2 runs in 3)."""
        with self.group._lock:
            if not self.failed or self.error is not None:
                return
        error = self._error_of_failure()
        with self.group._lock:
            if self.error is None:
                self.error = error

    def _error_of_failure(self, dead: list[str] | None = None) -> CollectiveError:
        """The error of this call, which ended failed (its nack, or its node silent), naming
        the nodes that do not answer PING (*dead*, else _SilentNames's: up to 0.5 s)."""
        if self.nack is not None:
            return self._failure(self.nack, dead)
        if self.silent_s is not None:
            return self.group._silence(self.silent_s, dead)
        return CollectiveError(f"{self.algo.name.lower()} failed")

    def host_overhead(self) -> tuple[float, float] | None:
        """Seconds this host spent in the API around the collective, beside the copies: from
        the call to its START_COLL leaving (staging copy excluded), and from the completion
        arriving (or the wait beginning, if later) to the wait returning (copy-out excluded).
        None unless all_reduce recorded the call and a wait returned."""
        if self.called_at is None or self.finished_at is None or self.completed_at is None:
            return None
        issue = self.sent_at - self.called_at - self.stage_in_s
        ready = max(self.completed_at, self.wait_at or self.completed_at)
        return max(issue, 0.0), max(self.finished_at - ready - self.copy_out_s, 0.0)

    def _drive(self, timeout: float | None) -> None:
        """Read this rank's answers until this call ended (another thread that takes them
        wakes this one: ProcessGroup._step)."""
        waiters = (self.group._root or self.group)._waiters
        me = threading.get_ident()
        waiters.add(me)
        try:
            poll = (
                self.count * ELEMENT_SIZE[self.dtype] <= HOST_POLL_MAX_BYTES
                and self.group._polls_before_sleeping()
            )
            while not self.ended:
                self.group._step(timeout, 0.2, poll)
        finally:
            waiters.discard(me)

    def _failure(self, reply: Packet, dead: list[str] | None = None) -> CollectiveError:
        """The error of a call its node NACKed with *reply*, naming the nodes that do not
        answer PING (*dead*, else _SilentNames's: up to 0.5 s)."""
        waiting = None
        if reply.aux_addr == 1 and len(reply.payload) >= 16:
            first, last = unpack_completion(reply.payload)
            waiting = self._waiting_for(first, last)
        dead = _SILENT_NAMES.named(self.group) if dead is None else dead
        if dead and waiting is not None:
            waiting["node"] = dead[0]
        where = f"; waiting for {waiting}" if waiting else ""
        where += f"; not answering: {', '.join(dead)}" if dead else ""
        if reply.status == Status.OUT_OF_BOUNDS:
            # Every rank stages at the same address, which its node checks against its own
            # arena: an arena placed elsewhere on some node (jobs whose ranks registered in
            # different orders on different nodes) puts the others' chunks out of bounds there.
            where += (
                "; the ranks' arenas may lie at different addresses on their nodes (jobs that "
                "started at the same moment): start one job's ranks after the other's"
            )
        return CollectiveError(
            f"{self.algo.name.lower()} epoch {self.packet.epoch} failed on rank "
            f"{self.group.rank}: {reply.status.name}{where}",
            waiting,
            int(reply.status),
        )

    def _waiting_for(self, first: int, last: int) -> dict[str, object]:
        group = self.group
        world = group.world_size
        per_packet = max_elements(group.cluster.mtu, self.dtype, segments=max(world - 1, 0))
        cb = chunk_bounds(self.algo, self.count, world, 0, per_packet)
        if first >= int(cb[-1]):
            # The second word then names the members whose DONE had not come (SPEC.md 4.1).
            silent = [group.cluster.nodes[group.members[r]] for r in range(world) if last >> r & 1]
            names = [f"rank {n.rank} ({n.address}:{n.port})" for n in silent]
            return {
                "node": f"{silent[0].address}:{silent[0].port}" if silent else None,
                "rank": silent[0].rank if silent else None,
                "block": None,
                "seq_range": None,
                "detail": "every chunk is here: waiting for the DONE of "
                + (", ".join(names) if names else "other members"),
            }
        block = int(np.searchsorted(cb, first, side="right") - 1)
        node = group.cluster.nodes[group.members[block]]
        return {
            "node": f"{node.address}:{node.port}",
            "rank": group.members[block],
            "block": block,
            "seq_range": [first, last],
        }


class TorusWork(Work):
    """An all-reduce over more ranks than one chain names (SPEC.md 4.2): the collectives of
    this rank's row and column (core/torus.py), on the buffer staged once, each started by
    whichever thread drives the rank (a wait() or the progress thread) the moment the one
    before it ended here. It ends when the last one ends, and fails with the first that fails."""

    def __init__(
        self, group: ProcessGroup, buf: np.ndarray, op: WireOp, addr: int, steps: list[TorusStep]
    ) -> None:
        dtype = wire_dtype(buf)
        super().__init__(
            group,
            # Never sent: its steps' Works carry the START_COLLs (the call queue never holds it).
            Packet(Opcode.START_COLL),
            Algo.ALL_REDUCE,
            buf.size,
            dtype,
            group.watchdog_s(buf.size, dtype),
        )
        self._buf, self._op, self._addr = buf, op, addr
        self._steps = steps
        #: Each step's collective, queued in its sub-group's lane in begin() (held: each goes
        #: when the one before it ended here); parts[_at] is the one running.
        self.parts: list[Work] = []
        self._at = 0
        #: The step that failed, its error not yet naming the silent nodes (_explain_failure).
        self._failed_part: Work | None = None
        #: Set when it ended: the progress thread, which reads the rank's answers while a torus
        #: all-reduce runs, may be the one that ends it, while a wait() sleeps.
        self._ended = threading.Event()

    @property
    def ended(self) -> bool:
        return self.done or self.error is not None

    def begin(self) -> None:
        """Take the staging room the buffer was just staged in, queue every step, and start
        the first."""
        group = self.group
        with group._lock:
            self.room, group._pending_room = group._pending_room, None
            self.output = self._buf if self.room is not None else None
            if self.room is not None:
                group._holding.append(self)
            if group._torus_failed is None:
                # Every step takes its epoch and its place in its sub-group's lane now, in the
                # order the caller issues all-reduces (the same on every rank), not when the
                # step before it ends here: a lane's calls then reach every member's node in
                # one order, and no two ranks wait on each other (core/host.py, CallQueue).
                esize = ELEMENT_SIZE[self.dtype]
                for step in self._steps:
                    self.parts.append(
                        group._torus[step.group].start(
                            step.algo,
                            self._buf,
                            self._op,
                            self._addr + step.in_offset * esize,
                            self._addr + step.out_offset * esize,
                            step.count,
                            settle=False,  # the driving thread may be any rank's (one process)
                            held=True,
                            # A step starts on each rank when the one before ended there: a
                            # column's members start as their rows end, ~100 ms apart at 128
                            # NICs driven by one process.
                            await_started=True,
                        )
                    )
            root = group._root or group
            root._pipelines.append(self)
            self.advance(time.monotonic())
            _HUB.add(root, wake=True)  # its socket is watched from now on

    def advance(self, now: float) -> None:
        """Release the next step if the one running ended (call with the group's _lock held)."""
        group = self.group
        while not self.ended:
            if group._torus_failed is not None and not (self.parts and self.parts[self._at].sent):
                self._fail(
                    CollectiveError(
                        f"an earlier all_reduce over these {group.world_size} ranks failed "
                        f"({group._torus_failed}): the group's torus is out of step; make a new "
                        "group (shrink(), new_group) and go on there",
                        group._torus_failed.waiting_for,
                    )
                )
                return
            part = self.parts[self._at]
            if part.held:
                group._send(group._calls.release(part, now))
            if not self.sent and self.parts[0].sent:
                self.sent, self.sent_at = True, self.parts[0].sent_at
            if not part.sent:
                return  # it goes when the calls before it in its lane have ended
            if not part.ended:
                return
            if not part.done:
                # Not asking the nodes who answers here (this may be the progress thread's
                # turn): wait() names them (_explain_failure).
                cause = part.error or part._error_of_failure(dead=[])
                self._failed_part = part
                group._torus_failed = self._torus_error(part, cause)
                self._fail(group._torus_failed)
                return
            self._at += 1
            if self._at == len(self.parts):
                self.done, self.completed_at = True, now
                self._ended.set()
                return

    def _torus_error(self, part: Work, cause: CollectiveError) -> CollectiveError:
        group = self.group
        return CollectiveError(
            f"all_reduce over {group.world_size} ranks (a torus of chains, SPEC.md 4.2), "
            f"its {part.algo.name.lower()} over group ranks {list(part.group.members)}: {cause}",
            cause.waiting_for,
        )

    def _explain_failure(self) -> None:
        """The step that failed, explained again naming the nodes that do not answer PING,
        asked here in the waiting thread (advance, which ended the call, did not ask them)."""
        with self.group._lock:
            part, self._failed_part = self._failed_part, None
        if part is None or part.error is not None:
            return
        error = self._torus_error(part, part._error_of_failure())
        with self.group._lock:
            self.error = error

    def _fail(self, error: CollectiveError) -> None:
        """End with *error*; the steps not sent leave their lanes unsent (the calls behind them
        go on)."""
        self.error = error
        for part in self.parts[self._at :]:
            if not part.sent:
                self.group._calls.cancel(part)
                part.error = error
        self.group._send(self.group._calls.advance(time.monotonic()))
        self._ended.set()

    def is_completed(self) -> bool:
        if not self.ended:
            self.group._step(None, 0.0)
        return self.ended

    def _drive(self, timeout: float | None) -> None:
        """Wait for the end, which the progress thread brings (it reads the answers while a
        torus all-reduce runs: reading them here too, a wait would sleep in select() on answers
        that thread took). A turn every 50 ms fails a silent node on *timeout*."""
        while not self.ended:
            self.group._step(timeout, 0.0)
            self._ended.wait(0.05)


class _ProgressHub:
    """The process's progress thread: it drives every default group of the process (each
    rank a process plays) that has calls, from one epoll set over their sockets, where a thread
    per rank woke 256 threads at once in a 256-rank driver (0.38 s of its CPU per call, most
    of it threads taking the GIL in turn). It ends PROGRESS_LINGER_S after its last group
    emptied, and the next call starts it again. Groups are keyed by identity (a dataclass
    compares by value)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[int, ProcessGroup] = {}
        #: Groups whose state changed outside the thread's turns (a call started): read again.
        self._dirty: set[int] = set()
        #: Bumped when a group comes or goes: the thread copies _roots again only then.
        self._version = 0
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    def add(self, root: ProcessGroup, wake: bool = False) -> None:
        """Drive *root* from now on. The thread looks at it again within 50 ms; *wake*: now
        (a torus all-reduce begun: its next step must start the moment the last ends). A start
        does not wake it: each wake-up takes the GIL from the caller (4 ranks of 4 KiB calls in
        one process: 2.5 ms a call with a wake per start, 1.6 ms without)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: nothing of the parent's runs here
                self._roots, self._thread, self._pid = {}, None, os.getpid()
                self._version += 1
                self._wake_r, self._wake_w = socket.socketpair()
                self._wake_r.setblocking(False)
                self._wake_w.setblocking(False)
            if id(root) not in self._roots:
                root._emptied = time.monotonic()
                self._roots[id(root)] = root
                self._version += 1
            self._dirty.add(id(root))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="netdam-progress"
                )
                self._thread.start()
        if wake:
            self.wake()

    def discard(self, root: ProcessGroup, wake: bool = True) -> None:
        with self._lock:
            if self._roots.pop(id(root), None) is not None:
                self._version += 1
        if wake:
            self.wake()

    def wake(self) -> None:
        """End the thread's wait now (a group added or closed, a torus all-reduce begun)."""
        with contextlib.suppress(BlockingIOError, OSError, AttributeError):
            self._wake_w.send(b"!")  # type: ignore[union-attr]  # None before the first add

    def _run(self) -> None:
        wake_r = self._wake_r
        assert wake_r is not None
        poller = select.epoll()  # epoll: the set is kept, not rebuilt per turn (below)
        try:
            self._serve(poller, wake_r)
        finally:
            poller.close()

    def _serve(self, poller: select.epoll, wake_r: socket.socket) -> None:
        """Each group's state is read again only after a turn of its own or a change from
        outside (a call started), and its socket enters or leaves the epoll set only then: an
        answer for one of 256 groups costs that group's turn. A 256-rank driver took ~400
        turns a call, and rebuilding a poll() set of ~200 sockets each time was a third of
        its CPU."""
        poller.register(wake_r.fileno(), select.EPOLLIN)
        roots: dict[int, ProcessGroup] = {}
        seen = -1  # the _roots version `roots` copies
        watching: dict[int, int] = {}  # id(group) -> its descriptor in the epoll set
        owner: dict[int, int] = {}  # descriptor -> id(group)
        due: dict[int, float] = {}  # id(group) -> when its next turn is due at the latest
        timers: list[tuple[float, int]] = []  # heap of (due, id(group)); outdated ones skipped

        def watch(key: int) -> None:
            if key in watching:
                return
            try:
                fd = roots[key].client.sock.fileno()
                previous = owner.get(fd)
                if previous is not None:  # its socket closed and this one took the number
                    watching.pop(previous, None)
                try:
                    poller.register(fd, select.EPOLLIN)
                except FileExistsError:
                    poller.modify(fd, select.EPOLLIN)
            except (OSError, ValueError):  # closed: its turn says so
                return
            owner[fd] = key
            watching[key] = fd

        def unwatch(key: int) -> None:
            fd = watching.pop(key, None)
            if fd is not None and owner.get(fd) == key:
                del owner[fd]
                with contextlib.suppress(OSError, ValueError):  # closed: epoll dropped it
                    poller.unregister(fd)

        stale: set[int] = set()
        while True:
            now = time.monotonic()
            with self._lock:
                if self._version != seen:
                    seen = self._version
                    roots = dict(self._roots)
                    stale |= roots.keys() - due.keys()
                    for key in (due.keys() | watching.keys()) - roots.keys():
                        due.pop(key, None)
                        unwatch(key)
                stale |= self._dirty
                self._dirty = set()
            for key in stale & roots.keys():
                keep, queued, at = roots[key]._progress_state(now)
                if keep:
                    due[key] = at
                    heapq.heappush(timers, (at, key))
                    (watch if queued else unwatch)(key)
                else:
                    due.pop(key, None)
                    unwatch(key)
            with self._lock:
                if not self._roots:
                    self._thread = None
                    return
            while timers and due.get(timers[0][1]) != timers[0][0]:
                heapq.heappop(timers)
            first = timers[0][0] if timers else now + 0.05
            wait = max(min(first, now + 0.05) - now, 0.0)
            ready = [fd for fd, _ in poller.poll(wait)]
            if wake_r.fileno() in ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    while wake_r.recv(4096):
                        pass
            now = time.monotonic()
            turn = {owner[fd] for fd in ready if fd in owner}
            while timers and timers[0][0] <= now:
                at, key = heapq.heappop(timers)
                if due.get(key) == at:
                    turn.add(key)
            for key in turn:
                try:
                    roots[key]._step(None, 0.0)
                except (OSError, ValueError):
                    self.discard(roots[key])  # its socket closed under it (the group was closed)
            stale = turn


_HUB = _ProgressHub()
#: The settled epoch of each (secret, coll_id) this process asked the nodes for, until it
#: starts that group's collectives (ProcessGroup._settled_epoch).
_SETTLED: dict[tuple[bytes, int], int] = {}
#: How long a new group waits for each member's node to say its settled epoch (seconds; asked
#: twice): a stopped node costs a group made then at most twice this.
SETTLED_WAIT_S = 0.25
#: How long a wait() polls its rank's socket before it sleeps in select(), where one process
#: drives every rank of a group no wider than the machine's cores (_polls_before_sleeping): a
#: process asleep pays a wake-up on another core (~35-40 us here) when the completion comes.
#: Measured on 2 cores, `netdam allreduce --nodes N --size 4KiB --repeat 300`, A B alternated:
#: 2 nodes 0.51-0.66 -> 0.39-0.41 ms a call (4 runs each; the completion phase 81-135 -> 42-46
#: us); 4 nodes polling took 1.93 ms against 0.88-0.92 (the polling driver took the core the 4
#: NICs' processes need), hence the bound on the group's size (docs/PERFORMANCE.md).
HOST_SPIN_S = 150e-6
#: Only a wait for a call of at most this many bytes per rank polls: a larger one's answer
#: seldom comes within the poll, which then takes CPU its NICs need. 2 nodes, A B as above:
#: 16 KiB 0.53-0.66 -> 0.42-0.47 ms (one run 0.77), 64 KiB 0.70-0.82 -> 0.47-0.65 ms, 128 KiB
#: 0.57-0.78 against 0.58-0.66 (no gain), 256 KiB 0.98-1.11 -> 1.26-1.41 ms (the driver's
#: threads, one a rank, both polling), 1 MiB ~6% slower.
HOST_POLL_MAX_BYTES = 64 << 10


def _process_state(node: NodeEntry) -> str:
    """What /proc says of a silent node's process, when the cluster file names it and it runs
    on this host: exited, stopped, or running but not answering (busy or stuck). The three call
    for different fixes, and a failure that said only "not answering" left them apart."""
    # Imported here: the launcher's helpers, which the host API needs only on a failure.
    from netdam.cluster.launch import is_local_address, is_node_process, process_state

    if not node.pid or not is_local_address(node.address):
        return ""
    if not is_node_process(node.pid):  # gone, a zombie, or its pid taken by another program
        return f" [its process {node.pid} has exited]"
    seen = process_state(node.pid)
    if seen is None:
        return ""
    if seen[0] in ("T", "t"):
        return f" [its process {node.pid} is stopped]"
    return f" [its process {node.pid} runs but does not answer]"


class _SilentNames:
    """The last dead_nodes() answer of each cluster that named a silent node, which the errors
    of every rank of the process share for NAMING_REUSE_S (one round at a time: a thread that
    comes while one runs takes its answer). An answer naming none is not kept: that round took
    a millisecond, and a node that dies next must be named. ``dead_nodes()`` itself always asks
    now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[object, ...], tuple[float, list[str]]] = {}

    def named(self, group: ProcessGroup) -> list[str]:
        cluster = group.cluster  # its name and key too: a new cluster may reuse the ports
        key = (cluster.name, cluster.admin_key, *(n.control_endpoint for n in cluster.nodes))
        with self._lock:
            at, names = self._last.get(key, (-math.inf, []))
            if time.monotonic() - at > NAMING_REUSE_S:
                names = group.dead_nodes()
                if names:
                    self._last[key] = (time.monotonic(), names)
            return list(names)


_SILENT_NAMES = _SilentNames()


class NonGroupMember:
    """What new_group gives a rank outside the group (torch's GroupMember.NON_GROUP_MEMBER):
    collectives on it raise, get_rank is -1."""

    def __repr__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = NonGroupMember()


def group_coll_id(secret: bytes, members: Sequence[int], number: int) -> int:
    """The coll_id of group *number* (0: the default group; n: the n-th new_group) of cluster
    ranks *members*, in the job whose secret is *secret*: 32 bits derived from all three,
    never 0. Two groups of the same ranks, or two jobs' groups, meet on a node as two."""
    return derived_key(secret, "group", number, ",".join(str(r) for r in sorted(members)))


def _endpoint_u64(endpoint: Endpoint) -> int:

    return int(endpoint_to_u64(endpoint))


# ---------------------------------------------------------------- the module-level default group

_default: ProcessGroup | None = None


def init(
    cluster: str | Path, rank: int, *, multicast: bool = True, timeout: float | None = None
) -> ProcessGroup:
    """Join the cluster described by the cluster file as *rank* (torch's init_process_group)."""
    global _default
    _default = ProcessGroup(load_cluster(cluster), rank, multicast=multicast, timeout_s=timeout)
    return _default


def _group(group: ProcessGroup | NonGroupMember | None) -> ProcessGroup:
    if isinstance(group, NonGroupMember):
        raise ValueError(
            "this rank is not a member of that group (new_group gave it NON_GROUP_MEMBER): "
            "call the collective on the ranks of the group only"
        )
    if group is not None:
        return group
    if _default is None:
        raise RuntimeError("call netdam.init(cluster=FILE, rank=R) first")
    return _default


def get_default_group() -> ProcessGroup:
    """The group of the last ``netdam.init`` (torch.distributed's default process group)."""
    return _group(None)


def get_rank(group: ProcessGroup | NonGroupMember | None = None) -> int:
    """This process's rank in *group*; -1 outside it (as torch.distributed)."""
    return -1 if isinstance(group, NonGroupMember) else _group(group).rank


def new_group(
    ranks: Sequence[int] | None = None, timeout: float | None = None, backend: str | None = None
) -> ProcessGroup | NonGroupMember:
    """torch.distributed.new_group on the default group: see ProcessGroup.new_group. *timeout*
    is the new group's watchdog (seconds without progress); *backend* must be None or "netdam"."""
    if backend not in (None, "netdam"):
        raise ValueError(
            f"new_group: backend {backend!r}: netdam groups run on netdam (give None or 'netdam')"
        )
    parent = _group(None)
    made = parent.new_group(range(parent.world_size) if ranks is None else list(ranks))
    if timeout is not None and isinstance(made, ProcessGroup):
        made.timeout_s = timeout
    return made


def get_world_size(group: ProcessGroup | None = None) -> int:
    return _group(group).world_size


def empty(
    shape: int | tuple[int, ...],
    dtype: type | np.dtype = np.float32,
    group: ProcessGroup | None = None,
) -> np.ndarray:
    """An array in NIC memory (see ProcessGroup.empty)."""
    return _group(group).empty(shape, dtype)


#: The calls of this process that open traces record (api.trace), one list per trace.
_TRACED: list[list[Work]] = []
#: init_process_group(trace=PATH)'s open traces, by group, until destroy_process_group.
_GROUP_TRACES: dict[int, contextlib.AbstractContextManager[TraceWritten]] = {}


@dataclass
class TraceWritten:
    """What api.trace wrote, filled in when its block ends: the file, the NIC records in it, and
    the records the NICs' rings had overwritten before they were read (0 unless the ring was
    too small for the block: ``netdam up --trace-records``)."""

    path: Path
    records: int = 0
    lost: int = 0


@contextlib.contextmanager
def trace(
    path: str | os.PathLike[str], group: ProcessGroup | None = None
) -> Iterator[TraceWritten]:
    """Record a timeline of what runs inside the ``with`` block and write it to *path* as a
    Chrome trace (Perfetto, speedscope; SPEC.md 6.7): every NIC of the group's
    cluster, hop by hop, and the calls this process's ranks made. The NICs record anyway (their
    trace rings); this notes where each ring stands at the start and reads what was written
    since at the end, with the admin's COUNTERS."""
    g = _group(group)
    nics = nics_of(g.cluster)
    calls: list[Work] = []
    written = TraceWritten(Path(path))
    with ControlClient.for_cluster(g.cluster) as client:
        since = mark(client, nics)
        _TRACED.append(calls)
        try:
            yield written
        finally:
            _TRACED.remove(calls)
            traces = collect(client, nics, since)
            write_trace(written.path, chrome_trace(traces, _host_calls(calls), title=str(path)))
            written.records = sum(len(t.records) for t in traces)
            written.lost = sum(t.lost for t in traces)


#: api.trace under a name init_process_group's ``trace`` parameter does not hide.
_trace_block = trace


def _host_calls(works: list[Work]) -> list[HostCall]:
    """The host's side of traced calls, in their group's ranks and the wire's ids."""
    return [
        HostCall(
            rank=w.group.rank,
            name=Algo(w.algo).name.lower(),
            coll_id=int(w.packet.coll_id),
            epoch=int(w.packet.epoch),
            called_at=w.called_at if w.called_at is not None else w.sent_at,
            sent_at=w.sent_at if w.sent else None,
            completed_at=w.completed_at,
            finished_at=w.finished_at,
            ok=w.error is None and not w.failed,  # its error is built by its wait()
        )
        for w in works
    ]


def _awaits_started(world: int, count: int, dtype: DType, mtu: int) -> bool:
    """Whether a chained collective of *count* elements over *world* ranks starts its chains
    only once every member's STARTED came (descriptor flags bit 2, SPEC.md 4.1 "STARTED"):
    when a member that starts late could not hold what the others send it early, one chain
    per chunk of each block (EARLY_CHAINS_HELD), each one past them answered BUSY.

    Why not always: awaiting costs a round of STARTEDs after the last member starts, where a
    held chain goes on the moment it does: 4 ranks x 4 KiB took 1.10 ms eager and 1.26-1.33
    ms awaiting, 8 x 64 KiB 2.7 and 2.8-3.7 ms. Why not never: 16 to 64 ranks x 1 MiB met
    6-260 BUSY a call eager and none awaiting, in about the same time (docs/PERFORMANCE.md,
    "Chains that await their members")."""
    if world < 2:
        return False
    per_packet = max(max_elements(mtu - TAG_SIZE, dtype, segments=world - 1), 1)
    block = -(-count // world)
    return bool(world * -(-block // per_packet) >= EARLY_CHAINS_HELD)


def _run(work: Work, async_op: bool) -> Work | None:
    for calls in _TRACED:
        calls.append(work)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(
    buf: Any,
    op: int = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    sparse: bool = False,
    update: tuple[int, int] | None = None,
) -> Work | None:
    """Reduce *buf* (a numpy array or CPU torch tensor) over all ranks in place; afterwards it
    is bitwise identical on every rank.

    ``sparse=True`` (every rank must pass the same): chunks travel as (index, value) pairs when
    under half their elements are non-zero, and chunks zero on every rank are not sent at all;
    the result is bitwise the dense one.

    ``update=(descriptor, step)``: fused reduce and update (SPEC.md 4.1; netdam.optim uses it):
    each block's sum steps the optimizer whose descriptor sits at *descriptor* in the block
    owner's node (this rank's, for its block), and *buf* ends holding the new weights, not the
    sum. SUM of float32, float16 or bfloat16 over one chain only."""
    called_at = time.monotonic()
    buf = _as_array(buf, "buf")
    average = op == ReduceOp.AVG
    wire = _wire_op(op, buf)
    g = _group(group)
    if update is not None and (op != ReduceOp.SUM or sparse or g.world_size > g.max_chain):
        raise ValueError(
            "a fused reduce and update is a dense SUM over one chain "
            f"(at most {g.max_chain} ranks): use all_reduce, then UPDATE (netdam.optim)"
        )
    if op == ReduceOp.PRODUCT:
        return _product_of_ranks(
            buf, g, async_op, lambda product: np.copyto(buf, product.reshape(buf.shape))
        )
    # Past one chain: a torus of chains (SPEC.md 4.2), dense (sparse mode's result is the
    # dense one's bits anyway). The plan first: a count that does not split fails here.
    steps = (
        torus_steps(g.world_size, g.rank, buf.size, g.max_chain)
        if g.world_size > g.max_chain
        else None
    )
    t_stage = time.perf_counter()
    addr, staged = g._stage(buf, buf.nbytes)
    stage_in_s = time.perf_counter() - t_stage
    work: Work
    if steps is not None:
        work = TorusWork(g, buf, wire, addr, steps)
        work.begin()
    else:
        work = g.start(
            Algo.ALL_REDUCE,
            buf,
            wire,
            addr,
            addr,
            buf.size,
            flags=(FLAG_SPARSE if sparse else 0) | (FLAG_UPDATE if update else 0),
            update=update or (0, 0),
        )
    work.stage_in_s, work.called_at = stage_in_s, called_at
    if staged:
        work._finish.append(lambda: _copy_out(g, addr, buf))
    if average:
        world = g.world_size
        work._finish.append(lambda: _divide(buf, world))
    return _run(work, async_op)


def reduce_scatter_tensor(
    output: Any,
    input: Any,
    op: int = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce *input* (world_size blocks, flat) over all ranks and leave this rank's block in
    *output* (torch.distributed.reduce_scatter_tensor)."""
    output, input = _as_array(output, "output"), _as_array(input, "input")
    average = op == ReduceOp.AVG
    wire = _wire_op(op, input)
    g = _group(group)
    count = input.size
    lo, hi = (g.rank * count // g.world_size, (g.rank + 1) * count // g.world_size)
    if output.size != hi - lo:
        raise ValueError(f"output has {output.size} elements; rank {g.rank}'s block has {hi - lo}")
    if op == ReduceOp.PRODUCT:
        return _product_of_ranks(
            input,
            g,
            async_op,
            lambda product: output.reshape(-1).__setitem__(slice(None), product[lo:hi]),
        )
    g._settle_writers_of(output)
    addr, _ = g._stage(input, input.nbytes)
    work = g.start(Algo.REDUCE_SCATTER, input, wire, addr, addr, count)
    work.output = output if work.room is not None else None
    esize = input.itemsize
    work._finish.append(
        lambda: output.reshape(-1).__setitem__(
            slice(None), g._memory_view[addr + lo * esize : addr + hi * esize].view(output.dtype)
        )
    )
    if average:
        world = g.world_size
        work._finish.append(lambda: _divide(output, world))
    return _run(work, async_op)


def _product_of_ranks(
    tensor: np.ndarray, g: ProcessGroup, async_op: bool, deliver: Callable[[np.ndarray], None]
) -> Work | None:
    """ReduceOp.PRODUCT: all-gather every rank's *tensor*, multiply the world_size vectors in
    rank order on this host (the same operations on the same bits on every rank: identical
    results) and hand the product to *deliver*."""
    mine = np.ascontiguousarray(tensor).reshape(-1)
    gathered = np.empty(mine.size * g.world_size, mine.dtype)
    work = all_gather_into_tensor(gathered, mine, g, async_op=True)
    assert work is not None

    def multiply() -> None:
        rows = gathered.reshape(g.world_size, mine.size)
        product = rows[0].copy()
        for row in rows[1:]:
            _multiply(product, row)
        deliver(product)

    work._finish.append(multiply)
    return _run(work, async_op)


def reduce_scatter(
    output: Any,
    input_list: Any,
    op: int = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """torch.distributed.reduce_scatter: *input_list* holds world_size tensors shaped like
    *output*; this rank's *output* gets the reduction of everyone's entry number rank. (A flat
    array in place of the list is taken as reduce_scatter_tensor's input, as netdam 0.1 had it.)"""
    if not isinstance(input_list, (list, tuple)):
        return reduce_scatter_tensor(output, input_list, op, group, async_op)
    g = _group(group)
    out = _as_array(output, "output")
    parts = [_as_array(t, f"input_list[{k}]") for k, t in enumerate(input_list)]
    if len(parts) != g.world_size or any(p.size != out.size or p.dtype != out.dtype for p in parts):
        raise ValueError(
            f"input_list must hold {g.world_size} tensors of output's size ({out.size}) and dtype ({out.dtype})"
        )
    flat = np.concatenate([p.reshape(-1) for p in parts])
    return reduce_scatter_tensor(out, flat, op, group, async_op)


def all_gather_into_tensor(
    output: Any, input: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's *input* (its block) into the flat *output* on every rank
    (torch.distributed.all_gather_into_tensor)."""
    output, input = _as_array(output, "output"), _as_array(input, "input")
    g = _group(group)
    count = output.size
    lo, hi = (g.rank * count // g.world_size, (g.rank + 1) * count // g.world_size)
    if input.size != hi - lo:
        raise ValueError(f"input has {input.size} elements; rank {g.rank}'s block has {hi - lo}")
    g._settle_writers_of(input)
    g._settle_writers_of(output)
    out_addr = g._staging_room((output.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + input.nbytes)
    in_addr = out_addr + (output.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    g._memory_view[in_addr : in_addr + input.nbytes] = (
        np.ascontiguousarray(input).reshape(-1).view(np.uint8)
    )
    work = g.start(Algo.ALL_GATHER, output, WireOp.SUM, in_addr, out_addr, count)
    work._finish.append(lambda: _copy_out(g, out_addr, output))
    return _run(work, async_op)


def all_gather(
    tensor_list: Any, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """torch.distributed.all_gather: entry k of *tensor_list* receives rank k's *tensor*. (A
    flat array in place of the list is taken as all_gather_into_tensor's output, as netdam 0.1
    had it.)"""
    if not isinstance(tensor_list, (list, tuple)):
        return all_gather_into_tensor(tensor_list, tensor, group, async_op)
    g = _group(group)
    mine = _as_array(tensor, "tensor")
    outs = [_as_array(t, f"tensor_list[{k}]") for k, t in enumerate(tensor_list)]
    if len(outs) != g.world_size or any(o.size != mine.size or o.dtype != mine.dtype for o in outs):
        raise ValueError(
            f"tensor_list must hold {g.world_size} tensors of tensor's size ({mine.size}) and dtype ({mine.dtype})"
        )
    flat = np.empty(mine.size * g.world_size, mine.dtype)
    work = all_gather_into_tensor(flat, mine, group, async_op=True)
    assert work is not None

    def scatter_into_list() -> None:
        for k, out in enumerate(outs):
            out.reshape(-1)[:] = flat[k * mine.size : (k + 1) * mine.size]

    work._finish.append(scatter_into_list)
    return _run(work, async_op)


def broadcast(
    buf: Any, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy rank *src*'s *buf* into every rank's *buf*."""
    buf = _as_array(buf, "buf")
    g = _group(group)
    addr, staged = g._stage(buf, buf.nbytes)
    work = g.start(Algo.BROADCAST, buf, WireOp.SUM, addr, addr, buf.size, root=src)
    if staged:
        work._finish.append(lambda: _copy_out(g, addr, buf))
    return _run(work, async_op)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Return once every rank reached the barrier (an all-reduce of one element); with
    *async_op*, the Work to wait on."""
    token = np.ones(1, np.int32)
    world = _group(group).world_size
    work = all_reduce(token, group=group, async_op=True)
    assert work is not None

    def check() -> None:
        if int(token[0]) != world:
            raise CollectiveError(f"barrier counted {int(token[0])} ranks, expected {world}")

    work._finish.append(check)
    return _run(work, async_op)


def is_initialized() -> bool:
    """Whether a default group exists (init or init_process_group, not yet destroyed)."""
    return _default is not None


#: Environment variables of ``init_method="env://"``: the cluster file, and torch's names.
ENV_CLUSTER, ENV_RANK, ENV_WORLD_SIZE = "NETDAM_CLUSTER", "RANK", "WORLD_SIZE"


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    rank: int = -1,
    world_size: int = -1,
    timeout: datetime.timedelta | float | None = None,
    multicast: bool = True,
    trace: str | os.PathLike[str] | None = None,
) -> ProcessGroup:
    """torch.distributed.init_process_group for a netdam cluster. ``init_method``: "env://"
    (the default: the cluster file in $NETDAM_CLUSTER, rank and world size from $RANK and
    $WORLD_SIZE unless given) or "file://PATH" (the cluster file, which ``netdam up`` writes);
    *world_size* must match the file's node count. *backend* may be None or "netdam".
    ``trace=PATH``: a timeline of everything until destroy_process_group, written there then
    (as ``with netdam.api.trace(PATH)`` around it would)."""
    if backend not in (None, "netdam"):
        raise ValueError(
            f"backend {backend!r}: netdam is its own backend (pass backend=None or 'netdam'); "
            "for Gloo or NCCL use torch.distributed"
        )
    method = init_method or "env://"
    if method == "env://":
        path = os.environ.get(ENV_CLUSTER)
        if not path:
            raise ValueError(
                f"init_method env:// reads the cluster file from ${ENV_CLUSTER}: set it to the "
                "file `netdam up` wrote, or pass init_method='file://PATH'"
            )
        rank = rank if rank >= 0 else _env_int(ENV_RANK)
        world_size = world_size if world_size >= 0 else _env_int(ENV_WORLD_SIZE, -1)
    elif method.startswith("file://"):
        path = method[len("file://") :]
        if rank < 0:
            raise ValueError("init_method file:// needs rank=")
    else:
        raise ValueError(
            f"init_method {method!r}: use 'env://' or 'file://PATH' (the cluster file)"
        )
    cluster = load_cluster(Path(path))
    if world_size >= 0 and world_size != len(cluster.nodes):
        raise ValueError(
            f"world_size {world_size} but {path} has {len(cluster.nodes)} nodes: one rank per node"
        )
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    group = init(cluster=Path(path), rank=rank, multicast=multicast, timeout=seconds)
    if trace is not None:
        recording = _trace_block(trace, group)
        recording.__enter__()
        _GROUP_TRACES[id(group)] = recording
    return group


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"init_method env:// needs ${name} (or the {name.lower()}= argument)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    global _default
    g = _group(group)
    recording = _GROUP_TRACES.pop(id(g), None)
    if recording is not None:
        recording.__exit__(None, None, None)  # the trace file, while the group still runs
    g.close()
    if g is _default:
        _default = None


def _copy_out(g: ProcessGroup, addr: int, buf: np.ndarray) -> None:
    flat = buf.reshape(-1).view(np.uint8) if buf.flags.c_contiguous else None
    data = g._memory_view[addr : addr + buf.nbytes]
    if flat is not None:
        flat[:] = data
    else:
        buf[...] = data.view(buf.dtype).reshape(buf.shape)


# Sizes in bytes of the element types the API accepts.
ELEMENT_BYTES = {dt: ELEMENT_SIZE[code] for dt, code in _DTYPES.items()}
