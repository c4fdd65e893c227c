"""Payload elements as numbers (SPEC.md 2.4), for what shows or checks them: the decoder, the
fixtures' tables, tests. numpy has no bfloat16, so bf16 elements, carried as 16-bit patterns,
are widened to float32 here, exactly (a bf16 pattern is the upper half of the float32 one)."""

from __future__ import annotations

from typing import Any

import numpy as np

from netdam.protocol.constants import NUMPY_DTYPE, DType

__all__ = ["BFLOAT16", "bf16_combine", "bf16_round", "bf16_values", "element_values", "is_bf16"]

#: bfloat16 for numpy, which has none: 16-bit patterns marked as bf16 (dtype metadata, which
#: views, slices and copies keep). Equal to uint16 as a dtype, so ``is_bf16`` tells them apart.
BFLOAT16 = np.dtype(np.uint16, metadata={"netdam": "bf16"})


def is_bf16(array: np.ndarray[Any, Any]) -> bool:
    """Whether *array* holds bf16: marked with BFLOAT16, or ml_dtypes' bfloat16."""
    dtype = array.dtype
    metadata = dtype.metadata
    # The scalar type's name, not dtype.name: numpy builds that string on every read (~2 us,
    # read twice in each collective call's path).
    return bool(metadata and metadata.get("netdam") == "bf16") or dtype.type.__name__ == "bfloat16"


def bf16_values(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The float32 values of bf16 bit patterns (any unsigned 16-bit array), exactly."""
    widened: np.ndarray[Any, np.dtype[np.float32]] = (bits.astype("<u4") << 16).view("<f4")
    return widened


def element_values(
    data: bytes | bytearray | memoryview, dtype: DType, count: int = -1, offset: int = 0
) -> np.ndarray[Any, Any]:
    """*count* elements of *dtype* from *data* at *offset* (all when -1), as numbers: numpy's
    own type for every dtype but bf16, which comes as float32."""
    values: np.ndarray[Any, Any] = np.frombuffer(
        data, dtype=NUMPY_DTYPE[dtype], count=count, offset=offset
    )
    return bf16_values(values) if dtype == DType.BF16 else values


def bf16_round(values: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """float32 *values* rounded to bf16 bit patterns (SPEC.md 2.4): to nearest, ties to even,
    overflow to infinity; any NaN becomes the quiet NaN 0x7FC0 (PyTorch's c10::BFloat16)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    out: np.ndarray[Any, np.dtype[np.uint16]] = np.where(
        np.isnan(values), np.uint16(0x7FC0), rounded
    ).astype("<u2")
    return out


def _bf16_nan(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return (bits & 0x7FFF) > 0x7F80


def _sign_magnitude_key(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    magnitude = (bits & 0x7FFF).astype(np.int64)
    return np.where(bits & 0x8000, -magnitude, magnitude)


def bf16_combine(
    a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], op: int
) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """SPEC.md 2.4's bf16 combine of bit patterns *a* (the running value) and *b*, element-wise,
    in plain numpy: the reference the NICs' kernels are tested against. *op*: ReduceOp code."""
    a, b = np.asarray(a, "<u2"), np.asarray(b, "<u2")
    if op == 0:  # SUM: widen exactly, add in float32, round once
        with np.errstate(invalid="ignore", over="ignore"):
            return bf16_round(bf16_values(a) + bf16_values(b))
    ka, kb = _sign_magnitude_key(a), _sign_magnitude_key(b)
    better = ka <= kb if op == 1 else ka >= kb  # MIN, MAX; ties keep a
    keep = _bf16_nan(a) | (~_bf16_nan(b) & better)
    out: np.ndarray[Any, np.dtype[np.uint16]] = np.where(keep, a, b).astype("<u2")
    return out
