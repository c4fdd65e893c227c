"""The node process's hot loop: receive a batch (GRO), execute it, send the queue (GSO), repeat.

One compiled call runs up to ``max_rounds`` rounds without touching Python, then returns so
the control plane can handle punted packets, signals and stats. It never blocks longer than
``timeout_ms`` waiting for traffic, so the control plane runs at least that often (and every
few milliseconds under full load: a round is at most ``max_n`` datagrams).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
from numba import njit
from numba.core.errors import TypingError
from numba.typed import List

from netdam.kernels import signatures as S
from netdam.kernels.borrow import borrowed
from netdam.kernels.collective import (
    MAX_COLLECTIVES,
    any_slot,
    coll_ticks,
    early_count,
    hold_early_chains,
)
from netdam.kernels.datapath import process_batch_kernel
from netdam.kernels.faults import apply_faults
from netdam.kernels.guard import G_NOW, check_guard
from netdam.kernels.restart import drop_ended_keys
from netdam.kernels.state import (
    FC_ACTIVE,
    FC_GEN,
    FC_NOW,
    TXQ_HEAD,
    TXQ_TAIL,
    FaultState,
    Guard,
    NodeState,
    RxBatch,
    ServeIO,
    TxQueue,
)
from netdam.kernels.trace import K_RX, K_TX, N_DROPS, drop_marks, note_datagram, note_drops
from netdam.kernels.udp_io import (
    POLLIN,
    ST_KERNEL_DROPS,
    ST_RECV_FULL,
    ST_RX_DATAGRAMS,
    ST_SEND_DROPPED,
    ST_TX_DATAGRAMS,
    clock_ns,
    pollfd,
    recv_batch_kernel,
    revents,
    send_batch_kernel,
    sys_poll,
)
from netdam.protocol import counters as C

#: Why a NIC's visit (_serve_nic) ended.
RETURN_IDLE = 0  # nothing arrived within timeout_ms
RETURN_PUNT = 1  # punted datagrams wait in the receive buffer for the control plane
RETURN_ROUNDS = 2  # ran max_rounds rounds, or management traffic came: the control plane's turn
RETURN_QUEUE = 3  # the send queue needs compaction or growth (Python's job)
RETURN_BAD_QUEUE = 4  # _serve_nics: the NIC's send queue ends lay outside its slots (not served)

#: While a visit stays busy (every round takes datagrams, so it never waits on a poll that
#: includes the management socket), it looks at that socket once per this many nanoseconds: a
#: stats request under a flood is answered within about a millisecond of busy time, not after
#: the call's max_rounds rounds (32 rounds of 64 datagrams: ~10 ms here, and several times that
#: on a loaded machine: CI saw one reply take 123 ms). One zero-timeout poll(2) per millisecond.
CONTROL_LOOK_NS = 1_000_000
#: The columns of _serve_nics's report, a row per NIC (OUT_SWEPT: visited by a sweep after the
#: call's first, _serve_nics).
OUT_REASON, OUT_PUNT, OUT_CLOCK, OUT_SWEPT = 0, 1, 2, 3
OUT_COLUMNS = 4
#: The sockets a visit's round does not read (_serve_nic): found empty by a wait, or drained by
#: the round before.
SKIP_DATA, SKIP_GROUP = 1, 2
#: Sweeps of a _serve_nics call after its first (each: one poll of the visited NICs' sockets,
#: then a visit of each with datagrams waiting), and the largest process that makes them (past
#: it, a pass has traffic queued for most NICs, and one poll of all their sockets is the
#: process's epoll again).
MAX_SWEEPS = 8
SWEEP_MAX_NICS = 8
#: ...and only while a sweep moves few datagrams (taken plus sent): a hop of a small
#: collective, not a stream, whose batches grow while Python runs between passes (4 x 1 MiB,
#: sweeping whatever moved, took 5.3-6.5 ms a call against 4.4-5.9 ms; docs/PERFORMANCE.md).
SWEEP_MAX_DATAGRAMS = 32


@njit(cache=True, nogil=True)
def flush_sends(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, trace, scratch, io_state):
    """Send the pending queue; account for what left (and trace it: a TX record each, one
    clock reading per flush). Returns True when everything went."""
    head = txq[TXQ_HEAD]
    tail = txq[TXQ_TAIL]
    if tail <= head:
        return True
    # Read before sending: a receiver on the other core may take the first datagram before
    # the send call returns, and a hop's TX record must not come after its next hop's RX.
    t_ns = clock_ns() if trace.rec.shape[0] != 0 else 0
    sent = send_batch_kernel(
        fd,
        tx_buf,
        tx_off[head:tail],
        tx_len[head:tail],
        tx_dst[head:tail],
        tail - head,
        scratch,
        io_state,
    )
    for k in range(head, head + sent):
        counters[C.TX_PACKETS] += 1
        counters[C.TX_BYTES] += tx_len[k]
        note_datagram(
            trace, t_ns, K_TX, tx_buf[tx_off[k] : tx_off[k] + tx_len[k]], tx_len[k], tx_dst[k]
        )
    counters[C.SEND_DROPS] = io_state[ST_SEND_DROPPED]  # of those, refused by the kernel
    txq[TXQ_HEAD] = head + sent
    if txq[TXQ_HEAD] == tail:
        txq[TXQ_HEAD] = 0
        txq[TXQ_TAIL] = 0
        tx_off[0] = 0
        return True
    return False


@njit(cache=True, nogil=True)
def _wait_any(fd, mfd, cfd, timeout_ms):
    """poll(2) the data, group and management sockets; bit 1/2/4 set for each one readable."""
    pfd = np.zeros(3, np.int64)
    fds = (fd, mfd, cfd)
    for k in range(3):
        pfd[k] = pollfd(fds[k], POLLIN)  # mfd -1: ignored
    if sys_poll(pfd.ctypes.data, 3, timeout_ms) <= 0:
        return 0
    ready = 0
    for k in range(3):
        if revents(pfd[k]):
            ready |= 1 << k
    return ready


def _check(
    io: ServeIO,
    rx: RxBatch,
    faults: FaultState,
    guard: Guard,
    tx: TxQueue,
    txq: np.ndarray,
    punt: np.ndarray,
) -> None:
    """What the compiled loop takes on trust of a NIC's arguments (numba checks no bounds):
    room for a round's datagrams, the receive size, the send queue's ends, the guard."""
    room = 2 * io.max_n + faults.hold.len.shape[0]
    if min(rx.off.shape[0], rx.len.shape[0], rx.src.shape[0], punt.shape[0]) < room:
        raise ValueError(f"receive arrays need {room} entries (2 x max_n + held datagrams)")
    if not 0 < io.recv_bytes <= rx.buf.shape[0]:
        raise ValueError(f"recv_bytes {io.recv_bytes} outside the receive buffer")
    if txq.shape[0] != 2 or not 0 <= txq[TXQ_HEAD] <= txq[TXQ_TAIL] < tx.len.shape[0]:
        raise ValueError("send queue [head, tail] outside its slots")
    check_guard(guard)


#: A NIC's serve arguments, in order (NodeProcess.serve_args).
ServeArgs = tuple[ServeIO, RxBatch, FaultState, NodeState, Guard, TxQueue, np.ndarray, np.ndarray]


#: One NIC's entry in a NicLoop: (io, faults, node, guard, tx, txq).
NicEntry = tuple[ServeIO, FaultState, NodeState, Guard, TxQueue, np.ndarray]


class NicLoop:
    """The NICs of one process, served by one compiled call per pass (_serve_nics) instead of
    one per NIC: each visit saves the ~8 us of Python a NIC's serve call costs around it.

    Each NIC's arguments are checked (_check) when they are set (``put``), against the
    receive batch and punt list the loop shares; the compiled loop checks each
    send queue's ends before each visit (they move). The owner puts a NIC's arguments again
    whenever Python did anything for it (a punt, the management port, an event, the send
    queue's room): the arrays a bundle holds are only ever replaced there, and ``put`` of the
    same objects costs an identity check."""

    def __init__(self, rx: RxBatch, punt: np.ndarray) -> None:
        self.rx, self.punt = rx, punt
        self._nics = _new_nic_list()
        self._entries: list[NicEntry] = []
        self._entry: Callable[..., int] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, k: int, args: ServeArgs) -> None:
        """NIC *k*'s serve arguments (k: the next NIC, or one already put)."""
        io, rx, faults, node, guard, tx, txq, punt = args
        if not 0 <= k <= len(self._entries):
            raise ValueError(f"NIC {k} of a loop of {len(self._entries)}")
        if punt is not self.punt or not all(map(operator.is_, rx, self.rx)):
            raise ValueError("a NIC of the loop receives into the loop's shared batch")
        entry: NicEntry = (io, faults, node, guard, tx, txq)
        if k < len(self._entries) and all(map(operator.is_, entry, self._entries[k])):
            return  # checked when put; the queue's ends, which move, at every visit
        _check(io, self.rx, faults, guard, tx, txq, self.punt)
        try:
            _put_nic(self._nics, k, entry)  # the dispatcher types it; the list refuses a mismatch
        except (TypeError, NotImplementedError, TypingError) as exc:
            raise TypeError(
                f"NIC {k}'s serve arguments are not of the types the loop was compiled for "
                f"(netdam.kernels.signatures.NIC_ENTRY): {type(exc).__name__}"
            ) from None
        if k == len(self._entries):
            self._entries.append(entry)
        else:
            self._entries[k] = entry

    def serve(self, order: np.ndarray, start: int, out: np.ndarray) -> int:
        """Visit NICs ``order[start:]`` (see _serve_nics); returns the position to go on from."""
        n = len(self._entries)
        if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] < n or out.shape[1] < OUT_COLUMNS:
            raise ValueError(f"the report needs {n} rows of {OUT_COLUMNS} int64")
        if order.dtype != np.int64 or order.ndim != 1 or not 0 <= start <= order.shape[0]:
            raise ValueError("order: NIC indices (int64), start within them")
        if not (order.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("order and the report: C-contiguous arrays, the report writable")
        entry = self._entry
        if entry is None:
            # The first call goes through numba's dispatcher, which types the list, the batch
            # and the punt list (and refuses any that do not match the one compiled signature).
            # They stay the same objects for the loop's life, and order and the report were
            # checked above, so later calls go straight to that signature's entry point: the
            # dispatcher's typing costs ~7 us a call, every pass of a busy process.
            position = _serve_nics(self._nics, self.rx, self.punt, order, start, out)
            (compiled,) = _serve_nics.overloads.values()
            self._entry = compiled.entry_point
        else:
            position = entry(self._nics, self.rx, self.punt, order, start, out)
        if position < 0:
            raise ValueError(f"order names a NIC outside the loop's {n}: {order[-1 - position]}")
        if position and out[order[position - 1], OUT_REASON] == RETURN_BAD_QUEUE:
            raise ValueError(
                f"NIC {order[position - 1]}: send queue [head, tail] outside its slots"
            )
        return int(position)


@njit(cache=True)
def _new_nic_list():
    return List.empty_list(S.NIC_ENTRY)


@njit(cache=True)
def _put_nic(nics, k, entry):
    if k == len(nics):
        nics.append(entry)
    else:
        nics[k] = entry


@njit(cache=True, nogil=True)
def _serve_nics(nics, rx, punt, order, start, out):
    """Visit the NICs ``order[start:]`` of one process in turn, each as one serve call with no
    time to wait (``nics[k]``: NIC k's (io, faults, node, guard, tx, txq); the receive batch and
    the punt list are shared, as each visit ends before the next begins). Row k of *out* says
    why NIC k's visit ended, how many datagrams it punted, whether its clock must run (a
    collective, a repeated DONE owed, sends waiting, datagrams held by fault injection) and
    whether a collective ended there. Returns the position after the last NIC visited: the
    end of *order*, or a NIC the control plane must see before any other is served (its punted
    datagrams are in the shared batch; its send queue needs room; its queue's ends were bad);
    -1 - i when order[i] names no NIC of the list.

    A call from the start of *order* in which a few datagrams moved (at most
    SWEEP_MAX_DATAGRAMS) then sweeps again (up to
    MAX_SWEEPS times, in a process of 2 to SWEEP_MAX_NICS NICs): one poll(2) of every NIC's
    data and group sockets, and a visit of each with datagrams waiting, reading only those
    sockets; its row's OUT_SWEPT says so (a NIC not in *order* too: its control plane runs
    after the call like theirs). A hop between two NICs of the process, or an answer from another process
    that came meanwhile, is then taken in the same call, where it waited for the next pass:
    the process's epoll and its Python between passes (~6 us, and the visits of every NIC
    whose clock runs). A sweep's visit the control plane must see (a punt, a send queue that
    needs room) ends the call; a NIC whose send queue's ends are bad is left to the next pass,
    which reports it."""
    rx, punt = borrowed(rx), borrowed(punt)
    n_order = order.shape[0]
    if start == 0:
        for k in range(len(nics)):
            out[k, OUT_SWEPT] = 0  # no sweep yet in this call
    moved = 0  # datagrams taken and sent by this call's visits
    for i in range(start, n_order):
        k = order[i]
        if not 0 <= k < len(nics):
            return -1 - i  # the wrapper raises, naming order[i]
        reason, moved_here = _visit(nics, rx, punt, k, out, 0)
        moved += moved_here
        if reason == RETURN_BAD_QUEUE or reason == RETURN_PUNT or reason == RETURN_QUEUE:
            return i + 1
    if start != 0 or not 2 <= len(nics) <= SWEEP_MAX_NICS:
        return n_order  # a lone NIC's visit waits for traffic itself (its timeout_ms)
    if moved == 0:
        return n_order
    n = len(nics)
    pfd = np.zeros(2 * n, np.int64)
    for _sweep in range(MAX_SWEEPS):
        if moved > SWEEP_MAX_DATAGRAMS:
            break  # traffic, not a latency-bound hop: batches grow while Python runs
        moved = 0
        for k in range(n):
            io = nics[k][0]
            pfd[2 * k] = pollfd(io.fd, POLLIN)
            pfd[2 * k + 1] = pollfd(io.mfd, POLLIN)  # -1: ignored
        if sys_poll(pfd.ctypes.data, 2 * n, 0) <= 0:
            break
        for k in range(n):
            data = revents(pfd[2 * k]) & POLLIN
            group = revents(pfd[2 * k + 1]) & POLLIN
            if data == 0 and group == 0:
                continue
            skip = (0 if data else SKIP_DATA) | (0 if group else SKIP_GROUP)
            reason, moved_here = _visit(nics, rx, punt, k, out, skip)
            moved += moved_here
            if reason != RETURN_BAD_QUEUE:
                out[k, OUT_SWEPT] = 1
            if reason == RETURN_PUNT or reason == RETURN_QUEUE:
                return n_order  # every NIC of order was visited: the control plane's turn
    return n_order


@njit(cache=True, nogil=True, inline="always")
def _visit(nics, rx, punt, k, out, skip):
    """NIC k's visit (_serve_nic, *skip* its first round's SKIP_ bits), its row of *out*
    written; returns (reason, datagrams taken and sent). RETURN_BAD_QUEUE: not served."""
    io, faults, node, guard, tx, txq = nics[k]
    if not 0 <= txq[TXQ_HEAD] <= txq[TXQ_TAIL] < tx.len.shape[0]:
        out[k, OUT_REASON] = RETURN_BAD_QUEUE
        return RETURN_BAD_QUEUE, np.int64(0)
    io_state = io.io_state
    before = io_state[ST_RX_DATAGRAMS] + io_state[ST_TX_DATAGRAMS]
    reason, n_punt = _serve_nic(
        borrowed(io),
        rx,
        borrowed(faults),
        borrowed(node),
        borrowed(guard),
        borrowed(tx),
        borrowed(txq),
        punt,
        skip,
    )
    out[k, OUT_REASON] = reason
    out[k, OUT_PUNT] = n_punt
    out[k, OUT_CLOCK] = (
        any_slot(node.coll, False)
        or txq[TXQ_TAIL] > txq[TXQ_HEAD]
        or _any_held(faults.hold.len)  # fault injection's, or early chains
    )
    return reason, io_state[ST_RX_DATAGRAMS] + io_state[ST_TX_DATAGRAMS] - before


@njit(cache=True, nogil=True)
def _any_held(hold_len):
    for k in range(hold_len.shape[0]):
        if hold_len[k] != 0:
            return True
    return False


# Inlined into its one caller, _serve_nics, by numba (not compiled on its own): each compiled
# function is optimized by LLVM with everything linked into it, so this loop and the datapath
# under it were optimized twice (12.7 s of a cold compile; docs/PERFORMANCE.md).
@njit(cache=True, nogil=True, inline="always")
def _serve_nic(io, rx, faults, node, guard, tx, txq, punt, skip):
    """Returns (reason, n_punt). On RETURN_PUNT the punted datagrams are rx[punt[k]].
    *mfd* is the socket of the joined multicast group (-1: none); *cfd* the management socket:
    control traffic there ends the call: at once while it waits, and within CONTROL_LOOK_NS while
    it stays busy, so stats never wait for a call's rounds.

    A round reads a socket only when it may hold datagrams: the first round reads both unless
    *skip* (SKIP_DATA, SKIP_GROUP) names those the caller's own poll just found empty (a
    datagram may have come since a poll of the process's epoll: a hop from a NIC visited just
    before), a wait reads those it found readable, and after a round that took datagrams only a socket
    whose batch came back full is read again at once; the others wait for the next wait or
    visit. A receive that finds nothing is a system call all the same: 4 x 4 KiB all-reduces
    made ~80 per call, two thirds of them empty (docs/PERFORMANCE.md).

    Stays in the compiled loop while traffic comes within *timeout_ms* of the call's start (up
    to *max_rounds* rounds): a round that found nothing waits for the next datagram (at most
    1 ms while a collective runs, for its clock), so a node forwarding a chain never passes
    through Python between packets (each return cost ~50-100 us of Python and numba dispatch
    per wake-up). When fault injection holds datagrams aside, a quiet round still releases
    those that are due; the fault clock (faults.cfg[FC_NOW]) follows CLOCK_MONOTONIC every round."""
    fd, mfd, cfd, recv_bytes, max_n, max_len, timeout_ms, max_rounds, io_state, scratch = io
    rx_buf, rx_off, rx_len, rx_src = rx
    fault_cfg = faults.cfg
    hold_len = faults.hold.len
    mem, regions, members, window, coll, counters, trace = node
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    cap = tx_len.shape[0]
    marks = np.zeros(N_DROPS, np.uint64)  # the drop counters before each batch (its trace)
    start_ns = clock_ns()
    budget_ns = np.int64(timeout_ms) * 1_000_000
    look_ns = start_ns + CONTROL_LOOK_NS  # the management socket's next look while busy
    got = 0  # datagrams the last round took: more may be queued, drain before waiting
    early = early_count(faults.hold) > 0  # chains held until their collective starts here
    for _round in range(max_rounds):
        # The keys of collectives that ended here go one round after their end.
        drop_ended_keys(regions, coll)
        if fault_cfg[FC_ACTIVE] != 0.0:
            fault_cfg[FC_NOW] = clock_ns() * 1e-9  # time.monotonic(): what the held datagrams use
        if any_slot(coll, False):
            # The collective engine's clock runs every round (and answers late DONE requests),
            # each slot first in turn (by the microsecond: calls of a few rounds start alike).
            now_ns = clock_ns()
            tx_n = coll_ticks(
                now_ns * 1e-9,
                coll,
                mem,
                counters,
                trace,
                tx,
                txq[TXQ_TAIL],
                (now_ns // 1000) % MAX_COLLECTIVES,
            )
            txq[TXQ_TAIL] = tx_n
        if not flush_sends(
            fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, trace, scratch, io_state
        ):
            if txq[TXQ_HEAD] > 0:
                return RETURN_QUEUE, 0  # partial send: compact before receiving more
        tail = txq[TXQ_TAIL]
        room = 2 * max_n + hold_len.shape[0] + 1  # duplicates and released datagrams too
        if tail + room > cap or tx_off[tail] + room * tx_slot > tx_buf.shape[0]:
            return RETURN_QUEUE, 0
        # The first recv_bytes of rx_buf take GRO runs; the rest is room for released copies.
        # Wait for traffic while the call's time lasts, briefly while a collective runs.
        wait = 0
        ready = 0
        if got != 0:
            now_ns = clock_ns()
            if cfd >= 0 and now_ns >= look_ns:
                look_ns = now_ns + CONTROL_LOOK_NS
                ready = _wait_any(-1, -1, cfd, 0)
        else:
            left_ms = (budget_ns - (clock_ns() - start_ns)) // 1_000_000
            if _round > 0 and left_ms <= 0:
                break  # the call's time is up: the control plane's turn
            wait = min(left_ms, 1) if early or any_slot(coll, True) else left_ms
        if wait > 0:
            ready = _wait_any(fd, mfd, cfd, wait)
            skip = (0 if ready & 1 else SKIP_DATA) | (0 if ready & 2 else SKIP_GROUP)
        if ready & 4:
            break  # management traffic: the control plane's turn
        n = 0
        drained = SKIP_DATA | SKIP_GROUP  # what this round's receives left empty
        # With a group joined, half the receive runs for the data socket, half for the group's.
        half = recv_bytes if mfd < 0 else recv_bytes // 2
        if not skip & SKIP_DATA:
            n = recv_batch_kernel(
                fd,
                rx_buf[:half],
                rx_off,
                rx_len,
                rx_src,
                max_n if mfd < 0 else max_n // 2,
                0,
                io_state,
            )
            if io_state[ST_RECV_FULL]:
                drained &= ~SKIP_DATA
        if mfd >= 0 and not skip & SKIP_GROUP:
            m = recv_batch_kernel(
                mfd,
                rx_buf[half:recv_bytes],
                rx_off[n:],
                rx_len[n:],
                rx_src[n:],
                max_n - n,
                0,
                io_state,
            )
            if io_state[ST_RECV_FULL]:
                drained &= ~SKIP_GROUP
            for k in range(n, n + m):
                rx_off[k] += half
            n += m
        skip = drained
        drop_marks(trace, counters, marks)
        counters[C.KERNEL_DROPS] = io_state[ST_KERNEL_DROPS]
        if fault_cfg[FC_ACTIVE] != 0.0:
            n = apply_faults(rx, n, faults, counters)
            fault_cfg[FC_GEN] += 1.0  # batch generation: held datagrams wait at least one batch
        got = n
        now_ns = clock_ns()  # the lockout clock and the trace's: one reading per batch
        if trace.rec.shape[0] != 0:
            for k in range(n):
                note_datagram(
                    trace,
                    now_ns,
                    K_RX,
                    rx_buf[rx_off[k] : rx_off[k] + rx_len[k]],
                    rx_len[k],
                    rx_src[k],
                )
        # Chains early for a collective not started here wait aside; those whose collective
        # started since (a START_COLL the control plane took) come back into this batch.
        if n > 0 or early:
            n, held = hold_early_chains(
                rx, n, recv_bytes, members, coll, faults.hold, now_ns * 1e-9
            )
            early = held > 0
        if n == 0:
            note_drops(trace, now_ns, counters, marks)
            if budget_ns == 0:
                break  # a call with no time to wait: one look only
            continue
        guard.cfg[G_NOW] = now_ns * 1e-9
        tx_n, n_punt = process_batch_kernel(rx, n, max_len, node, guard, tx, txq[TXQ_TAIL], punt)
        txq[TXQ_TAIL] = tx_n
        note_drops(trace, now_ns, counters, marks)
        if n_punt > 0:
            flush_sends(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, trace, scratch, io_state)
            return RETURN_PUNT, n_punt
    flush_sends(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, trace, scratch, io_state)
    return (RETURN_ROUNDS if got else RETURN_IDLE), 0


# The explicit signatures (kernels/signatures.py), compiled (or loaded from the cache) here, at
# the end of the module where every kernel they call exists; no other signature compiles. The
# engine's clock first: this loop is its only caller, and a second process may have compiled
# it meanwhile, while this one compiled the datapath (netdam.cluster.launch.ASIDE_KERNELS).
coll_ticks.compile(S.COLL_TICKS)
coll_ticks.disable_compile()
_serve_nics.compile(S.SERVE_NICS)
_serve_nics.disable_compile()
# The typed list's helpers too: compiled lazily, each node process compiled them at its first
# serve call (~1.5 s of CPU, after it said it was ready), and on a loaded machine a collective's
# watchdog took two such nodes for dead (CI, `netdam allreduce --nodes 2`).
_new_nic_list.compile(())
_new_nic_list.disable_compile()
_put_nic.compile(S.PUT_NIC)
_put_nic.disable_compile()
