"""Hot loops of ``netdam bench pool``: a closed-loop request generator and a null echo server.

The generator keeps ``window`` requests in flight on one unconnected socket: slot s sends a copy
of template ``s % n_templates`` with a request id written at ``id_off`` (``id_bytes`` 2 or 4,
big-endian: the NetDAM txn id at offset 12, memcached's UDP request id at offset 0); a reply is
matched by the id it echoes (slot = id mod window), its latency recorded, and the slot sends its
next request at once. A slot unanswered for ``timeout_ns`` gets a fresh id and is re-sent
(counted). Ids stay within a few windows of the newest, so a NetDAM node never answers STALE.
With a tag key (a tagged region, SPEC.md 2.6) each request is sealed after its id is written,
as a client must, and a reply counts as good only with its tag.
Times are CLOCK_MONOTONIC ns, shared by every process, so the parent hands all children one
measurement window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from netdam.kernels.tag import TAG, seal_tag, tag_matches
from netdam.kernels.udp_io import clock_ns, recv_batch_kernel, send_batch_kernel
from netdam.kernels.wire import copy_bytes

# counts[] of _gen_run
G_OPS_IN_WINDOW = 0
G_OPS_TOTAL = 1
G_TIMEOUTS = 2
G_ERRORS = 3  # replies of the wrong kind (NACK, memcached error), in the window
G_SENT = 4
G_STRAY = 5  # replies matching no outstanding request (late duplicates)
G_COUNTS = 8
#: Latency histogram: 1 us bins up to this many us; the last bin holds everything beyond.
HIST_BINS = 100_001


@njit(cache=True, nogil=True)
def _put_id(buf, off, nbytes, value):
    for k in range(nbytes):
        buf[off + k] = np.uint8((value >> (8 * (nbytes - 1 - k))) & 0xFF)


@njit(cache=True, nogil=True)
def _get_id(buf, off, nbytes):
    v = np.int64(0)
    for k in range(nbytes):
        v = (v << 8) | np.int64(buf[off + k])
    return v


@njit(cache=True, nogil=True)
def _gen_run(fd, plan, phase, rx, max_n, scratch, state, counts, hist):
    """Closed loop until *t_stop*; ops and latencies count inside [t_start, t_end). A reply is
    good when ``reply[ok_off] == ok_byte`` (ok_off < 0: any reply)."""
    (
        templates,
        t_len,
        n_templates,
        window,
        dst,
        id_off,
        id_bytes,
        ok_off,
        ok_byte,
        timeout_ns,
        tag,
    ) = plan
    k0, k1 = tag[0], tag[1]
    sealed = (k0 | k1) != 0
    t_start, t_end, t_stop = phase
    rx_buf, rx_off, rx_len, rx_src = rx
    slot_bytes = templates.shape[1]
    sbuf = np.zeros(window * slot_bytes, np.uint8)
    s_off = np.zeros(window, np.int64)
    s_len = np.zeros(window, np.int32)
    s_dst = np.zeros(window, np.uint64)
    cur = np.zeros(window, np.int64)
    sent_at = np.zeros(window, np.int64)
    live = np.zeros(window, np.uint8)
    todo = np.zeros(window, np.int64)
    id_mod = np.int64(1) << np.int64(8 * id_bytes)
    for s in range(window):
        t = s % n_templates
        copy_bytes(sbuf, s * slot_bytes, templates[t], 0, t_len[t])
        cur[s] = s
    n_todo = window
    for s in range(window):
        todo[s] = s
    top = np.int64(window - 1)
    while True:
        now = clock_ns()
        if now >= t_stop:
            break
        # Send every slot that is due, in one batch.
        for k in range(n_todo):
            s = todo[k]
            t = s % n_templates
            _put_id(sbuf, s * slot_bytes + id_off, id_bytes, cur[s] % id_mod)
            s_off[k] = s * slot_bytes
            s_len[k] = t_len[t]
            if sealed:
                s_len[k] = seal_tag(sbuf[s * slot_bytes : (s + 1) * slot_bytes], t_len[t], k0, k1)
            s_dst[k] = dst
            sent_at[s] = now
            live[s] = 1
        if n_todo > 0:
            done = send_batch_kernel(fd, sbuf, s_off, s_len, s_dst, n_todo, scratch, state)
            counts[G_SENT] += done
        n_todo = 0
        n = recv_batch_kernel(fd, rx_buf, rx_off, rx_len, rx_src, max_n, 1, state)
        now = clock_ns()
        inside = now >= t_start and now < t_end
        for i in range(n):
            o = rx_off[i]
            if rx_len[i] < id_off + id_bytes:
                continue
            rid = _get_id(rx_buf, o + id_off, id_bytes)
            s = rid % window
            if live[s] == 0 or cur[s] % id_mod != rid:
                counts[G_STRAY] += 1
                continue
            live[s] = 0
            counts[G_OPS_TOTAL] += 1
            good = ok_off < 0 or (rx_len[i] > ok_off and rx_buf[o + ok_off] == ok_byte)
            if good and sealed:
                good = tag_matches(rx_buf[o : o + rx_len[i]], np.int64(rx_len[i]), k0, k1)
            if inside:
                if good:
                    counts[G_OPS_IN_WINDOW] += 1
                    us = (now - sent_at[s]) // 1000
                    hist[min(us, HIST_BINS - 1)] += 1
                else:
                    counts[G_ERRORS] += 1
            cur[s] = (top // window + 1) * window + s  # a fresh id just above the newest
            top = max(top, cur[s])
            todo[n_todo] = s
            n_todo += 1
        for s in range(window):
            if live[s] == 1 and now - sent_at[s] > timeout_ns:
                live[s] = 0
                counts[G_TIMEOUTS] += 1
                cur[s] = (top // window + 1) * window + s
                top = max(top, cur[s])
                todo[n_todo] = s
                n_todo += 1
    return counts[G_OPS_IN_WINDOW]


@njit(cache=True, nogil=True)
def _echo_run(fd, buf, offs, lens, srcs, max_n, scratch, state, t_stop, counts):
    """Null UDP echo server: send every datagram back to its source, no work, until *t_stop*."""
    while clock_ns() < t_stop:
        n = recv_batch_kernel(fd, buf, offs, lens, srcs, max_n, 10, state)
        if n == 0:
            continue
        done = send_batch_kernel(fd, buf, offs, lens, srcs, n, scratch, state)
        counts[0] += n
        counts[1] += done
    return counts[1]


def gen_run(
    fd: int,
    plan: Any,
    phase: Any,
    rx: Any,
    max_n: int,
    scratch: np.ndarray,
    state: np.ndarray,
    counts: np.ndarray,
    hist: np.ndarray,
) -> None:
    """Closed-loop request generator (see _gen_run): *plan* a GenPlan, *phase* a TimeWindow."""
    if plan.templates.ndim != 2 or plan.t_len.shape[0] < plan.n_templates or plan.window < 1:
        raise ValueError("gen_run: templates must be (n, width) with n >= n_templates, window >= 1")
    room = TAG if plan.tag.any() else 0
    if int(plan.t_len[: plan.n_templates].max()) + room > plan.templates.shape[1]:
        raise ValueError("gen_run: a template (and its tag) is longer than its row")
    if plan.tag.shape != (2,) or plan.tag.dtype != np.uint64:
        raise ValueError("gen_run: the tag key is two uint64 words")
    if counts.shape[0] < G_COUNTS or hist.shape[0] < HIST_BINS:
        raise ValueError("gen_run: counts or histogram too short")
    _gen_run(fd, plan, phase, rx, max_n, scratch, state, counts, hist)


def echo_run(
    fd: int,
    buf: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    srcs: np.ndarray,
    max_n: int,
    scratch: np.ndarray,
    state: np.ndarray,
    t_stop: int,
    counts: np.ndarray,
) -> None:
    """Null echo server (see _echo_run)."""
    if not max_n <= min(offs.shape[0], lens.shape[0], srcs.shape[0]) or counts.shape[0] < G_COUNTS:
        raise ValueError("echo_run: batch arrays or counts too short")
    _echo_run(fd, buf, offs, lens, srcs, max_n, scratch, state, t_stop, counts)
