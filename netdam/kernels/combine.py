"""Element-wise combine of a packet payload with local memory: the all-reduce datapath.

``out = op(a, b)`` element by element, where ``a`` is the running partial carried in the packet
and ``b`` is the local operand. Results equal numpy's ``np.add(a, b)``, ``np.minimum(a, b)`` and
``np.maximum(a, b)`` on arrays of the element dtype bit for bit (numpy 2.4, checked on x86-64
with AVX-512 for lengths 1..4101, in place and out of place), with one exception, the NaN
returned by f32/f64 NaN + NaN:

* Integers: sums wrap modulo 2**bits; min/max are the usual ones.
* f32/f64 SUM: IEEE 754 addition, round to nearest even. A NaN input gives that NaN quietened.
  When *both* inputs are NaN the result is ``a`` quietened. numpy itself is not consistent here:
  its SIMD body returns ``a`` quietened but its remainder loop (the last ``n % 16`` f32 or
  ``n % 8`` f64 elements, and some length-1 in-place calls) returns ``b`` quietened, so no
  element-wise function can match it everywhere; we take the SIMD body's answer.
* f32/f64 MIN/MAX: ``a`` if ``a`` is NaN, else ``a`` if strictly smaller (larger) than ``b``,
  else ``b``. So NaNs propagate with their exact bits (a signalling NaN stays signalling), ``a``'s
  NaN wins when both are NaN, and for equal operands (``-0.0`` vs ``+0.0``) the result is ``b``:
  ``minimum(+0, -0) = -0`` but ``minimum(-0, +0) = +0``. This is x86 ``minps``/``maxps`` with a
  NaN check on ``a``, which is what numpy's SIMD and scalar loops both compute.
* f16 SUM: both operands are converted to f32 exactly (``netdam.kernels.f16``), added in f32
  and rounded once to f16 (numpy's half loop does the same; f32 has 24 >= 2*11 + 2 significand
  bits, so this double rounding equals a correctly rounded f16 addition). A NaN input gives that
  NaN quietened (bit 9 set, payload kept); when both are NaN numpy returns ``b`` quietened,
  which we match (the opposite of f32).
* bf16 SUM (no numpy type; the rule of PyTorch's CPU bfloat16, ``c10::BFloat16``): both
  operands widened to f32 exactly (a bf16 pattern is the upper half of an f32 one), added in
  f32 and rounded once to bf16, to nearest with ties to even; any NaN result is the canonical
  quiet NaN ``0x7FC0``. f32's 24 significand bits are >= 2*8 + 2, so this equals a correctly
  rounded bf16 addition; every hop of a chain rounds so, as an in-flight adder would.
* bf16 MIN/MAX: the f16 rule below with bf16's NaN bound (``a`` if ``a`` is NaN or ``a <= b``
  (``>=``), else ``b``; ties keep ``a``, NaNs keep their bits; nothing is rounded).
* f16 MIN/MAX: numpy's half rule, which differs from the f32 one on ties: ``a`` if ``a`` is
  NaN, else ``a`` if ``a <= b`` (``>=`` for MAX), else ``b``, returning the operand's original
  bits. So ``minimum(+0, -0) = +0`` for f16, and NaNs keep their exact bits. Compared as
  order-preserving integers, no conversion needed.

Buffers are raw bytes (the packet payload follows a 64-byte header); the kernel views each range
as little-endian elements of the wire dtype. ``out`` may be ``a`` itself (same bytes), which is
the hot path; otherwise it must not overlap ``a`` or ``b``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from netdam.kernels.f16 import f16_bits_to_f32, f32_bits_to_bf16_bits, f32_bits_to_f16_bits
from netdam.protocol.constants import ELEMENT_SIZE as _PROTOCOL_ELEMENT_SIZE
from netdam.protocol.constants import DType, ReduceOp

__all__ = [
    "DTYPE_RAW",
    "DTYPE_F32",
    "DTYPE_F16",
    "DTYPE_I32",
    "DTYPE_I64",
    "DTYPE_U64",
    "DTYPE_F64",
    "DTYPE_BF16",
    "OP_SUM",
    "OP_MIN",
    "OP_MAX",
    "DTYPE_NAMES",
    "OP_NAMES",
    "ELEMENT_SIZE",
    "combine",
]

# Wire codes and sizes, read from protocol/constants.py (SPEC.md 2.4), the one place they are
# declared; module-level ints so the kernels compile them in as constants.
DTYPE_RAW = int(DType.RAW)
DTYPE_F32 = int(DType.F32)
DTYPE_F16 = int(DType.F16)
DTYPE_I32 = int(DType.I32)
DTYPE_I64 = int(DType.I64)
DTYPE_U64 = int(DType.U64)
DTYPE_F64 = int(DType.F64)
DTYPE_BF16 = int(DType.BF16)

OP_SUM = int(ReduceOp.SUM)
OP_MIN = int(ReduceOp.MIN)
OP_MAX = int(ReduceOp.MAX)

DTYPE_NAMES: dict[int, str] = {int(d): d.name.lower() for d in DType}
OP_NAMES: dict[int, str] = {int(o): o.name.lower() for o in ReduceOp}

#: Bytes per element of each dtype code (raw counts bytes).
ELEMENT_SIZE: dict[int, int] = {int(d): size for d, size in _PROTOCOL_ELEMENT_SIZE.items()}
# The same table indexed by code, for kernels (numba cannot read a Python dict).
_ELEMENT_SIZE = np.array([ELEMENT_SIZE[code] for code in range(len(ELEMENT_SIZE))], np.int64)


# --- element loops --------------------------------------------------------------------------
# All loops update x in place (x[i] = op(x[i], y[i])) and are generic over the element type;
# combine_bytes instantiates each for the five native dtypes. In-place only, because LLVM
# cannot prove that a separate output does not alias x and falls back to a scalar loop when it
# does (3.5x slower, measured), while x and y are always distinct buffers.


@njit(cache=True, nogil=True, fastmath=False)
def _sum_loop(x, y):
    for i in range(x.shape[0]):
        xi = x[i]
        r = xi + y[i]
        # NaN + NaN must return x's NaN (quietened, which xi + xi does); LLVM may commute the
        # addition and the hardware keeps the first operand's payload. Folds away for ints.
        if xi != xi:
            r = xi + xi
        x[i] = r


@njit(cache=True, nogil=True, fastmath=False)
def _min_loop(x, y):
    for i in range(x.shape[0]):
        xi = x[i]
        yi = y[i]
        # numpy: x if x is NaN or x < y, else y (so y on ties, e.g. -0.0 vs +0.0).
        x[i] = xi if (xi != xi or xi < yi) else yi


@njit(cache=True, nogil=True, fastmath=False)
def _max_loop(x, y):
    for i in range(x.shape[0]):
        xi = x[i]
        yi = y[i]
        x[i] = xi if (xi != xi or xi > yi) else yi


@njit("void(uint16[::1], uint16[::1])", cache=True, nogil=True, fastmath=False)
def _sum_f16_loop(x, y):
    for i in range(x.shape[0]):
        xi = x[i]
        yi = y[i]
        s = np.float32(f16_bits_to_f32(xi) + f16_bits_to_f32(yi))
        r = f32_bits_to_f16_bits(s.view(np.uint32))
        # numpy's half add returns y's NaN when both are NaN, x's when only x is; either way
        # quietened (bit 9). Selected explicitly because the f32 add would pick x.
        if (xi & 0x7FFF) > 0x7C00:
            r = xi | 0x0200
        if (yi & 0x7FFF) > 0x7C00:
            r = yi | 0x0200
        x[i] = r


@njit("int64(uint16)", cache=True, nogil=True, fastmath=False)
def _f16_order_key(h):
    # For non-NaN f16 (and bf16), an integer with the same order as the value and -0 == +0, so MIN/MAX
    # need no conversion (sign-magnitude to two's complement). 3.5x faster than via f32.
    mag = np.int64(h & 0x7FFF)
    return -mag if h & 0x8000 else mag


@njit("void(uint16[::1], uint16[::1])", cache=True, nogil=True, fastmath=False)
def _sum_bf16_loop(x, y):
    for i in range(x.shape[0]):
        s = np.float32(
            np.uint32(np.uint32(x[i]) << 16).view(np.float32)
            + np.uint32(np.uint32(y[i]) << 16).view(np.float32)
        )
        x[i] = f32_bits_to_bf16_bits(np.uint32(s.view(np.uint32)))


#: Magnitudes above these are NaN (all exponent bits set, a non-zero fraction).
_F16_INF = 0x7C00
_BF16_INF = 0x7F80


@njit("void(uint16[::1], uint16[::1], int64)", cache=True, nogil=True, fastmath=False)
def _min_half_loop(x, y, inf):
    # MIN of 16-bit floats, f16 or bf16 (*inf*: their infinity's magnitude), by numpy's half
    # rule, which keeps x on ties (unlike f32): x if x is NaN or x <= y, else y, bits unchanged.
    # MIN and MAX stay two loops: one taking the direction as an argument ran 2x slower. `|`
    # and `&`, not `or` and `and`: no branches in the loop body, so it vectorizes.
    for i in range(x.shape[0]):
        xi = x[i]
        yi = y[i]
        keep = ((xi & 0x7FFF) > inf) | (
            ((yi & 0x7FFF) <= inf) & (_f16_order_key(xi) <= _f16_order_key(yi))
        )
        x[i] = xi if keep else yi


@njit("void(uint16[::1], uint16[::1], int64)", cache=True, nogil=True, fastmath=False)
def _max_half_loop(x, y, inf):
    for i in range(x.shape[0]):
        xi = x[i]
        yi = y[i]
        keep = ((xi & 0x7FFF) > inf) | (
            ((yi & 0x7FFF) <= inf) & (_f16_order_key(xi) >= _f16_order_key(yi))
        )
        x[i] = xi if keep else yi


@njit(cache=True, nogil=True, fastmath=False)
def _apply(x, y, op):
    if op == OP_SUM:
        _sum_loop(x, y)
    elif op == OP_MIN:
        _min_loop(x, y)
    else:
        _max_loop(x, y)


# One eager signature, mutable arrays throughout: numba will not pass a writable array to a
# read-only parameter from inside another kernel, and the callers are kernels.
_COMBINE_SIG = "void(uint8[::1], int64, uint8[::1], int64, uint8[::1], int64, int64, int64, int64)"


@njit(_COMBINE_SIG, cache=True, nogil=True, fastmath=False)
def combine_bytes(out, out_off, a, a_off, b, b_off, nbytes, dtype, op):
    # Contract (not checked): ranges in bounds, offsets multiples of 8, nbytes a multiple of
    # the element size, dtype/op valid and not raw, and out[out_off:] is either exactly
    # a[a_off:] or overlaps neither a nor b. An unknown dtype leaves out as a copy of a (or
    # untouched in place) and an unknown op acts as MAX: wrong but memory-safe.
    o = out[out_off : out_off + nbytes]
    if out.ctypes.data + out_off != a.ctypes.data + a_off:
        # Out of place: copy the partial, then run the in-place loop on the copy. An explicit
        # loop, because slice assignment checks for overlap and goes through a temporary
        # (10x slower, measured).
        x = a[a_off : a_off + nbytes]
        for i in range(nbytes):
            o[i] = x[i]
    y = b[b_off : b_off + nbytes]
    if dtype == DTYPE_F32:
        _apply(o.view(np.float32), y.view(np.float32), op)
    elif dtype == DTYPE_F64:
        _apply(o.view(np.float64), y.view(np.float64), op)
    elif dtype == DTYPE_I32:
        _apply(o.view(np.int32), y.view(np.int32), op)
    elif dtype == DTYPE_I64:
        _apply(o.view(np.int64), y.view(np.int64), op)
    elif dtype == DTYPE_U64:
        _apply(o.view(np.uint64), y.view(np.uint64), op)
    elif dtype == DTYPE_F16 or dtype == DTYPE_BF16:
        xh = o.view(np.uint16)
        yh = y.view(np.uint16)
        inf = _F16_INF if dtype == DTYPE_F16 else _BF16_INF
        if op == OP_MIN:
            _min_half_loop(xh, yh, inf)
        elif op == OP_MAX:
            _max_half_loop(xh, yh, inf)
        elif dtype == DTYPE_F16:
            _sum_f16_loop(xh, yh)
        else:
            _sum_bf16_loop(xh, yh)


# --- Python wrapper -------------------------------------------------------------------------

_COMBINABLE = "f32, f16, bf16, i32, i64, u64 or f64"


def _as_bytes(name: str, arr: Any, writable: bool) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"combine: {name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype.hasobject:
        raise ValueError(f"combine: {name} has dtype object; expected a numeric or byte buffer")
    if not arr.flags.c_contiguous:
        raise ValueError(f"combine: {name} is not C-contiguous")
    if not arr.flags.writeable:
        if writable:
            raise ValueError(f"combine: {name} is read-only")
        # The kernel signature takes writable arrays only (see _COMBINE_SIG); an input parsed
        # from immutable bytes is copied, which only the convenience wrapper pays for.
        arr = arr.copy()
    # reshape(-1) of a C-contiguous array is a view, so writes land in the caller's buffer.
    flat: np.ndarray = arr.reshape(-1).view(np.uint8)
    return flat


def _check_code(kind: str, code: Any, names: dict[int, str]) -> int:
    if isinstance(code, bool) or not isinstance(code, (int, np.integer)):
        raise ValueError(f"combine: {kind} code must be an int, got {type(code).__name__}")
    value = int(code)
    if value not in names:
        expected = ", ".join(f"{c} ({n})" for c, n in names.items() if n != "raw")
        head, _, last = expected.rpartition(", ")
        raise ValueError(f"combine: unknown {kind} code {value}; expected {head} or {last}")
    return value


def combine(out: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: int, op: int) -> None:
    """Write ``op(a, b)`` element-wise into *out*, interpreting all three as *dtype* elements.

    *out*, *a* and *b* are C-contiguous arrays of any dtype and shape, reinterpreted as raw
    little-endian bytes of the same length. *dtype* and *op* are wire codes (``DTYPE_*``,
    ``OP_*``). *out* may be *a* itself (in place) or a separate buffer; it must not overlap *b*
    or partially overlap *a*. Semantics are numpy's, see the module docstring.

    Raises ValueError naming the problem for a bad buffer, size or code.
    """
    dtype = _check_code("dtype", dtype, DTYPE_NAMES)
    op = _check_code("op", op, OP_NAMES)
    if dtype == DTYPE_RAW:
        raise ValueError(f"combine: dtype code 0 (raw) cannot be combined; use {_COMBINABLE}")
    out_b = _as_bytes("out", out, writable=True)
    a_b = _as_bytes("a", a, writable=False)
    b_b = _as_bytes("b", b, writable=False)
    nbytes = out_b.shape[0]
    for name, buf in (("a", a_b), ("b", b_b)):
        if buf.shape[0] != nbytes:
            raise ValueError(
                f"combine: {name} has {buf.shape[0]} bytes but out has {nbytes}; "
                "all three buffers must be the same size"
            )
    size = ELEMENT_SIZE[dtype]
    if nbytes % size != 0:
        raise ValueError(
            f"combine: {nbytes} bytes is not a whole number of {DTYPE_NAMES[dtype]} elements "
            f"({size} bytes each)"
        )
    if nbytes and np.may_share_memory(out_b, b_b):
        raise ValueError("combine: out overlaps b; out must be a itself or a separate buffer")
    in_place = out_b.ctypes.data == a_b.ctypes.data
    if nbytes and not in_place and np.may_share_memory(out_b, a_b):
        raise ValueError(
            "combine: out partially overlaps a; out must be a itself or a separate buffer"
        )
    combine_bytes(out_b, 0, a_b, 0, b_b, 0, nbytes, dtype, op)
