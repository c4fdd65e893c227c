"""Bit-exact IEEE binary16 <-> binary32 conversion for numba kernels.

Numba has no float16 type on the CPU, so f16 data is carried as ``uint16`` bit patterns and
converted with integer arithmetic. The conversions reproduce numpy's own (its software
``npy_halfbits_to_floatbits`` / ``npy_floatbits_to_halfbits``, which ``astype`` uses on this
platform; verified against numpy 2.4 for all 2**32 float32 patterns), including the parts that
IEEE 754 leaves open:

* f16 -> f32 is exact. A NaN keeps its sign and its payload shifted left by 13; a signalling NaN
  stays signalling (hardware F16C conversion would quieten it; numpy does not).
* f32 -> f16 rounds to nearest, ties to even, produces subnormals, overflows to infinity (from
  65520 upwards) and flushes magnitudes below 2**-25 to a signed zero (2**-25 itself ties to
  zero). A NaN keeps its sign and the top 10 bits of its payload, is *not* quietened, and if
  those 10 bits are all zero becomes payload 1 (``0x7c01``) so that it stays a NaN.

Scalar helpers work on bit patterns so that array kernels can view whole arrays as integers
instead of allocating per element; the float-valued helpers are thin bitcasts around them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

__all__ = ["f16_to_f32", "f32_to_f16"]

# 2**-24, the f16 subnormal quantum; exact in f32, so m * quantum is exact for m < 1024.
_F16_SUBNORMAL_QUANTUM = np.float32(2.0**-24)


@njit("uint32(uint16)", cache=True, nogil=True, fastmath=False)
def f16_bits_to_f32_bits(h):
    # Branch-free (selects only) so array loops calling it vectorize.
    x = np.int64(h)
    sign = (x & 0x8000) << 16
    exp = x & 0x7C00
    mant = x & 0x03FF
    # Normal: rebias the exponent from 15 to 127 (+112 << 23 == 0x38000000).
    res = ((x & 0x7FFF) << 13) + 0x38000000
    if exp == 0:
        # Zero or subnormal: mant * 2**-24 is exact in f32 and normal there, so the FPU
        # normalises it for us (no leading-zero loop).
        # (numba only allows .view on an explicit np.<dtype>(...) scalar, hence the wrap.)
        sub = np.float32(np.float32(mant) * _F16_SUBNORMAL_QUANTUM)
        res = np.int64(sub.view(np.uint32))
    if exp == 0x7C00:
        # Inf or NaN: keep the payload bits as they are, signalling NaNs included.
        res = 0x7F800000 | (mant << 13)
    return np.uint32(sign | res)


@njit("uint16(uint32)", cache=True, nogil=True, fastmath=False)
def f32_bits_to_f16_bits(u):
    # Every case is computed and the right one selected, so array loops vectorize; the
    # structure mirrors numpy's npy_floatbits_to_halfbits so each case can be checked by eye.
    f = np.int64(u)
    sign = (f >> 16) & 0x8000
    f_exp = f & 0x7F800000
    f_sig = f & 0x007FFFFF

    # Normal result: add half an ulp unless exactly halfway with an even result (ties to even).
    # A carry out of the significand bumps the exponent, up to infinity, which is correct.
    inc = 0 if (f_sig & 0x3FFF) == 0x1000 else 0x1000
    res = ((f_exp - 0x38000000) >> 13) + ((f_sig + inc) >> 13)

    if f_exp <= 0x38000000:
        # Subnormal result: make the implicit bit explicit and shift right by 1..11 more.
        # The shift is clamped so that it stays defined when this lane is not selected.
        shift = 113 - (f_exp >> 23)
        shift = 0 if shift < 0 else (24 if shift > 24 else shift)
        s_sig = (0x00800000 + f_sig) >> shift
        # Bits shifted out also break a tie (numpy checks the low 11 bits of the input).
        halfway = (s_sig & 0x3FFF) == 0x1000 and (f & 0x7FF) == 0
        s_inc = 0 if halfway else 0x1000
        res = (s_sig + s_inc) >> 13
        if f_exp < 0x33000000:
            res = 0
    if f_exp >= 0x47800000:
        # |f| >= 65536 overflows; values in [65520, 65536) already rounded up to inf above.
        res = 0x7C00
        if f_exp == 0x7F800000 and f_sig != 0:
            nan = 0x7C00 + (f_sig >> 13)
            # Payload only in the dropped low bits: force payload 1 so it stays a NaN.
            res = 0x7C01 if nan == 0x7C00 else nan
    return np.uint16(sign + res)


@njit("uint16(uint32)", cache=True, nogil=True, fastmath=False)
def f32_bits_to_bf16_bits(u):
    # bf16 is the upper half of an f32: round to nearest, ties to even, by adding 0x7FFF plus the
    # kept part's lowest bit and truncating (c10::BFloat16's round_to_nearest_even; a carry out
    # rounds up to infinity, correctly); any NaN becomes the canonical 0x7FC0 (SPEC.md 2.4).
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16(
        (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    )


@njit("float32(uint16)", cache=True, nogil=True, fastmath=False)
def f16_bits_to_f32(h):
    bits = np.uint32(f16_bits_to_f32_bits(h))
    return bits.view(np.float32)


@njit("uint16(float32)", cache=True, nogil=True, fastmath=False)
def f32_to_f16_bits(f):
    value = np.float32(f)
    return f32_bits_to_f16_bits(value.view(np.uint32))


@njit("void(uint16[::1], uint32[::1])", cache=True, nogil=True, fastmath=False)
def _f16_to_f32_array(src, dst):
    # dst is the float32 output viewed as uint32 so that NaN bits are stored, not re-encoded.
    for i in range(src.shape[0]):
        dst[i] = f16_bits_to_f32_bits(src[i])


@njit("void(uint32[::1], uint16[::1])", cache=True, nogil=True, fastmath=False)
def _f32_to_f16_array(src, dst):
    for i in range(src.shape[0]):
        dst[i] = f32_bits_to_f16_bits(src[i])


def _check_1d(name: str, arr: np.ndarray, dtype: type[np.generic], dtype_name: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected dtype {dtype_name}, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got {arr.ndim}-D")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous")


def f16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Convert f16 bit patterns (1-D contiguous uint16) to float32, exactly as numpy does.

    Raises ValueError if *bits* is not a 1-D C-contiguous uint16 array.
    """
    _check_1d("f16_to_f32", bits, np.uint16, "uint16")
    out = np.empty(bits.shape[0], np.float32)
    _f16_to_f32_array(bits, out.view(np.uint32))
    return out


def f32_to_f16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round float32 values (1-D contiguous) to f16 bit patterns, exactly as numpy's ``astype``.

    Raises ValueError if *values* is not a 1-D C-contiguous float32 array.
    """
    _check_1d("f32_to_f16", values, np.float32, "float32")
    out = np.empty(values.shape[0], np.uint16)
    _f32_to_f16_array(values.view(np.uint32), out)
    return out
