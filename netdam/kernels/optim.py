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

from netdam.kernels.f16 import f16_bits_to_f32, f32_bits_to_bf16_bits, f32_to_f16_bits
from netdam.kernels.wire import ESIZE, HDR, check_access, le16, le32, le64, rd32, rd64
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
from netdam.protocol.payloads import OptimizerDescriptor

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
def _f64(mem, a):
    return np.uint64(le64(mem, a)).view(np.float64)


@njit(cache=True, nogil=True)
def _geometry(mem, b):
    """(descriptor, first element, elements, chunk index) of an UPDATE whose descriptor passed
    update_check (the descriptor's address as an int64)."""
    d = np.int64(rd64(b, H_ADDR))
    chunk = le32(mem, d + OPT_CHUNK)
    count = np.int64(le64(mem, d + OPT_COUNT))
    first = np.int64(rd64(b, H_AUX_ADDR))
    return d, first, min(chunk, count - first), first // chunk


@njit(cache=True, nogil=True)
def descriptor_status(mem, d):
    """0 when the optimizer descriptor at *d* (OPTIMIZER_BYTES readable there) is well formed
    (SPEC.md 6.8: a rule, its flags and hyperparameters, non-zero sizes, offsets short of 2^48),
    else BAD_FIELD. Rights on the ranges it names are the caller's to check."""
    rule = np.int64(mem[d + OPT_RULE])
    flags = np.int64(mem[d + OPT_FLAGS])
    chunk = le32(mem, d + OPT_CHUNK)
    count = le64(mem, d + OPT_COUNT)
    params, m1 = le64(mem, d + OPT_PARAMS), le64(mem, d + OPT_MOMENT1)
    m2, steps = le64(mem, d + OPT_MOMENT2), le64(mem, d + OPT_STEPS)
    beta1, beta2 = _f64(mem, d + OPT_BETA1), _f64(mem, d + OPT_BETA2)
    if rule != _SGD and rule != _ADAM and rule != _ADAMW:
        return _S_BAD_FIELD
    if flags & ~_NESTEROV or mem[d + OPT_RESERVED] | mem[d + OPT_RESERVED + 1]:
        return _S_BAD_FIELD
    if le64(mem, d + OPT_RESERVED2) != 0 or chunk == 0 or count == 0 or steps == 0:
        return _S_BAD_FIELD
    if params == 0 or max(count, params, m1, m2, steps) >= _FAR:
        return _S_BAD_FIELD
    if rule == _SGD:
        # Nesterov needs a momentum and no dampening; a momentum needs its buffer.
        if flags & _NESTEROV and (not beta1 > 0.0 or beta2 != 0.0):
            return _S_BAD_FIELD
        if beta1 != 0.0 and m1 == 0:
            return _S_BAD_FIELD
    elif flags != 0 or m1 == 0 or m2 == 0 or not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        return _S_BAD_FIELD
    return 0


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
    status = descriptor_status(mem, d)
    if status != 0:
        return status, APPLY
    chunk = le32(mem, d + OPT_CHUNK)
    count = le64(mem, d + OPT_COUNT)
    params, m1 = le64(mem, d + OPT_PARAMS), le64(mem, d + OPT_MOMENT1)
    m2, steps = le64(mem, d + OPT_MOMENT2), le64(mem, d + OPT_STEPS)
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
    last = le32(mem, np.int64(at_step))
    if step == last:
        return 0, DUPLICATE
    if step != last + 1:
        return _S_OUT_OF_STEP, APPLY  # a step skipped here, or an old one
    return 0, APPLY


@njit(cache=True, nogil=True)
def _gradient(g, off, dtype, i):
    """Element *i* of the gradient at *off* in *g* as float32, exactly (f16 and bf16 widened)."""
    if dtype == _F32:
        return np.uint32(le32(g, off + 4 * i)).view(np.float32)
    h = le16(g, off + 2 * i)
    if dtype == _F16:
        return f16_bits_to_f32(np.uint16(h))
    return np.uint32(h << 16).view(np.float32)  # bf16: the upper half of an f32


@njit(cache=True, nogil=True)
def _step_rule(mem, d, start, n, step, g, g_off, dtype):
    """Move elements start .. start + n of the descriptor's masters and moments one step (the
    *step*-th), by its rule, with the gradient at *g_off* in *g* (*dtype*)."""
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
            x = _gradient(g, g_off, dtype, i)
            if wd != 0.0:
                x = x + wd32 * p[i]
            if beta1 != 0.0:
                if step == 1:
                    buf[i] = x
                else:
                    buf[i] = mu32 * buf[i] + keep32 * x
                x = x + mu32 * buf[i] if nesterov else buf[i]
            p[i] = p[i] - lr32 * x
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
            x = _gradient(g, g_off, dtype, i)
            if wd != 0.0:
                if rule == _ADAMW:
                    p[i] = p[i] * decay32
                else:
                    x = x + wd32 * p[i]
            m[i] = m[i] + one_b1 * (x - m[i])
            v[i] = v[i] * b2_32 + (one_b2 * x) * x
            denom = np.sqrt(v[i]) / root_c2 + eps32
            p[i] = p[i] + minus_step * (m[i] / denom)


@njit(cache=True, nogil=True)
def update_apply(mem, b):
    """Apply an UPDATE that update_check found APPLY: its chunk's masters and moments move one
    step, and its step table entry says so."""
    d, start, n, c = _geometry(mem, b)
    step = rd32(b, H_EPOCH)
    _step_rule(mem, d, start, n, step, b, HDR, np.int64(b[H_DTYPE]))
    at_step = d + np.int64(le64(mem, d + OPT_STEPS)) + 4 * c
    for k in range(4):
        mem[at_step + k] = np.uint8((step >> (8 * k)) & 0xFF)


@njit(cache=True, nogil=True)
def fused_apply(mem, d, start, n, step, g, g_off, dtype):
    """The fused all-reduce's store (SPEC.md 4.1, "Fused reduce and update"): the reduced
    gradient at *g_off* in *g* steps elements start .. start + n of the descriptor at *d*, and
    is replaced there by the new weights in the collective's dtype (f32 as the masters; f16
    and bf16 rounded to nearest even), which the chain's last hop then stores and multicasts.
    The caller checked the descriptor and its ranges when the collective started."""
    _step_rule(mem, d, start, n, step, g, g_off, dtype)
    a_p = d + np.int64(le64(mem, d + OPT_PARAMS)) + 4 * start
    p = mem[a_p : a_p + 4 * n].view(np.float32)
    for i in range(n):
        if dtype == _F32:
            for k in range(4):
                g[g_off + 4 * i + k] = mem[a_p + 4 * i + k]
            continue
        if dtype == _F16:
            h = np.uint32(f32_to_f16_bits(p[i]))
        else:
            h = np.uint32(f32_bits_to_bf16_bits(np.uint32(le32(mem, a_p + 4 * i))))
        g[g_off + 2 * i] = np.uint8(h & np.uint32(0xFF))
        g[g_off + 2 * i + 1] = np.uint8((h >> np.uint32(8)) & np.uint32(0xFF))


# ---------------------------------------------------------------- checked entries from Python


def _check_descriptor(memory: np.ndarray, desc: int) -> None:
    if memory.dtype != np.uint8 or memory.ndim != 1:
        raise ValueError("node memory must be a flat uint8 array")
    if not 0 <= desc <= memory.size - OPTIMIZER_BYTES:
        raise ValueError(f"optimizer descriptor at {desc} outside {memory.size} bytes of memory")


def descriptor_problem(memory: np.ndarray, desc: int) -> int:
    """Checked descriptor_status: 0 when the optimizer descriptor at *desc* is well formed, else
    BAD_FIELD (ValueError when its 96 bytes do not lie in *memory*)."""
    _check_descriptor(memory, desc)
    return int(descriptor_status(memory, np.int64(desc)))


def fused_step(
    memory: np.ndarray, desc: int, elements: int, step: int, at: int, dtype: int
) -> None:
    """Checked fused_apply over a whole block (a one-rank fused all-reduce): the gradient of
    *elements* at *at* steps the descriptor's first *elements* masters and is replaced there by
    the new weights. Every range is checked against *memory* first."""
    _check_descriptor(memory, desc)
    if descriptor_status(memory, np.int64(desc)) != 0:
        raise ValueError(f"the optimizer descriptor at {desc} is not well formed")
    if dtype not in (_F32, _F16, int(DType.BF16)):
        raise ValueError(f"a fused step's gradient is f32, f16 or bf16, not dtype {dtype}")
    d = OptimizerDescriptor.decode(memory[desc : desc + OPTIMIZER_BYTES].tobytes())
    if not 0 < elements <= d.count or step < 1:
        raise ValueError(f"{elements} elements at step {step} for a descriptor of {d.count}")
    for offset in (d.params, d.moment1, d.moment2):
        if offset and desc + offset + 4 * elements > memory.size:
            raise ValueError(f"the descriptor's state at {desc + offset} runs past the memory")
    if not 0 <= at <= memory.size - ESIZE[dtype] * elements:
        raise ValueError(f"the gradient at {at} runs past the memory")
    fused_apply(
        memory,
        np.int64(desc),
        np.int64(0),
        np.int64(elements),
        np.int64(step),
        memory,
        np.int64(at),
        np.int64(dtype),
    )
