"""A node process hosting several emulated NICs: one set of loaded kernels, one event loop.

Each NIC is a ``NodeProcess`` (its own UDP endpoint, management port, memory file, core,
counters and fault settings); to clients, switches and peers nothing tells it from a NIC alone
in its process. What the NICs share is what costs a process its start-up and its resident
size: numba and the compiled kernels (loaded once, ~1.5 s of CPU and ~200 MB per process), and
the receive buffers of the serve call (one NIC's call, punted datagrams included, ends before
the next NIC's begins).

The loop: epoll(7) over every NIC's sockets; the NICs with traffic, or with a clock to run (a
collective, held datagrams, sends waiting for room), are visited in one compiled call
(``serve.NicLoop``): each visit takes nothing but what is already queued (no time to wait: up
to ROUNDS_PER_NIC rounds of batches). The call stops early after a NIC whose punted datagrams
or send queue Python must see first; each NIC's control plane runs after its visit, and a NIC
Python did anything for has its arguments given to the loop again. A datagram for a NIC whose turn has passed
waits for the others' turns, which a card never does; the loop measures its passes and the
NICs' collective timers cover the longest recent one (``CollectiveSlots.set_host_turn``), so
waiting for a turn is not taken for loss. A process with one NIC runs that NIC's own blocking
loop instead (``NodeProcess.run``): nothing changes for ``--nics-per-process 1``.
"""

from __future__ import annotations

import contextlib
import math
import resource
import select
import socket
import time

import numpy as np

from netdam.kernels import serve
from netdam.shell.node_process import NodeProcess, NodeProcessConfig, ServeBuffers
from netdam.shell.process import ServeLoop, serve_main
from netdam.shell.startup import CORES
from netdam.shell.turns import TurnBoard

#: Rounds of one NIC's serve call before the next NIC's turn. Fewer keep a pass over the NICs
#: short when all of them have traffic at once (a torus row's multicast gather reaches 63 NICs of
#: a process in the same instant), so a datagram for a NIC whose turn has passed waits less (a
#: peer in another process sees this process's passes only through the TurnBoard). Measured on 2 cores,
#: 128 NICs x 1 MiB, 3 calls: 32 rounds re-sent chains in 2 runs of 8 (5 and 15, 0.31-0.42 s), 4
#: rounds in none of 6 (0.31-0.32 s); 256 NICs alike within the spread (0.71-0.83 s both).
ROUNDS_PER_NIC = 4
#: Longest wait for traffic while some NIC runs a clock: a collective's engine ticks at least
#: every millisecond (netdam.kernels.serve waits at most 1 ms while one runs, likewise).
CLOCK_WAIT_MS = 1
#: How long a process hosting a few NICs polls their sockets without sleeping while a
#: collective runs, before it sleeps: on 2 cores the next datagram of a hop often comes within
#: tens of microseconds, and a process asleep in epoll then pays a wake-up on a busy core. Only
#: in a process of at most SPIN_MAX_NICS NICs (past that it has traffic queued most of the
#: time, and its spinning takes the core the other node process needs: 128 x 1 MiB took
#: 0.18-0.23 s a call against 0.17-0.19 s), and only while the cluster's node processes on this
#: machine are no more than its cores (8 NICs in 4 processes on 2 cores took 3.8-3.9 ms a call
#: against 2.8-3.0 ms). docs/PERFORMANCE.md has the measurements.
SPIN_S = 200e-6
SPIN_MAX_NICS = 8
#: A process that leaves a core to the hosts (the cluster's node processes here fewer than the
#: cores) also polls for SPIN_S before it sleeps for this long after a collective's clock
#: stopped: a repeated collective's next START_COLL comes a host's return and issue later
#: (~0.1 ms at 4 KiB), and a host's send to a sleeping process pays the wake-up inside its
#: `sendto` (2 NICs in one process x 4 KiB: 0.317-0.323 ms a call against 0.357-0.364 ms, the
#: first to the last START_COLL 65 us against 87-88 us). Where the node processes fill the
#: cores it cost: 4 x 4 KiB in two processes took 1.12-1.18 ms against 0.96-1.04 ms, the hosts'
#: returns starved (docs/PERFORMANCE.md, "A node process that lingers").
LINGER_S = 0.005
#: Half-life of the longest turn the NICs' timers remember (seconds): a long turn keeps the
#: timers up across the lull between a torus's steps, and the next call's start.
TURN_HALF_LIFE_S = 1.0
#: The NICs are told a new turn when it moved by more than this fraction (each write costs
#: ~10 us a NIC).
TURN_CHANGE = 0.25
#: The machine's board (TurnBoard) is read at most this often (written every pass): a longer
#: turn of another process reaches this one's timers at most 1 ms late, where the turns that
#: matter last tens of ms, and reading it every pass took ~11% of a node process's CPU at 4
#: NICs x 4 KiB (numpy over the board's rows, several thousand passes a second; py-spy).
BOARD_PERIOD_S = 0.001


class NicHost(ServeLoop):
    """Serves the NICs of one process until SIGTERM/SIGINT or ``stop``."""

    def __init__(self, configs: list[NodeProcessConfig]) -> None:
        if not configs:
            raise ValueError("a node process needs at least one NIC")
        _raise_fd_limit(4 * len(configs) + 64)  # data, management and group socket, memory file
        self.buffers = ServeBuffers.new(max(config.mtu for config in configs))
        self.nics: list[NodeProcess] = []
        try:
            for config in configs:
                self.nics.append(NodeProcess(config, self.buffers))
        except BaseException:
            self.close()
            raise
        #: The longest recent pass over the NICs with traffic (seconds, decaying), which the
        #: NICs' collective timers cover (CollectiveSlots.set_host_turn), and when it was taken.
        self._start_turns(time.monotonic())
        #: The machine's other node processes of this cluster publish theirs there: the NICs'
        #: timers cover the longest, since a chain's ACK may come from any of them.
        first = configs[0]
        self.board = (
            TurnBoard.open(first.shm_dir, first.members, first.world_size, first.rank)
            if len(configs) > 1
            else None
        )
        #: The NICs whose clock runs (served every pass, traffic or not), and when the last
        #: pass began (the wait of theirs for their next turn).
        self._clocked: set[int] = set()
        #: When a pass last found a NIC's clock running (LINGER_S).
        self._clock_seen = -math.inf
        #: NICs whose control plane ran in the last pass: the next pass visits them at once.
        self._touched: set[int] = set()
        self._pass_began = time.monotonic()
        self._poll = select.epoll()
        self._owner: dict[int, int] = {}
        self._fds: list[tuple[int, ...]] = [() for _ in self.nics]
        self._sockets: list[tuple[socket.socket, ...]] = [() for _ in self.nics]
        self._control_fds: list[int] = [nic.ctrl_sock.fileno() for nic in self.nics]
        for k in range(len(self.nics)):
            self._watch(k)
        #: One compiled call serves a pass's NICs (serve.NicLoop), and reports on each here.
        self._loop = serve.NicLoop(self.nics[0].rx, self.buffers.punt)
        self._report = np.zeros((len(self.nics), serve.OUT_COLUMNS), np.int64)
        self._put_all()

    @property
    def single(self) -> NodeProcess | None:
        """The NIC, when the process hosts exactly one (it then runs its own loop)."""
        return self.nics[0] if len(self.nics) == 1 else None

    def _watch(self, k: int) -> None:
        """Keep epoll's set equal to NIC *k*'s sockets (a JOIN or LEAVE changes its group
        socket). Sockets are compared, not descriptor numbers: a group socket opened after the
        last one closed usually takes its number, and a closed descriptor has already left
        epoll's set (so its number's unregister may fail, harmlessly)."""
        sockets = self.nics[k].sockets()
        if len(sockets) == len(self._sockets[k]) and all(
            a is b for a, b in zip(sockets, self._sockets[k], strict=True)
        ):
            return
        for fd in self._fds[k]:
            with contextlib.suppress(OSError):
                self._poll.unregister(fd)
            self._owner.pop(fd, None)
        fds = tuple(sock.fileno() for sock in sockets)
        for fd in fds:
            self._poll.register(fd, select.EPOLLIN)
            self._owner[fd] = k
        self._sockets[k], self._fds[k] = sockets, fds

    def serve_once(self, timeout_ms: int) -> int:
        single = self.single
        if single is not None:
            reason = single.serve_once(timeout_ms)
            return reason
        # A NIC whose control plane just ran (a START_COLL set a collective up, a punt was
        # answered) is visited again at once: its first tick, or the chains held for it, must
        # not wait for the clock's next millisecond (4 NICs x 4 KiB: a collective began ~1 ms
        # after its START_COLL when nothing else woke the process).
        wait = (
            0 if self._touched else min(timeout_ms, CLOCK_WAIT_MS) if self._clocked else timeout_ms
        )
        due = self._clocked | self._touched
        self._touched = set()
        ready = set()
        events: list[tuple[int, int]] = []
        spin = self._spin_before(wait, time.monotonic())
        if spin > 0:
            spin_until = time.monotonic() + spin
            events = self._poll.poll(0)
            while not events and time.monotonic() < spin_until:
                events = self._poll.poll(0)
        if not events:
            events = self._poll.poll(wait / 1000.0)
        for fd, _ in events:
            owner = self._owner.get(fd)
            if owner is not None:
                due.add(owner)
                ready.add(fd)
        began = time.monotonic()
        if self._clocked and began - self._pass_began > self.turn_s:
            # The NICs whose clock runs waited this long for this pass: their timers run first
            # in their visit (before they read the ACKs that waited with them), so they must
            # cover this wait already, not only from the end of this pass on.
            self._note_turn(began - self._pass_began, began)
        self._pass_began = began
        if self.board is not None:
            self.board.begin(began)  # the others' timers cover this pass while it runs
        order = np.array(sorted(due), np.int64)
        report = self._report
        position = 0
        while position < order.shape[0]:
            # The loop stops after a NIC whose punted datagrams (in the shared batch) or send
            # queue the control plane must see before the next NIC is served.
            end = self._loop.serve(order, position, report)
            visited = order[position:end].tolist()
            if position == 0 and end == order.shape[0] and len(self.nics) > 1:
                # The call's sweeps (serve._serve_nics) may have visited NICs outside order.
                swept = np.flatnonzero(report[:, serve.OUT_SWEPT]).tolist()
                visited += [k for k in swept if k not in due]
            for k in visited:
                self._after_visit(k, ready)
            position = end
        ended = time.monotonic()
        self._note_turn(ended - began, ended)
        return len(due)

    def _spin_before(self, wait_ms: float, now: float) -> float:
        """Seconds to poll before this pass waits up to *wait_ms* (spin_s), noting when a clock
        last ran (LINGER_S)."""
        if self._clocked:
            self._clock_seen = now
        lingering = now - self._clock_seen < LINGER_S
        clocked = bool(self._clocked)
        return spin_s(len(self.nics), clocked, wait_ms, self._board_processes, CORES, lingering)

    def _after_visit(self, k: int, ready: set[int]) -> None:
        """NIC *k*'s control plane after its visit, and whether its clock runs now."""
        reason, n_punt, clock = self._report[k, : serve.OUT_CLOCK + 1].tolist()
        nic = self.nics[k]
        # An ended collective's key went in the compiled loop (restart.drop_ended_keys).
        if nic.after_visit(reason, n_punt, self._control_fds[k] in ready, False):
            self._loop.put(k, nic.loop_args(ROUNDS_PER_NIC))
            self._watch(k)
            clock = nic.wants_clock()
            self._touched.add(k)
        if clock:
            self._clocked.add(k)
        else:
            self._clocked.discard(k)

    def _put_all(self) -> None:
        """Give the loop every NIC's arguments (again: after the NICs were served one by one)."""
        for k, nic in enumerate(self.nics):
            self._loop.put(k, nic.loop_args(ROUNDS_PER_NIC))
            if nic.wants_clock():
                self._clocked.add(k)

    def _start_turns(self, now: float) -> None:
        """The turn bookkeeping's start: no pass yet, the board not read yet."""
        self.turn_s, self._turn_at, self._turn_told = 0.0, now, 0.0
        #: When this process reads the board next (the first pass does), and the longest turn
        #: it read there last. A due time, not a difference of clock readings compared with the
        #: period, which rounding made miss the period by an ulp on some clock values.
        self._board_due, self._board_longest = -math.inf, 0.0
        #: Node processes of the cluster on this machine, as the board said last (this one
        #: alone until it is read).
        self._board_processes = 1

    def _note_turn(self, took: float, now: float) -> None:
        """A pass over the NICs took *took* seconds: a datagram for a NIC whose turn had passed
        waited that long. The NICs' timers cover the longest recent one, this process's or
        another's of the machine (TurnBoard)."""
        remembered = self.turn_s * 0.5 ** ((now - self._turn_at) / TURN_HALF_LIFE_S)
        self.turn_s, self._turn_at = max(took, remembered), now
        covered = self.turn_s
        if self.board is not None:
            self.board.publish(self.turn_s, now)  # one row: the others see it at once
            if now >= self._board_due:
                self._board_due = now + BOARD_PERIOD_S
                self._board_longest = self.board.longest(now, TURN_HALF_LIFE_S)
                self._board_processes = self.board.processes()
            covered = max(covered, self._board_longest)
        if abs(covered - self._turn_told) > TURN_CHANGE * self._turn_told:
            for nic in self.nics:
                nic.core.collective.set_host_turn(covered)
            self._turn_told = covered

    def warm_up(self) -> None:
        """Load the kernels once (the first NIC, made resident as a lone NIC's are); the other
        NICs' pages come with their first use, so each costs its memory and sockets only."""
        self.nics[0].warm_up(resident=True)
        for nic in self.nics[1:]:
            nic.serve_once(0)
        self._put_all()

    def ready_lines(self) -> str:
        """One ``ready`` line per NIC, in the order of the configs (the launcher reads them)."""
        return "\n".join(nic.ready_line() for nic in self.nics)

    def close(self) -> None:
        poll = getattr(self, "_poll", None)
        if poll is not None:
            poll.close()
        board = getattr(self, "board", None)
        if board is not None:
            board.close()
        for nic in self.nics:
            nic.close()


def spin_s(
    nics: int, clocked: bool, wait_ms: float, processes: int, cores: int, lingering: bool = False
) -> float:
    """Seconds a process hosting *nics* NICs polls without sleeping before it waits up to
    *wait_ms* for traffic (SPIN_S): only when it would sleep at all, only with at most
    SPIN_MAX_NICS NICs, and then either while a NIC's clock runs (a collective, held
    datagrams) and the cluster's node processes here (*processes*) are no more than the
    *cores*, or *lingering* (a clock ran within LINGER_S) and they are fewer: a core is left to
    the hosts."""
    if wait_ms <= 0 or nics > SPIN_MAX_NICS:
        return 0.0
    spins = (clocked and processes <= cores) or (lingering and processes < cores)
    return SPIN_S if spins else 0.0


def _raise_fd_limit(need: int) -> None:
    """Lift the soft limit of open files toward the hard one when *need* descriptors would
    exceed it (a process hosting 256 NICs holds ~770 sockets; many systems start at 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(configs: list[NodeProcessConfig]) -> int:
    """The life of a node process hosting *configs* (one NIC each)."""
    return serve_main(
        lambda: NicHost(configs),
        NicHost.ready_lines,
        any(c.die_with_parent for c in configs),
        configs[0].scheduling if configs else "batch",
    )
