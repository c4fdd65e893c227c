"""Explicit numba signatures of the hot kernels (pynndescent's habit): the serve loops, the
datapath batch, the engine's clock and the switch round are compiled for exactly these types,
at import (or loaded from the cache), and a caller passing anything else gets numba's TypeError
at once instead of a silent second compilation.

The bundle types are numba's own typing of example bundles with the dtypes their owners
allocate (NodeCore, SwitchCore, the shells' serve buffers); every array is 1-D C-contiguous
unless its owner makes it 2-D or 3-D.
"""

from __future__ import annotations

import numpy as np
from numba import typeof, types

from netdam.kernels.state import (
    CollSlots,
    DupWindow,
    FaultState,
    Groups,
    Guard,
    HoldTable,
    LinkFaults,
    NodeState,
    Regions,
    RegionTable,
    RxBatch,
    ServeIO,
    SwitchCounters,
    SwitchPorts,
    SwitchState,
    Tenants,
    TraceRing,
    TxQueue,
)


def _a(dtype: type, ndim: int = 1) -> np.ndarray:
    return np.zeros((0,) * ndim, dtype)


u8, u32, u64, i32, i64, f64 = np.uint8, np.uint32, np.uint64, np.int32, np.int64, np.float64

RX_BATCH = typeof(RxBatch(_a(u8), _a(i64), _a(i32), _a(u64)))
TX_QUEUE = typeof(TxQueue(_a(u8), _a(i64), _a(i32), _a(u64), 0))
GUARD = Guard(_a(f64), _a(u64), _a(u64), _a(f64), _a(f64), _a(f64), _a(f64), _a(i64), _a(f64))
#: The node's guard travels beside NodeState, not in it: every per-datagram call passes the node
#: tuple, and each array in it costs a reference count.
GUARD_STATE = typeof(GUARD)
COLL_SLOTS = typeof(
    CollSlots(
        _a(i64, 2),
        _a(u8, 2),
        _a(u8, 2),
        _a(f64, 2),
        _a(u64, 2),
        _a(i64, 2),
        _a(i64, 2),
        _a(f64, 2),
        _a(u8, 2),
        _a(u8, 2),
    )
)
#: The node's trace ring (in NodeState, and beside the slots for the engine's clock).
TRACE = TraceRing(_a(u8, 2), _a(i64))
NODE_STATE = typeof(
    NodeState(
        _a(u8),
        Regions(_a(u32), _a(i64), _a(i64), _a(u8), _a(u64, 2)),
        _a(u64),
        DupWindow(_a(u64), _a(u32), _a(u32), _a(i64), _a(u32, 2), _a(u8, 2), _a(i32, 2), _a(u8, 3)),
        CollSlots(
            _a(i64, 2),
            _a(u8, 2),
            _a(u8, 2),
            _a(f64, 2),
            _a(u64, 2),
            _a(i64, 2),
            _a(i64, 2),
            _a(f64, 2),
            _a(u8, 2),
            _a(u8, 2),
        ),
        _a(u64),
        TRACE,
    )
)
TRACE_RING = typeof(TRACE)
HOLD_TABLE = HoldTable(_a(u8, 2), _a(i32), _a(u64), _a(i64), _a(f64), _a(i64))
FAULT_STATE = typeof(FaultState(_a(f64), _a(u64), _a(u64), _a(u32), HOLD_TABLE))
SERVE_IO = typeof(ServeIO(0, 0, 0, 0, 0, 0, 0, 0, _a(i64), _a(i64)))
SWITCH_STATE = typeof(
    SwitchState(
        SwitchPorts(_a(u64), _a(u64), _a(u64), _a(i64)),
        RegionTable(
            _a(u64),
            _a(u64),
            _a(i64),
            _a(i64),
            _a(i64),
            _a(i64),
            _a(i64),
            _a(i64),
            _a(i64),
            _a(u64, 2),
        ),
        Groups(_a(u64), _a(i64), _a(i64), _a(u64)),
        SwitchCounters(_a(u64), _a(u64), _a(u64, 2), _a(u64, 2)),
        LinkFaults(_a(f64, 3), _a(u64), _a(f64), _a(i64), _a(u64), _a(u32), _a(i64, 3), HOLD_TABLE),
        GUARD,
        Tenants(_a(u32), _a(u64, 2)),
    )
)
PUNT = typeof(_a(i32))
TXQ = typeof(_a(i64))
COUNTERS = typeof(_a(u64))
MEMORY = typeof(_a(u8))

#: process_batch_kernel(rx, n, max_len, node, guard, tx, tx_n, punt)
PROCESS_BATCH = (
    RX_BATCH,
    types.int64,
    types.int64,
    NODE_STATE,
    GUARD_STATE,
    TX_QUEUE,
    types.int64,
    PUNT,
)
#: One NIC's serve arguments, as the NICs of a process are listed for _serve_nics: (io, faults,
#: node, guard, tx, txq); the receive batch and the punt list are the loop's.
NIC_ENTRY = types.Tuple((SERVE_IO, FAULT_STATE, NODE_STATE, GUARD_STATE, TX_QUEUE, TXQ))
#: _put_nic(nics, k, entry)
PUT_NIC = (types.ListType(NIC_ENTRY), types.int64, NIC_ENTRY)
#: _serve_nics(nics, rx, punt, order, start, out)
SERVE_NICS = (
    types.ListType(NIC_ENTRY),
    RX_BATCH,
    PUNT,
    types.Array(types.int64, 1, "C"),
    types.int64,
    types.Array(types.int64, 2, "C"),
)
#: coll_ticks(now, slots, mem, counters, trace, tx, tx_n, first)
COLL_TICKS = (
    types.float64,
    COLL_SLOTS,
    MEMORY,
    COUNTERS,
    TRACE_RING,
    TX_QUEUE,
    types.int64,
    types.int64,
)
#: switch_round_kernel(rx, n, max_len, st, tx, tx_n, punt)
SWITCH_ROUND = (RX_BATCH, types.int64, types.int64, SWITCH_STATE, TX_QUEUE, types.int64, PUNT)
#: _switch_serve(io, rx, room_per, st, tx, txq, punt)
SWITCH_SERVE = (SERVE_IO, RX_BATCH, types.int64, SWITCH_STATE, TX_QUEUE, TXQ, PUNT)
