"""UPDATE (SPEC.md 6.8): a gradient applied in place to a region's float32 masters and the
optimizer state beside them, by the rule of the optimizer descriptor the datagram names, once
per step and chunk.

The arithmetic is protocol/optim.py's, operation for operation in float32 (compiled without
fast-math, so nothing is contracted into a fused multiply-add): a NIC's masters and moments
equal the reference's bit for bit. Hyperparameters are read as float64 from the descriptor and
rounded to float32 where they enter an operation; Adam's bias corrections come from the step in
float64, with libm's pow and sqrt as CPython's.

``update_check`` runs every check before anything is touched (the descriptor, then each range
the chunk reaches, then the step); ``update_apply`` assumes them. Private to the datapath
(datapath._mutate calls both, with the duplicate window between them).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from netdam.kernels.f16 import f16_bits_to_f32
from netdam.kernels.wire import ESIZE, HDR, check_access, le64, rd32, rd64
from netdam.protocol.constants import DType, OptFlags, OptRule, Rights, Status
from netdam.protocol.layout import (
    H_ADDR,
    H_AUX_ADDR,
    H_DTYPE,
    H_EPOCH,
    H_LENGTH,
    H_RKEY,
    OPT_BETA1,
    OPT_BETA2,
    OPT_CHUNK,
    OPT_COUNT,
    OPT_EPS,
    OPT_FLAGS,
    OPT_LR,
    OPT_MOMENT1,
    OPT_MOMENT2,
    OPT_PARAMS,
    OPT_RESERVED,
    OPT_RESERVED2,
    OPT_RULE,
    OPT_STEPS,
    OPT_WEIGHT_DECAY,
    OPTIMIZER_BYTES,
)

_SGD, _ADAM, _ADAMW = int(OptRule.SGD), int(OptRule.ADAM), int(OptRule.ADAMW)
_NESTEROV = int(OptFlags.NESTEROV)
_F32, _F16 = int(DType.F32), int(DType.F16)
_READ = int(Rights.READ)
_READ_WRITE = int(Rights.READ | Rights.WRITE)
_S_BAD_FIELD = int(Status.BAD_FIELD)
_S_BAD_LENGTH = int(Status.BAD_LENGTH)
_S_OUT_OF_STEP = int(Status.OUT_OF_STEP)
#: Offsets and counts past this are refused (BAD_FIELD) before any address is formed from
#: them, so descriptor + offset cannot wrap a u64 back into the region (2^48: past any memory).
_FAR = np.uint64(1 << 48)

#: update_check's verdict beside a status of 0: apply the gradient, or only answer (the chunk
#: is at this step already: a re-sent datagram, under another txn_id or after the window).
APPLY, DUPLICATE = 0, 1


@njit(cache=True, nogil=True)
def _u32(mem, a):
    return (
        np.int64(mem[a])
        | (np.int64(mem[a + 1]) << 8)
        | (np.int64(mem[a + 2]) << 16)
        | (np.int64(mem[a + 3]) << 24)
    )


@njit(cache=True, nogil=True)
def _u16(mem, a):
    return np.int64(mem[a]) | (np.int64(mem[a + 1]) << 8)


@njit(cache=True, nogil=True)
def _f64(mem, a):
    return np.uint64(le64(mem, a)).view(np.float64)


@njit(cache=True, nogil=True)
def _geometry(mem, b):
    """(descriptor, first element, elements, chunk index) of an UPDATE whose descriptor passed
    update_check (the descriptor's address as an int64)."""
    d = np.int64(rd64(b, H_ADDR))
    chunk = _u32(mem, d + OPT_CHUNK)
    count = np.int64(le64(mem, d + OPT_COUNT))
    first = np.int64(rd64(b, H_AUX_ADDR))
    return d, first, min(chunk, count - first), first // chunk


@njit(cache=True, nogil=True)
def update_check(mem, regions, b, member):
    """(status, verdict) of an UPDATE (SPEC.md 6.8, in its order): the descriptor readable under
    the rkey and well formed, the chunk a whole one, every range it reaches (masters, moments,
    its step table entry) readable and writable, then its step against the table's."""
    rkey = rd32(b, H_RKEY)
    desc = rd64(b, H_ADDR)
    status = check_access(regions, rkey, desc, OPTIMIZER_BYTES, _READ, 8, member)
    if status != 0:
        return status, APPLY
    d = np.int64(desc)
    rule = np.int64(mem[d + OPT_RULE])
    flags = np.int64(mem[d + OPT_FLAGS])
    chunk = _u32(mem, d + OPT_CHUNK)
    count = le64(mem, d + OPT_COUNT)
    params, m1 = le64(mem, d + OPT_PARAMS), le64(mem, d + OPT_MOMENT1)
    m2, steps = le64(mem, d + OPT_MOMENT2), le64(mem, d + OPT_STEPS)
    beta1, beta2 = _f64(mem, d + OPT_BETA1), _f64(mem, d + OPT_BETA2)
    if rule != _SGD and rule != _ADAM and rule != _ADAMW:
        return _S_BAD_FIELD, APPLY
    if flags & ~_NESTEROV or mem[d + OPT_RESERVED] | mem[d + OPT_RESERVED + 1]:
        return _S_BAD_FIELD, APPLY
    if le64(mem, d + OPT_RESERVED2) != 0 or chunk == 0 or count == 0 or steps == 0:
        return _S_BAD_FIELD, APPLY
    if params == 0 or max(count, params, m1, m2, steps) >= _FAR:
        return _S_BAD_FIELD, APPLY
    if rule == _SGD:
        # Nesterov needs a momentum and no dampening; a momentum needs its buffer.
        if flags & _NESTEROV and (not beta1 > 0.0 or beta2 != 0.0):
            return _S_BAD_FIELD, APPLY
        if beta1 != 0.0 and m1 == 0:
            return _S_BAD_FIELD, APPLY
    elif flags != 0 or m1 == 0 or m2 == 0 or not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        return _S_BAD_FIELD, APPLY
    first = rd64(b, H_AUX_ADDR)
    step = rd32(b, H_EPOCH)
    if first >= count or first % np.uint64(chunk) != 0 or step == 0:
        return _S_BAD_FIELD, APPLY
    _, start, n, c = _geometry(mem, b)
    if rd32(b, H_LENGTH) != n * ESIZE[np.int64(b[H_DTYPE])]:
        return _S_BAD_LENGTH, APPLY
    at_step = np.uint64(d) + steps + np.uint64(4 * c)
    status = check_access(regions, rkey, at_step, 4, _READ_WRITE, 4, member)
    if status != 0:
        return status, APPLY
    for offset in (params, m1, m2):
        if offset == 0:
            continue  # a moment this rule does not keep
        at = np.uint64(d) + offset + np.uint64(4 * start)
        status = check_access(regions, rkey, at, 4 * n, _READ_WRITE, 4, member)
        if status != 0:
            return status, APPLY
    last = _u32(mem, np.int64(at_step))
    if step == last:
        return 0, DUPLICATE
    if step != last + 1:
        return _S_OUT_OF_STEP, APPLY  # a step skipped here, or an old one
    return 0, APPLY


@njit(cache=True, nogil=True)
def _gradient(b, dtype, i):
    """Element *i* of the payload as float32, exactly (f16 and bf16 widened)."""
    if dtype == _F32:
        return np.uint32(_u32(b, HDR + 4 * i)).view(np.float32)
    h = _u16(b, HDR + 2 * i)
    if dtype == _F16:
        return f16_bits_to_f32(np.uint16(h))
    return np.uint32(h << 16).view(np.float32)  # bf16: the upper half of an f32


@njit(cache=True, nogil=True)
def update_apply(mem, b):
    """Apply an UPDATE that update_check found APPLY: its chunk's masters and moments move one
    step, and its step table entry says so."""
    d, start, n, c = _geometry(mem, b)
    step = rd32(b, H_EPOCH)
    dtype = np.int64(b[H_DTYPE])
    rule = np.int64(mem[d + OPT_RULE])
    lr, beta1 = _f64(mem, d + OPT_LR), _f64(mem, d + OPT_BETA1)
    beta2, wd = _f64(mem, d + OPT_BETA2), _f64(mem, d + OPT_WEIGHT_DECAY)
    a_p = d + np.int64(le64(mem, d + OPT_PARAMS)) + 4 * start
    p = mem[a_p : a_p + 4 * n].view(np.float32)
    m1 = np.int64(le64(mem, d + OPT_MOMENT1))
    if rule == _SGD:
        nesterov = mem[d + OPT_FLAGS] & _NESTEROV
        wd32, mu32 = np.float32(wd), np.float32(beta1)
        keep32, lr32 = np.float32(1.0 - beta2), np.float32(lr)
        a_m = d + m1 + 4 * start
        buf = mem[a_m : a_m + 4 * n].view(np.float32) if m1 != 0 else p[:0]
        for i in range(n):
            g = _gradient(b, dtype, i)
            if wd != 0.0:
                g = g + wd32 * p[i]
            if beta1 != 0.0:
                if step == 1:
                    buf[i] = g
                else:
                    buf[i] = mu32 * buf[i] + keep32 * g
                g = g + mu32 * buf[i] if nesterov else buf[i]
            p[i] = p[i] - lr32 * g
    else:
        eps = _f64(mem, d + OPT_EPS)
        a_m = d + m1 + 4 * start
        a_v = d + np.int64(le64(mem, d + OPT_MOMENT2)) + 4 * start
        m = mem[a_m : a_m + 4 * n].view(np.float32)
        v = mem[a_v : a_v + 4 * n].view(np.float32)
        decay32 = np.float32(1.0 - lr * wd)
        wd32 = np.float32(wd)
        one_b1, b2_32, one_b2 = np.float32(1.0 - beta1), np.float32(beta2), np.float32(1.0 - beta2)
        c1 = 1.0 - math.pow(beta1, np.float64(step))
        c2 = 1.0 - math.pow(beta2, np.float64(step))
        minus_step = np.float32(-(lr / c1))
        root_c2 = np.float32(math.sqrt(c2))
        eps32 = np.float32(eps)
        for i in range(n):
            g = _gradient(b, dtype, i)
            if wd != 0.0:
                if rule == _ADAMW:
                    p[i] = p[i] * decay32
                else:
                    g = g + wd32 * p[i]
            m[i] = m[i] + one_b1 * (g - m[i])
            v[i] = v[i] * b2_32 + (one_b2 * g) * g
            denom = np.sqrt(v[i]) / root_c2 + eps32
            p[i] = p[i] + minus_step * (m[i] / denom)
    at_step = d + np.int64(le64(mem, d + OPT_STEPS)) + 4 * c
    for k in range(4):
        mem[at_step + k] = np.uint8((step >> (8 * k)) & 0xFF)
