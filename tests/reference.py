"""Naive reference implementations that the numba kernels are tested against.

Everything here is slow on purpose: plain numpy ufuncs and Python loops, written to be obviously
right rather than fast, and independent of ``netdam.kernels`` (codes are repeated, not
imported, so a wrong constant in the kernels cannot hide in the reference too).

Sections:

* dtype and reduce-op wire codes (protocol/SPEC.md) and their numpy equivalents;
* element-wise combine and the chained all-reduce fold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# --- wire codes (protocol/SPEC.md) ---------------------------------------------------------

RAW, F32, F16, I32, I64, U64, F64 = range(7)
SUM, MIN, MAX = range(3)

#: numpy dtype of each combinable dtype code; every wire element is little-endian.
NUMPY_DTYPES: dict[int, type[np.generic]] = {
    F32: np.float32,
    F16: np.float16,
    I32: np.int32,
    I64: np.int64,
    U64: np.uint64,
    F64: np.float64,
}

#: Unsigned integer dtype of the same width, to compare results bit for bit.
BITS_DTYPES: dict[int, type[np.generic]] = {
    F32: np.uint32,
    F16: np.uint16,
    I32: np.uint32,
    I64: np.uint64,
    U64: np.uint64,
    F64: np.uint64,
}

UFUNCS: dict[int, Callable[..., np.ndarray]] = {SUM: np.add, MIN: np.minimum, MAX: np.maximum}

# Quiet bit of each float format, to quieten a NaN by hand.
_QUIET_BIT = {F32: 0x0040_0000, F64: 0x0008_0000_0000_0000, F16: 0x0200}


# --- combine --------------------------------------------------------------------------------


def reference_combine(a: np.ndarray, b: np.ndarray, dtype_code: int, op_code: int) -> np.ndarray:
    """``op(a, b)`` element-wise with numpy, as a new array of the dtype of *dtype_code*.

    *a* and *b* are arrays of any dtype holding the same number of bytes; they are
    reinterpreted as elements of *dtype_code*.

    One deliberate deviation: for float SUM where *both* inputs are NaN, which NaN numpy
    returns is an accident of how its loops were compiled. For f32/f64 it even depends on the
    element's position (the SIMD body returns ``a`` quietened, the remainder loop ``b``), so
    the reference fixes it to ``a`` quietened, the SIMD body's answer; for f16 numpy 2.4 on
    x86-64 returns ``b`` quietened throughout, and the reference fixes that so the tests do not
    depend on the platform's build.
    """
    dt = NUMPY_DTYPES[dtype_code]
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8).view(dt)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8).view(dt)
    with np.errstate(all="ignore"):
        result = UFUNCS[op_code](x, y)
    if op_code == SUM and dtype_code in _QUIET_BIT:
        bits = BITS_DTYPES[dtype_code]
        both_nan = np.isnan(x) & np.isnan(y)
        winner = y if dtype_code == F16 else x
        quiet = winner.view(bits) | bits(_QUIET_BIT[dtype_code])
        result = np.where(both_nan, quiet, result.view(bits)).view(dt)
    return np.asarray(result, dtype=dt)


def reference_chain(blocks: Sequence[np.ndarray], op_code: int) -> np.ndarray:
    """Fold *blocks* in chain order, ``acc = op(acc, block)``, as the hops of an all-reduce do.

    The blocks must share a numpy dtype (float16 for f16, so the running partial is rounded to
    f16 after every hop, exactly like a packet payload). Returns a new array.
    """
    if not blocks:
        raise ValueError("reference_chain: no blocks")
    dtype = blocks[0].dtype
    codes = [code for code, dt in NUMPY_DTYPES.items() if np.dtype(dt) == dtype]
    if not codes:
        raise ValueError(f"reference_chain: dtype {dtype} has no wire code")
    acc = blocks[0].copy()
    for block in blocks[1:]:
        if block.dtype != dtype or block.shape != acc.shape:
            raise ValueError("reference_chain: blocks differ in dtype or shape")
        acc = reference_combine(acc, block, codes[0], op_code)
    return acc


def all_reduce_reference(inputs: Sequence[np.ndarray], op_code: int = 0) -> np.ndarray:
    """The exact result of the NICs' all-reduce (SPEC.md 4.1): block j folds ranks j+1, j+2,
    ..., j (its owner last), in chain order, as the chains do."""
    n, count = len(inputs), inputs[0].size
    expected = np.empty_like(inputs[0])
    for j in range(n):
        lo, hi = j * count // n, (j + 1) * count // n
        order = [(j + 1 + k) % n for k in range(n)]
        if hi > lo:
            expected[lo:hi] = reference_chain([inputs[r][lo:hi] for r in order], int(op_code))
    return expected
