"""The switch process's hot loop: receive a batch (GRO), translate it, send the queue (GSO).

The same structure as ``serve._serve`` (the node's loop): one compiled call runs up to
``max_rounds`` rounds and returns to Python for punted datagrams (control opcodes, PING),
queue growth, or when idle for ``timeout_ms``. Held datagrams (reorder/delay faults) are
released in later rounds even when nothing arrives.
"""

from __future__ import annotations

from numba import njit

from netdam.kernels.datapath import _SLOT
from netdam.kernels.serve import _flush  # one flush for node and switch
from netdam.kernels.switch_path import FS_HELD_RX, FS_HELD_TX, _switch_round
from netdam.kernels.udp_io import ST_KERNEL_DROPS, _now_ns, _recv_batch
from netdam.protocol import counters as C

RETURN_IDLE = 0
RETURN_PUNT = 1
RETURN_ROUNDS = 2
RETURN_QUEUE = 3
#: A call returns to Python after this long (punts, the management port, map reloads).
CALL_BUDGET_NS = 5_000_000


@njit(cache=True, nogil=True)
def _switch_serve(  # type: ignore[no-untyped-def]
    fd, rx_buf, recv_bytes, rx_off, rx_len, rx_src, max_n, max_len, timeout_ms, io_state, max_rounds,
    room_per, cfg, nodes_ep, node_sorted, node_port,
    reg_base, reg_end, reg_rkey, reg_rights, reg_stride, reg_ways, reg_way0, way_node, way_local,
    grp_key, grp_first, grp_count, grp_member,
    counters, sw, port_ctr, reg_ctr,
    fcfg, fkeys, fclock, fstate, ftab_key, ftab_count, kctr,
    hold_buf, hold_len, hold_ep, hold_dir, hold_time, hold_gen,
    tx_buf, tx_off, tx_len, tx_dst, txq, punt, scratch,
):  # fmt: skip
    """Returns (reason, n_punt); on RETURN_PUNT the punted datagrams are rx[punt[k]].
    *room_per*: send-queue entries one received datagram may need (fan-out x duplicates)."""
    cap = tx_len.shape[0]
    t0 = _now_ns()
    for _round in range(max_rounds):
        if not _flush(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, scratch, io_state):
            if txq[0] > 0:
                return RETURN_QUEUE, 0
        tail = txq[1]
        room = room_per * max_n + hold_len.shape[0] + 1
        if tail + room > cap or tx_off[tail] + room * _SLOT > tx_buf.shape[0]:
            return RETURN_QUEUE, 0
        held = fstate[FS_HELD_RX] + fstate[FS_HELD_TX]
        # Later rounds wait briefly too: returning to Python on every quiet moment costs more
        # than the packets (the call still returns within ~CALL_BUDGET_NS for the control plane).
        wait = min(timeout_ms, 1) if (_round > 0 or held > 0) else timeout_ms
        if _round > 0 and _now_ns() - t0 > CALL_BUDGET_NS:
            break
        n = _recv_batch(fd, rx_buf[:recv_bytes], rx_off, rx_len, rx_src, max_n, wait, io_state)
        counters[C.KERNEL_DROPS] = io_state[ST_KERNEL_DROPS]
        if n == 0 and held == 0:
            _flush(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, scratch, io_state)
            return RETURN_IDLE, 0
        fclock[0] = _now_ns() * 1e-9
        tx_n, n_punt = _switch_round(
            rx_buf, rx_off, rx_len, rx_src, n, max_len,
            cfg, nodes_ep, node_sorted, node_port,
            reg_base, reg_end, reg_rkey, reg_rights, reg_stride, reg_ways, reg_way0, way_node, way_local,
            grp_key, grp_first, grp_count, grp_member,
            counters, sw, port_ctr, reg_ctr,
            fcfg, fkeys, fclock, fstate, ftab_key, ftab_count, kctr,
            hold_buf, hold_len, hold_ep, hold_dir, hold_time, hold_gen,
            tx_buf, tx_off, tx_len, tx_dst, txq[1], punt,
        )  # fmt: skip
        txq[1] = tx_n
        if n_punt > 0:
            _flush(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, scratch, io_state)
            return RETURN_PUNT, n_punt
        if n == 0:
            _flush(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, scratch, io_state)
            return RETURN_IDLE, 0
    _flush(fd, tx_buf, tx_off, tx_len, tx_dst, txq, counters, scratch, io_state)
    return RETURN_ROUNDS, 0
