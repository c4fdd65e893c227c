"""netdam.kernels.f16 against numpy's own float16 conversions, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.kernels.f16 import (
    f16_bits_to_f32,
    f16_bits_to_f32_bits,
    f16_to_f32,
    f32_bits_to_f16_bits,
    f32_to_f16,
    f32_to_f16_bits,
)

ALL_F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def numpy_f16_to_f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32).view(np.uint32)


def numpy_f32_to_f16(bits: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # overflow to inf warns
        return bits.view(np.float32).astype(np.float16).view(np.uint16)


def hard_f32_patterns() -> np.ndarray:
    """f32 bit patterns where f32 -> f16 rounding is delicate, both signs."""
    # Every f16 value, the f32 exactly halfway to the next f16 value, and one f32 ulp either
    # side of both: ties at every exponent, subnormal and normal, and the carries between them.
    values = ALL_F16[:0x7C00].view(np.float16).astype(np.float64)
    upper = np.append(values[1:], 65536.0)  # the "next" value after 65504 rounds to inf
    midpoints = ((values + upper) / 2).astype(np.float32).view(np.uint32)
    exact = values.astype(np.float32).view(np.uint32)
    base = np.concatenate([exact, midpoints]).astype(np.int64)
    near = np.concatenate([base - 1, base, base + 1])
    near = near[(near >= 0) & (near < 0x7F800000)].astype(np.uint32)
    specials = np.array(
        [
            0x00000000,  # +0
            0x00000001,  # smallest f32 subnormal
            0x007FFFFF,  # largest f32 subnormal
            0x33000000,  # 2**-25: ties to zero
            0x33000001,  # just above: rounds to the smallest f16 subnormal
            0x32FFFFFF,  # just below 2**-25
            0x33800000,  # 2**-24, the smallest f16 subnormal
            0x387FC000,  # largest f16 subnormal
            0x387FE000,  # halfway from the largest subnormal to the smallest normal
            0x38800000,  # 2**-14, the smallest f16 normal
            0x477FE000,  # 65504, the largest f16
            0x477FEFFF,  # just below 65520: rounds to 65504
            0x477FF000,  # 65520: ties up to inf
            0x477FF001,
            0x47800000,  # 65536
            0x7F7FFFFF,  # largest f32
            0x7F800000,  # inf
            0x7F800001,  # signalling NaN whose payload is lost: becomes 0x7c01
            0x7F801FFF,
            0x7F802000,  # signalling NaN that keeps payload 1
            0x7FA00000,  # signalling NaN with a high payload bit
            0x7FBFFFFF,  # largest signalling NaN
            0x7FC00000,  # default quiet NaN
            0x7FC00001,
            0x7FFFFFFF,
        ],
        np.uint32,
    )
    positive = np.concatenate([near, specials])
    return np.concatenate([positive, positive | np.uint32(0x80000000)])


def test_all_f16_patterns_to_f32_match_numpy() -> None:
    got = f16_to_f32(ALL_F16)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), numpy_f16_to_f32(ALL_F16))


def test_all_f16_patterns_round_trip_through_f32() -> None:
    # Includes every NaN: numpy keeps sign and payload and does not quieten signalling NaNs.
    as_f32 = f16_to_f32(ALL_F16)
    got = f32_to_f16(as_f32)
    np.testing.assert_array_equal(got, numpy_f32_to_f16(as_f32.view(np.uint32)))
    np.testing.assert_array_equal(got, ALL_F16)


def test_million_f32_patterns_to_f16_match_numpy() -> None:
    rng = np.random.default_rng(20240601)
    hard = hard_f32_patterns()
    n_random = 1_000_000 - hard.size
    # Half uniform over all 2**32 patterns (every exponent, NaNs included), half with
    # exponents where f16 results live (2**-26 .. 2**17) so that most cases round.
    uniform = rng.integers(0, 1 << 32, n_random // 2, dtype=np.uint64).astype(np.uint32)
    n_near = n_random - uniform.size
    exponent = rng.integers(101, 144, n_near, dtype=np.uint32)
    mantissa = rng.integers(0, 1 << 23, n_near, dtype=np.uint32)
    sign = rng.integers(0, 2, n_near, dtype=np.uint32)
    near = (sign << 31) | (exponent << 23) | mantissa
    patterns = np.concatenate([hard, uniform, near])
    assert patterns.size == 1_000_000
    got = f32_to_f16(patterns.view(np.float32))
    expected = numpy_f32_to_f16(patterns)
    bad = np.nonzero(got != expected)[0]
    assert bad.size == 0, [
        (hex(int(patterns[i])), hex(int(got[i])), hex(int(expected[i]))) for i in bad[:5]
    ]


def test_nan_rules_explicitly() -> None:
    f32 = np.array([0x7F800001, 0x7FA00000, 0xFFC00000, 0x7FC02000], np.uint32)
    # Payload truncated, signalling kept, 0x7c01 when nothing is left.
    np.testing.assert_array_equal(
        f32_to_f16(f32.view(np.float32)), np.array([0x7C01, 0x7D00, 0xFE00, 0x7E01], np.uint16)
    )
    f16 = np.array([0x7C01, 0xFE00, 0x7D00], np.uint16)
    np.testing.assert_array_equal(
        f16_to_f32(f16).view(np.uint32), np.array([0x7F802000, 0xFFC00000, 0x7FA00000], np.uint32)
    )


def test_scalar_helpers_match_array_wrappers() -> None:
    # The scalar helpers are for other kernels; called from Python they still return values.
    for h in (0x0000, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFC00, 0x7C01, 0xFFFF):
        expected = int(numpy_f16_to_f32(np.array([h], np.uint16))[0])
        assert f16_bits_to_f32_bits(np.uint16(h)) == expected
    for u in hard_f32_patterns()[::997]:
        expected = int(numpy_f32_to_f16(np.array([u], np.uint32))[0])
        assert f32_bits_to_f16_bits(np.uint32(u)) == expected
    assert f16_bits_to_f32(np.uint16(0x3C01)) == 1.0 + 2.0**-10
    assert f16_bits_to_f32(np.uint16(0x0001)) == 2.0**-24
    assert f32_to_f16_bits(np.float32(65520.0)) == 0x7C00
    assert f32_to_f16_bits(np.float32(-(2.0**-25))) == 0x8000


@pytest.mark.parametrize(
    ("func", "arg", "message"),
    [
        (f16_to_f32, [1, 2], "f16_to_f32: expected a numpy array, got list"),
        (f16_to_f32, np.zeros(3, np.float16), "f16_to_f32: expected dtype uint16, got float16"),
        (f16_to_f32, np.zeros((2, 2), np.uint16), "f16_to_f32: expected a 1-D array, got 2-D"),
        (f16_to_f32, np.zeros(6, np.uint16)[::2], "f16_to_f32: array must be C-contiguous"),
        (f32_to_f16, np.zeros(3, np.float64), "f32_to_f16: expected dtype float32, got float64"),
        (f32_to_f16, np.zeros(6, np.float32)[::2], "f32_to_f16: array must be C-contiguous"),
    ],
)
def test_wrapper_errors(func: object, arg: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        func(arg)
    assert str(info.value) == message


def test_empty_arrays() -> None:
    assert f16_to_f32(np.zeros(0, np.uint16)).shape == (0,)
    assert f32_to_f16(np.zeros(0, np.float32)).shape == (0,)
