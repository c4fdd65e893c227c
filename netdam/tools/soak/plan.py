"""The soak's plan, shared by the parent and its client processes: sizes, the seeded layout of
regions and blocks, each client's settings, the book of block versions and the counter check."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from netdam.core.faults import FaultSpec
from netdam.protocol.constants import MAX_PAYLOAD_BYTES, Opcode
from netdam.protocol.errors import NetdamError
from netdam.protocol.packet import Endpoint

if TYPE_CHECKING:
    from netdam.cluster.clusterfile import ClusterFile
    from netdam.switch.addrmap import Region

KiB = 1024
#: Largest block: one request's payload.
BLOCK_MAX = MAX_PAYLOAD_BYTES
REGION_MIN, REGION_MAX = 8 * KiB, 256 * KiB
STRIDES = (4 * KiB, 8 * KiB, 16 * KiB)
COUNTER_REGION = 32 * KiB
NODE_MEMORY = 32 << 20
#: Operation mix: WRITE, READ, FETCH_ADD.
MIX = (0.4, 0.4, 0.2)
KINDS = (Opcode.WRITE, Opcode.READ, Opcode.FETCH_ADD)
FILL_BATCH = 64
VERIFY_BATCH = 64
DONE_GRACE_S = 60.0
#: A reordered reply is released after the next one, or after this long if none comes.
REORDER_HOLD_S = 0.002
ATTEMPT_MEMORY = 1 << 16
ERROR_SAMPLES = 10
FAULT_SITES = ("switch", "nodes")
SNAPSHOT_KEYS = (
    "switch_fault_drops",
    "switch_fault_dups",
    "switch_fault_held",
    "switch_kernel_drops",
    "switch_other_drops",
    "node_dup_replays",
    "node_dup_silent",
    "node_stale_nacks",
    "node_fault_drops",
    "node_kernel_drops",
    "node_other_drops",
)

OK, LOST, CORRUPT = "ok", "lost", "corrupt"


class SoakFailure(NetdamError):
    """The soak could not run to the end (cluster, client process): exit 3."""


# ---------------------------------------------------------------- configuration and plan


@dataclass
class SoakConfig:
    clients: int = 8
    seconds: float = 60.0
    nodes: int = 3
    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    delay_ms: float = 0.0
    #: Fraction of datagrams delayed by delay_ms on each hop (when delay_ms > 0).
    delay_prob: float = 0.1
    seed: int = 1
    pipeline: int = 8
    timeout_ms: float = 50.0
    #: 40 retries of 50 ms: a 2 s budget, so that a scheduling stall of an overloaded machine
    #: (up to ~0.75 s seen on 2 cores at load 10) is not reported as an unanswered request.
    retries: int = 40
    cluster: Path | None = None
    #: Where request faults go in a private cluster: "switch" (its client:rx and node<R>:tx
    #: links) or "nodes" (the nodes' receive side). Replies always get the clients' receive side.
    fault_site: str = "switch"
    mix: tuple[float, float, float] = MIX
    #: Test hook: runs after the clients stopped, before the final check (e.g. corrupts memory).
    tamper: Callable[[SoakLayout, ClusterFile], None] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.clients <= 64:
            raise ValueError(f"--clients {self.clients}: give 1..64")
        if not 1 <= self.nodes <= 16:
            raise ValueError(f"--nodes {self.nodes}: give 1..16")
        if not 1 <= self.pipeline <= 32:
            raise ValueError(f"--pipeline {self.pipeline}: give 1..32")
        if self.fault_site not in FAULT_SITES:
            raise ValueError(f"fault site {self.fault_site!r}: use one of {', '.join(FAULT_SITES)}")
        if abs(sum(self.mix) - 1.0) > 1e-9 or min(self.mix) < 0:
            raise ValueError(
                f"operation mix {self.mix} must be 3 non-negative fractions summing to 1"
            )
        self.reply_faults()  # validates the probabilities

    def reply_faults(self) -> FaultSpec:
        """Faults on the clients' receive side (the replies)."""
        return FaultSpec(
            loss=self.loss,
            dup=self.dup,
            reorder=self.reorder,
            delay_s=self.delay_ms / 1000.0,
            delay=self.delay_prob if self.delay_ms else 0.0,
            seed=self.seed,
        )

    @property
    def quiesce_s(self) -> float:
        """Pause after a failed batch: whatever the client abandoned has drained by then."""
        return max(0.2, 2 * self.timeout_ms / 1000.0 + 3 * self.delay_ms / 1000.0)


@dataclass(frozen=True)
class ClientPlan:
    """What one client process works on."""

    index: int
    client_id: int
    seed: int
    gaddr: int
    rkey: int
    size: int
    stride: int
    ways: int
    blocks: tuple[tuple[int, int], ...]  # (offset, length) in the region
    counter_addr: int
    counter_rkey: int
    way_nodes: tuple[int, ...] = ()  # rank of each way of the region
    counter_node: int = -1
    #: Tag keys of the region and of the counter's (SPEC.md 2.6), b"": untagged.
    tag_key: bytes = b""
    counter_tag_key: bytes = b""

    def tag_keys(self) -> dict[int, bytes]:
        """rkey -> tag key, for the client's PoolClient."""
        keys = {self.rkey: self.tag_key, self.counter_rkey: self.counter_tag_key}
        return {rkey: key for rkey, key in keys.items() if key}

    def node_of(self, addr: int) -> int:
        """Rank of the node holding global address *addr* (-1: unknown)."""
        if addr == self.counter_addr:
            return self.counter_node
        if not self.way_nodes or not 0 <= addr - self.gaddr < self.size:
            return -1
        if not self.stride:
            return self.way_nodes[0]
        return self.way_nodes[(addr - self.gaddr) // self.stride % len(self.way_nodes)]


@dataclass(frozen=True)
class ClientSettings:
    vip: Endpoint
    pipeline: int
    timeout_s: float
    retries: int
    mix: tuple[float, float, float]
    reply_faults: FaultSpec
    quiesce_s: float


@dataclass
class SoakLayout:
    """The pool regions of one soak (what the tamper hook and the final check need)."""

    plans: list[ClientPlan]
    regions: list[Region]
    counter_region: Region
    counter_addr: int


def seeded(seed: int, *salt: int) -> np.random.Generator:
    """The generator of one part of the workload (any int seed, negative ones too)."""
    return np.random.default_rng([seed % (1 << 64), *salt])


def client_ids(seed: int, count: int) -> list[int]:
    """*count* non-zero client ids, distinct modulo 256 (the nodes' window slots, SPEC.md 7)."""
    if count > 255:
        raise ValueError(f"{count} clients cannot have distinct ids modulo 256")
    base = int(seeded(seed, 0x1D).integers(1, 1 << 24))
    return [((base << 8) | (k + 1)) & 0xFFFFFFFF for k in range(count)]


def draw_region(rng: np.random.Generator, nodes: int) -> tuple[int, int, int]:
    """(size, stride, ways) of one client's region; stride 0 = range-mapped on one node."""
    size = int(rng.integers(REGION_MIN, REGION_MAX + 1))
    if nodes < 2 or rng.random() < 0.5:
        return size, 0, 1
    return size, int(rng.choice(STRIDES)), int(rng.integers(2, nodes + 1))


def layout_blocks(size: int, stride: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Cut [0, size) into blocks of 1..8192 bytes, none crossing a multiple of *stride*."""
    blocks = []
    pos = 0
    while pos < size:
        limit = min(BLOCK_MAX, size - pos)
        if stride:
            limit = min(limit, stride - pos % stride)
        length = limit if rng.random() < 0.2 else int(rng.integers(1, limit + 1))
        blocks.append((pos, length))
        pos += length
    return blocks


# ---------------------------------------------------------------- bookkeeping (pure)


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class BlockState:
    """What a block may hold: the last acknowledged version, or an unconfirmed one."""

    current: bytes | None = None  # checksum of the last acknowledged write
    pending: set[bytes] = field(default_factory=set)  # writes never acknowledged since
    older: set[bytes] = field(default_factory=set)  # earlier acknowledged (or superseded) versions


class BlockBook:
    """Checksums of every block of one region, and what reads found."""

    def __init__(self, blocks: int) -> None:
        self.blocks = [BlockState() for _ in range(blocks)]
        self.lost_writes = 0
        self.corrupt_reads = 0
        self._lost: set[tuple[int, bytes]] = set()

    def acknowledged(self, block: int, digest: bytes) -> None:
        """A WRITE of data with *digest* was ACKed: the block must now hold exactly it."""
        state = self.blocks[block]
        if state.current is not None:
            state.older.add(state.current)
        state.older |= state.pending
        state.pending.clear()
        state.current = digest
        state.older.discard(digest)

    def unconfirmed(self, block: int, digest: bytes) -> None:
        """A WRITE got no ACK: it may or may not have landed."""
        self.blocks[block].pending.add(digest)

    def check(self, block: int, data: bytes) -> str:
        """OK, LOST (an earlier acknowledged version: the last write was lost) or CORRUPT."""
        state = self.blocks[block]
        digest = checksum(data)
        if digest == state.current or digest in state.pending:
            return OK
        if digest in state.older and state.current is not None:
            if (block, state.current) not in self._lost:
                self._lost.add((block, state.current))
                self.lost_writes += 1
            return LOST
        self.corrupt_reads += 1
        return CORRUPT


def check_counter(initial: int, final: int, olds: np.ndarray, unconfirmed: int) -> dict[str, int]:
    """Exactly-once check of the shared counter (see the module docstring for the definitions)."""
    delta = (final - initial) % (1 << 64)
    acked = int(olds.shape[0])
    if delta < acked:
        error = delta - acked
    elif delta > acked + unconfirmed:
        error = delta - acked - unconfirmed
    else:
        error = 0
    rel = (
        (olds.astype(np.uint64) - np.uint64(initial % (1 << 64)))
        if acked
        else olds.astype(np.uint64)
    )
    out_of_range = int(np.count_nonzero(rel >= np.uint64(delta))) if acked else 0
    collisions = acked - int(np.unique(rel).shape[0]) if acked else 0
    return {
        "initial": initial,
        "final": final,
        "acknowledged_increments": acked,
        "unconfirmed_increments": unconfirmed,
        "applied_unconfirmed": max(0, min(delta - acked, unconfirmed)),
        "counter_error": error,
        "counter_old_value_errors": out_of_range + collisions,
    }


def latency_summary(samples_us: np.ndarray) -> dict[str, float | int | None]:
    if samples_us.size == 0:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "p999": None, "max": None}
    p50, p90, p99, p999 = np.percentile(samples_us, [50, 90, 99, 99.9])
    return {
        "count": int(samples_us.size),
        "p50": round(float(p50), 1),
        "p90": round(float(p90), 1),
        "p99": round(float(p99), 1),
        "p999": round(float(p999), 1),
        "max": round(float(samples_us.max()), 1),
    }


# ---------------------------------------------------------------- the parent
