"""An in-memory network that drives sans-I/O cores in tests, with seeded faults and multicast.

Time is a number the test advances (``advance``, ``run_until_idle``); nothing reads a clock.
Cores are anything with ``receive_batch`` and ``fill_send_batch``; plain endpoints (clients in
tests) get a mailbox instead. Faults are decided per receiver by ``netdam.core.faults.decide``, the
same function real node processes use, so a seeded run replays exactly.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from netdam.core.faults import FaultSpec, decide, packet_id
from netdam.core.sendqueue import SLOT_BYTES
from netdam.protocol.packet import Endpoint, endpoint_to_u64, u64_to_endpoint

#: Datagrams one core takes or gives per step: the batch a real I/O shell would move.
BATCH = 64
#: Smallest clock jump when only timers are pending, seconds.
TIMER_STEP_S = 0.001


class BatchCore(Protocol):
    """What the fabric needs from a core."""

    def receive_batch(
        self,
        buf: np.ndarray,
        offs: np.ndarray,
        lens: np.ndarray,
        srcs: np.ndarray,
        n: int,
        now: float,
    ) -> None: ...

    def fill_send_batch(
        self,
        out: np.ndarray,
        out_offs: np.ndarray,
        out_lens: np.ndarray,
        out_dsts: np.ndarray,
        now: float,
    ) -> int: ...

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...


class Fabric:
    """Moves datagrams between cores and mailboxes in rounds."""

    def __init__(self, faults: FaultSpec | None = None) -> None:
        self.now = 0.0
        self.faults = faults or FaultSpec()
        self._cores: dict[int, BatchCore] = {}
        self._mailboxes: dict[int, deque[tuple[bytes, Endpoint]]] = {}
        self._groups: dict[int, set[int]] = defaultdict(set)
        # (time, round, order, src, dst, data): heap of datagrams in flight.
        self._flight: list[tuple[float, int, int, int, int, bytes]] = []
        self._order = 0
        self._round = 0
        self._attempts: dict[tuple[int, int, int], int] = defaultdict(int)
        self.stats = {"sent": 0, "delivered": 0, "dropped": 0, "duplicated": 0, "reordered": 0}
        #: Drop exactly the datagram with this delivery index (0-based), for "drop each packet in
        #: turn" tests; None: off.
        self.drop_nth: int | None = None
        #: Drop every datagram this says True of (source, destination, bytes), for tests that
        #: lose a chosen datagram; None: off.
        self.drop_if: Callable[[Endpoint, Endpoint, bytes], bool] | None = None
        self._scheduled = 0
        self._out = np.zeros(BATCH * SLOT_BYTES, np.uint8)
        self._out_offs = np.zeros(BATCH, np.int64)
        self._out_lens = np.zeros(BATCH, np.int32)
        self._out_dsts = np.zeros(BATCH, np.uint64)

    # ------------------------------------------------------------------ topology

    def add_core(self, endpoint: Endpoint, core: BatchCore) -> None:
        self._cores[endpoint_to_u64(endpoint)] = core

    def add_endpoint(self, endpoint: Endpoint) -> None:
        self._mailboxes[endpoint_to_u64(endpoint)] = deque()

    def join(self, group: Endpoint, member: Endpoint) -> None:
        """Replicate datagrams sent to *group* to *member* (the sender never gets its own copy)."""
        self._groups[endpoint_to_u64(group)].add(endpoint_to_u64(member))

    def leave(self, group: Endpoint, member: Endpoint) -> None:
        self._groups[endpoint_to_u64(group)].discard(endpoint_to_u64(member))

    # ------------------------------------------------------------------ traffic

    def send(self, src: Endpoint, dst: Endpoint, data: bytes) -> None:
        """Inject a datagram from *src* (usually a mailbox endpoint)."""
        self._route(endpoint_to_u64(src), endpoint_to_u64(dst), data)

    def receive(self, endpoint: Endpoint) -> list[tuple[bytes, Endpoint]]:
        """Drain the mailbox of *endpoint*."""
        box = self._mailboxes[endpoint_to_u64(endpoint)]
        items = list(box)
        box.clear()
        return items

    def step(self) -> int:
        """One round: run the cores' clocks, collect their output, deliver what is due.
        Returns datagrams moved."""
        for core in self._cores.values():
            if core.get_timer() is not None:
                core.handle_timer(self.now)
        moved = self._collect()
        self._round += 1
        return moved + self._deliver_due()

    def run_until_idle(self, max_rounds: int = 10_000) -> int:
        """Step until nothing is in flight or queued and no core has a timer; when only timers
        or delayed packets remain, jump the clock to the earliest (at least TIMER_STEP_S on)."""
        for rounds in range(max_rounds):
            moved = self.step()
            if moved:
                continue
            timers = [t for core in self._cores.values() if (t := core.get_timer()) is not None]
            if not self._flight and not timers:
                return rounds
            due = min(timers + ([self._flight[0][0]] if self._flight else []))
            self.now = max(due, self.now + TIMER_STEP_S) if timers else max(self.now, due)
        raise RuntimeError(f"fabric still busy after {max_rounds} rounds")

    def advance(self, seconds: float) -> None:
        self.now += seconds

    # ------------------------------------------------------------------ internals

    def _collect(self) -> int:
        moved = 0
        for src, core in list(self._cores.items()):
            while True:
                count = core.fill_send_batch(
                    self._out, self._out_offs, self._out_lens, self._out_dsts, self.now
                )
                for k in range(count):
                    start = int(self._out_offs[k])
                    data = bytes(self._out[start : start + self._out_lens[k]])
                    self._route(src, int(self._out_dsts[k]), data)
                moved += count
                if count < BATCH:
                    break
        return moved

    def _route(self, src: int, dst: int, data: bytes) -> None:
        self.stats["sent"] += 1
        targets = sorted(self._groups[dst] - {src}) if dst in self._groups else [dst]
        for target in targets:
            self._schedule(src, target, data)

    def _schedule(self, src: int, dst: int, data: bytes) -> None:
        index = self._scheduled
        self._scheduled += 1
        if index == self.drop_nth or (
            self.drop_if is not None
            and self.drop_if(u64_to_endpoint(src), u64_to_endpoint(dst), data)
        ):
            self.stats["dropped"] += 1
            return
        if self.faults.active:
            pid = packet_id(data)
            key = (src, dst, pid)
            fate = decide(self.faults, src, dst, pid, self._attempts[key])
            self._attempts[key] += 1
            if fate.drop:
                self.stats["dropped"] += 1
                return
            self.stats["duplicated"] += fate.copies - 1
            self.stats["reordered"] += int(fate.reorder)
            when = self.now + fate.delay_s
            round_ = self._round + (2 if fate.reorder else 0)
            copies = fate.copies
        else:
            when, round_, copies = self.now, self._round, 1
        for _ in range(copies):
            self._order += 1
            heapq.heappush(self._flight, (when, round_, self._order, src, dst, data))

    def _deliver_due(self) -> int:
        due: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        held = []
        while self._flight and self._flight[0][0] <= self.now:
            entry = heapq.heappop(self._flight)
            if entry[1] > self._round:
                held.append(entry)  # reordered: due in a later round
                continue
            due[entry[4]].append((entry[3], entry[5]))
        for entry in held:
            heapq.heappush(self._flight, entry)
        count = 0
        for dst, items in due.items():
            count += len(items)
            self.stats["delivered"] += len(items)
            if dst in self._cores:
                self._deliver_to_core(self._cores[dst], items)
            elif dst in self._mailboxes:
                self._mailboxes[dst].extend((data, u64_to_endpoint(src)) for src, data in items)
        return count

    def _deliver_to_core(self, core: BatchCore, items: list[tuple[int, bytes]]) -> None:
        for start in range(0, len(items), BATCH):
            chunk = items[start : start + BATCH]
            lens = np.array([len(data) for _, data in chunk], np.int32)
            offs = np.zeros(len(chunk), np.int64)
            offs[1:] = np.cumsum(lens[:-1])
            buf = np.frombuffer(b"".join(data for _, data in chunk) or b"\0", np.uint8).copy()
            srcs = np.array([src for src, _ in chunk], np.uint64)
            core.receive_batch(buf, offs, lens, srcs, len(chunk), self.now)
