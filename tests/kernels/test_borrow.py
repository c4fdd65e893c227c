"""Borrowed bundles (netdam.kernels.borrow): the same memory, no reference taken or dropped."""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from netdam.kernels.borrow import borrowed
from netdam.kernels.state import RxBatch, TraceRing


@njit(cache=False)
def _write_through(rx, trace):
    rx, trace = borrowed(rx), borrowed(trace)
    buf, off, ln, src = rx
    total = 0
    for k in range(ln.shape[0]):
        buf[off[k]] = np.uint8(k + 1)  # writes land in the caller's arrays
        total += src[k]
    view = buf[1:5]  # a view of a borrowed array is borrowed too
    view[0] += np.uint8(100)
    trace.cursor[0] += 1
    scratch = np.zeros(4, np.int64)  # allocated here: counted as ever
    scratch[0] = total
    return scratch.sum() + trace.rec.shape[0] * 1000 + trace.rec[1, 2]


@njit(cache=False)
def _strided(a):
    a = borrowed(a)
    return a[0] * 100 + a[1] * 10 + a[2]


def test_borrowed_bundles_share_the_callers_memory_and_keep_its_counts() -> None:
    buf = np.zeros(16, np.uint8)
    off = np.array([0, 3, 8], np.int64)
    ln = np.ones(3, np.int32)
    src = np.array([5, 6, 7], np.uint64)
    rec = np.zeros((2, 4), np.uint8)
    rec[1, 2] = 9
    cursor = np.zeros(1, np.int64)
    rx, trace = RxBatch(buf, off, ln, src), TraceRing(rec, cursor)
    arrays = (buf, off, ln, src, rec, cursor)
    before = [sys.getrefcount(a) for a in arrays]
    for _ in range(1000):
        result = _write_through(rx, trace)
    assert result == 18 + 2 * 1000 + 9
    assert buf[0] == 1 and buf[3] == 2 and buf[8] == 3
    assert buf[1] == (100 * 1000) % 256  # through the view, once per call
    assert cursor[0] == 1000
    # A borrowed array taking or dropping a reference would move these (or free one early).
    assert [sys.getrefcount(a) for a in arrays] == before


def test_borrowed_keeps_shape_and_strides() -> None:
    a = np.arange(12, dtype=np.int64)[::4]  # 0, 4, 8: a strided view
    assert _strided(a) == 0 * 100 + 4 * 10 + 8
