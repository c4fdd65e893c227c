"""The switch process's hot loop: receive a batch (GRO), translate it, send the queue (GSO).

The same structure as ``serve._serve_nic`` (a node's loop): one compiled call runs up to
``max_rounds`` rounds and returns to Python for punted datagrams (control opcodes, PING),
queue growth, or when idle for ``timeout_ms``. Held datagrams (reorder/delay faults) are
released in later rounds even when nothing arrives.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels import signatures as S
from netdam.kernels.borrow import borrowed
from netdam.kernels.guard import G_NOW, check_guard
from netdam.kernels.serve import flush_sends  # one flush for node and switch
from netdam.kernels.state import (
    FCLOCK_NOW,
    TXQ_HEAD,
    TXQ_TAIL,
    RxBatch,
    ServeIO,
    SwitchState,
    TraceRing,
    TxQueue,
)
from netdam.kernels.switch_path import FS_HELD_RX, FS_HELD_TX, switch_round_kernel
from netdam.kernels.udp_io import ST_KERNEL_DROPS, clock_ns, recv_batch_kernel
from netdam.protocol import counters as C
from netdam.protocol.layout import TRACE_RECORD_BYTES

RETURN_IDLE = 0
RETURN_PUNT = 1
RETURN_ROUNDS = 2
RETURN_QUEUE = 3
#: A call returns to Python after this long (punts, the management port, map reloads).
CALL_BUDGET_NS = 5_000_000


def switch_serve(
    io: ServeIO,
    rx: RxBatch,
    room_per: int,
    st: SwitchState,
    tx: TxQueue,
    txq: np.ndarray,
    punt: np.ndarray,
) -> tuple[int, int]:
    """Checked entry to the switch's compiled loop; returns (reason, n_punt)."""
    room = 2 * io.max_n + st.faults.hold.len.shape[0]
    if min(rx.off.shape[0], rx.len.shape[0], rx.src.shape[0], punt.shape[0]) < room:
        raise ValueError(f"receive arrays need {room} entries (2 x max_n + held datagrams)")
    if not 0 < io.recv_bytes <= rx.buf.shape[0]:
        raise ValueError(f"recv_bytes {io.recv_bytes} outside the receive buffer")
    if txq.shape[0] != 2 or not 0 <= txq[TXQ_HEAD] <= txq[TXQ_TAIL] < tx.len.shape[0]:
        raise ValueError("send queue [head, tail] outside its slots")
    check_guard(st.guard)
    reason, n_punt = _switch_serve(io, rx, room_per, st, tx, txq, punt)
    return int(reason), int(n_punt)


@njit(cache=True, nogil=True)
def _switch_serve(io, rx, room_per, st, tx, txq, punt):
    """Returns (reason, n_punt); on RETURN_PUNT the punted datagrams are rx[punt[k]].
    *room_per*: send-queue entries one received datagram may need (fan-out x duplicates)."""
    # Borrowed for the call (netdam.kernels.borrow): no atomic reference counts below.
    io, rx, st, tx = borrowed(io), borrowed(rx), borrowed(st), borrowed(tx)
    txq, punt = borrowed(txq), borrowed(punt)
    fd, _mfd, _cfd, recv_bytes, max_n, max_len, timeout_ms, max_rounds, io_state, scratch = io
    rx_buf, rx_off, rx_len, rx_src = rx
    counters = st.ctrs.counters
    fclock, fstate, hold_len = st.faults.fclock, st.faults.fstate, st.faults.hold.len
    tx_buf, tx_off, tx_len, tx_dst, tx_slot = tx
    cap = tx_len.shape[0]
    # The switch keeps no trace (SPEC.md 6.7: a NIC's): a ring with no rows records nothing.
    no_trace = TraceRing(np.zeros((0, TRACE_RECORD_BYTES), np.uint8), np.zeros(1, np.int64))
    t0 = clock_ns()
    for _round in range(max_rounds):
        if not flush_sends(
            fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, no_trace, scratch, io_state
        ):
            if txq[TXQ_HEAD] > 0:
                return RETURN_QUEUE, 0
        tail = txq[TXQ_TAIL]
        room = room_per * max_n + hold_len.shape[0] + 1
        if tail + room > cap or tx_off[tail] + room * tx_slot > tx_buf.shape[0]:
            return RETURN_QUEUE, 0
        held = fstate[FS_HELD_RX] + fstate[FS_HELD_TX]
        # Later rounds wait briefly too: returning to Python on every quiet moment costs more
        # than the packets (the call still returns within ~CALL_BUDGET_NS for the control plane).
        wait = min(timeout_ms, 1) if (_round > 0 or held > 0) else timeout_ms
        if _round > 0 and clock_ns() - t0 > CALL_BUDGET_NS:
            break
        n = recv_batch_kernel(
            fd, rx_buf[:recv_bytes], rx_off, rx_len, rx_src, max_n, wait, io_state
        )
        counters[C.KERNEL_DROPS] = io_state[ST_KERNEL_DROPS]
        if n == 0 and held == 0:
            flush_sends(
                fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, no_trace, scratch, io_state
            )
            return RETURN_IDLE, 0
        fclock[FCLOCK_NOW] = clock_ns() * 1e-9
        st.guard.cfg[G_NOW] = fclock[FCLOCK_NOW]  # the lockout's clock
        tx_n, n_punt = switch_round_kernel(rx, n, max_len, st, tx, txq[TXQ_TAIL], punt)
        txq[TXQ_TAIL] = tx_n
        if n_punt > 0:
            flush_sends(
                fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, no_trace, scratch, io_state
            )
            return RETURN_PUNT, n_punt
        if n == 0:
            flush_sends(
                fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, no_trace, scratch, io_state
            )
            return RETURN_IDLE, 0
    flush_sends(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, no_trace, scratch, io_state)
    return RETURN_ROUNDS, 0


# The explicit signature (kernels/signatures.py), compiled (or loaded from the cache) here, at
# the end of the module where every kernel it calls exists; no other signature compiles.
_switch_serve.compile(S.SWITCH_SERVE)
_switch_serve.disable_compile()
