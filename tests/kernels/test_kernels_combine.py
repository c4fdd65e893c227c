"""netdam.kernels.combine against tests/reference.py (numpy ufuncs), compared as bytes."""

from __future__ import annotations

import numpy as np
import pytest
from reference import (
    BITS_DTYPES,
    F16,
    F32,
    F64,
    I32,
    MAX,
    MIN,
    NUMPY_DTYPES,
    SUM,
    U64,
    reference_chain,
    reference_combine,
)

from netdam.kernels import combine as kc
from netdam.kernels.combine import combine, combine_bytes

LENGTHS = [1, 2, 3, 7, 2039, 2048]
HEADER = 64  # the packet header precedes the payload

# Bit patterns worth hitting for each dtype; random bits supply the rest.
# fmt: off
SPECIAL_BITS: dict[int, list[int]] = {
    F32: [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
        0x7FC00123, 0xFFC00456, 0x7F800001, 0xFFA00000, 0x00000001, 0x807FFFFF,
        0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,
    ],
    F64: [
        0x0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
        0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000123, 0x7FF0000000000001,
        0xFFF4000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF,
        0x3FF0000000000000,
    ],
    F16: [
        0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7E13, 0xFE31, 0x7C01, 0xFD00,
        0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00, 0x7BFE,
    ],
    I32: [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0x80000001, 0x7FFFFFFE],
    kc.DTYPE_I64: [0, 1, (1 << 64) - 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1],
    U64: [0, 1, (1 << 64) - 1, (1 << 63) - 1, 1 << 63],
}
# fmt: on
ALL_DTYPES = sorted(NUMPY_DTYPES)
ALL_OPS = [SUM, MIN, MAX]


def make_operand(rng: np.random.Generator, dtype_code: int, n: int) -> np.ndarray:
    """n elements of dtype_code as bits: a third special, a third random bits, a third
    ordinary values (so sums do not all overflow to inf/NaN)."""
    bits_dt = BITS_DTYPES[dtype_code]
    info = np.iinfo(bits_dt)
    out = rng.integers(0, info.max, n, dtype=bits_dt, endpoint=True)
    which = rng.integers(0, 3, n)
    specials = np.array(SPECIAL_BITS[dtype_code], bits_dt)
    out[which == 0] = rng.choice(specials, int(np.sum(which == 0)))
    ordinary = (rng.standard_normal(n) * 100).astype(NUMPY_DTYPES[dtype_code]).view(bits_dt)
    out[which == 1] = ordinary[which == 1]
    return out


def ref_bytes(a: np.ndarray, b: np.ndarray, dtype_code: int, op_code: int) -> np.ndarray:
    return reference_combine(a, b, dtype_code, op_code).view(np.uint8)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op_code", ALL_OPS)
@pytest.mark.parametrize("dtype_code", ALL_DTYPES)
def test_combine_matches_reference(dtype_code: int, op_code: int, n: int) -> None:
    rng = np.random.default_rng([dtype_code, op_code, n])
    a = make_operand(rng, dtype_code, n)
    b = make_operand(rng, dtype_code, n)
    expected = ref_bytes(a, b, dtype_code, op_code)
    a_before, b_before = a.copy(), b.copy()

    out = np.empty_like(a)
    combine(out, a, b, dtype_code, op_code)  # out of place
    np.testing.assert_array_equal(out.view(np.uint8), expected)
    np.testing.assert_array_equal(a, a_before)
    np.testing.assert_array_equal(b, b_before)

    inplace = a.copy()
    combine(inplace, inplace, b, dtype_code, op_code)
    np.testing.assert_array_equal(inplace.view(np.uint8), expected)
    np.testing.assert_array_equal(b, b_before)


@pytest.mark.parametrize("op_code", ALL_OPS)
@pytest.mark.parametrize("dtype_code", ALL_DTYPES)
def test_every_special_pair(dtype_code: int, op_code: int) -> None:
    bits_dt = BITS_DTYPES[dtype_code]
    specials = np.array(SPECIAL_BITS[dtype_code], bits_dt)
    a = np.repeat(specials, specials.size)
    b = np.tile(specials, specials.size)
    out = a.copy()
    combine(out, out, b, dtype_code, op_code)
    np.testing.assert_array_equal(out.view(np.uint8), ref_bytes(a, b, dtype_code, op_code))


@pytest.mark.parametrize("op_code", ALL_OPS)
@pytest.mark.parametrize("dtype_code", ALL_DTYPES)
@pytest.mark.parametrize("in_place", [True, False])
def test_kernel_at_byte_offsets(dtype_code: int, op_code: int, in_place: bool) -> None:
    # The payload sits after the 64-byte header in the packet and at some offset in memory.
    rng = np.random.default_rng([dtype_code, op_code, in_place])
    n = 2039
    a = make_operand(rng, dtype_code, n)
    b = make_operand(rng, dtype_code, n)
    nbytes = a.nbytes
    packet = rng.integers(0, 256, HEADER + nbytes + 40, dtype=np.uint8)
    packet[HEADER : HEADER + nbytes] = a.view(np.uint8)
    memory = rng.integers(0, 256, 4096 + nbytes + 24, dtype=np.uint8)
    memory[4096 : 4096 + nbytes] = b.view(np.uint8)
    memory_before = memory.copy()
    expected = ref_bytes(a, b, dtype_code, op_code)

    if in_place:
        out, out_off = packet, HEADER
    else:
        out = rng.integers(0, 256, 128 + nbytes + 8, dtype=np.uint8)
        out_off = 128
    out_before = out.copy()
    packet_before = packet.copy()
    combine_bytes(out, out_off, packet, HEADER, memory, 4096, nbytes, dtype_code, op_code)

    np.testing.assert_array_equal(out[out_off : out_off + nbytes], expected)
    # Nothing outside the range is touched.
    np.testing.assert_array_equal(out[:out_off], out_before[:out_off])
    np.testing.assert_array_equal(out[out_off + nbytes :], out_before[out_off + nbytes :])
    np.testing.assert_array_equal(memory, memory_before)
    if not in_place:
        np.testing.assert_array_equal(packet, packet_before)


def test_zero_bytes_is_a_no_op() -> None:
    buf = np.arange(16, dtype=np.uint8)
    combine_bytes(buf, 8, buf, 8, buf, 0, 0, F32, SUM)
    np.testing.assert_array_equal(buf, np.arange(16, dtype=np.uint8))
    combine(np.zeros(0, np.uint8), np.zeros(0, np.uint8), np.zeros(0, np.uint8), F32, SUM)


def bits_of(dtype_code: int, *values: int) -> np.ndarray:
    return np.array(values, BITS_DTYPES[dtype_code])


@pytest.mark.parametrize(
    ("dtype_code", "op_code", "a", "b", "expected"),
    [
        # f32/f64: NaN in a wins with its exact bits for MIN/MAX (signalling kept) ...
        (F32, MIN, 0x7F800001, 0xFFC00002, 0x7F800001),
        (F32, MAX, 0x3F800000, 0xFF800004, 0xFF800004),
        # ... ties go to b ...
        (F32, MIN, 0x00000000, 0x80000000, 0x80000000),
        (F32, MIN, 0x80000000, 0x00000000, 0x00000000),
        (F32, MAX, 0x00000000, 0x80000000, 0x80000000),
        (F64, MAX, 0x8000000000000000, 0x0, 0x0),
        # ... and SUM of two NaNs gives a, quietened.
        (F32, SUM, 0x7F800001, 0xFFC00002, 0x7FC00001),
        (F64, SUM, 0xFFF0000000000003, 0x7FF8000000000001, 0xFFF8000000000003),
        (F32, SUM, 0x3F800000, 0x7FA00000, 0x7FE00000),
        (F32, SUM, 0x7F800000, 0xFF800000, 0xFFC00000),  # inf - inf: x86 default NaN
        # f16: ties go to a, SUM of two NaNs gives b quietened, NaN + x gives NaN quietened.
        (F16, MIN, 0x0000, 0x8000, 0x0000),
        (F16, MAX, 0x8000, 0x0000, 0x8000),
        (F16, MIN, 0x7C01, 0x3C00, 0x7C01),
        (F16, MAX, 0x3C00, 0xFC02, 0xFC02),
        (F16, SUM, 0x7C01, 0xFE02, 0xFE02),
        (F16, SUM, 0x7C01, 0x3C00, 0x7E01),
        (F16, SUM, 0x3C00, 0xFC03, 0xFE03),
        (F16, SUM, 0x7BFF, 0x5000, 0x7C00),  # 65504 + 32 = 65536 -> overflow to inf
        (F16, SUM, 0x7BFF, 0x4C00, 0x7C00),  # 65504 + 16 = 65520: a tie, to even (inf)
        (F16, SUM, 0x7BFF, 0x4800, 0x7BFF),  # 65504 + 8 rounds back down to 65504
        # integers wrap
        (I32, SUM, 0x7FFFFFFF, 0x00000001, 0x80000000),
        (U64, SUM, (1 << 64) - 1, 2, 1),
        (I32, MIN, 0x80000000, 0x7FFFFFFF, 0x80000000),
        (U64, MAX, 1 << 63, 1, 1 << 63),
    ],
)
def test_documented_rules(dtype_code: int, op_code: int, a: int, b: int, expected: int) -> None:
    # Expected bits written by hand from the module docstring, independent of numpy; each
    # case at an SIMD position and at a remainder position.
    x = bits_of(dtype_code, *([a] * 37))
    y = bits_of(dtype_code, *([b] * 37))
    combine(x, x, y, dtype_code, op_code)
    np.testing.assert_array_equal(x, bits_of(dtype_code, *([expected] * 37)))


@pytest.mark.parametrize("op_code", ALL_OPS)
@pytest.mark.parametrize("dtype_code", [F16, F32])
def test_chained_fold_matches_reference_chain(dtype_code: int, op_code: int) -> None:
    # An 8-hop chain: the packet's partial is combined in place with each node's block in
    # turn, so f16 rounds after every hop.
    rng = np.random.default_rng([8, dtype_code, op_code])
    dt = NUMPY_DTYPES[dtype_code]
    blocks = [(rng.standard_normal(4096) * 1000).astype(dt) for _ in range(8)]
    blocks[3][:5] = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], dt)
    payload = np.zeros(HEADER + blocks[0].nbytes, np.uint8)
    payload[HEADER:] = blocks[0].view(np.uint8)
    for block in blocks[1:]:
        raw = block.view(np.uint8)
        combine_bytes(payload, HEADER, payload, HEADER, raw, 0, raw.size, dtype_code, op_code)
    expected = reference_chain(blocks, op_code)
    assert expected.dtype == dt
    np.testing.assert_array_equal(payload[HEADER:], expected.view(np.uint8))


def test_reference_chain_rounds_f16_every_hop() -> None:
    # 2048 + 1 + 1 in f16: each hop rounds back to 2048, unlike a single f32 sum.
    blocks = [np.array([2048.0], np.float16)] + [np.array([1.0], np.float16)] * 2
    assert reference_chain(blocks, SUM)[0] == 2048.0


def test_typed_arrays_of_other_shapes_are_viewed_as_bytes() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((3, 4), np.float32)
    out = np.zeros(24, np.uint16)  # same 48 bytes, any dtype
    combine(out, a, b, F32, SUM)
    np.testing.assert_array_equal(out.view(np.float32), np.arange(12, dtype=np.float32) + 1)
    # Read-only inputs are accepted (copied by the wrapper).
    ro = b.copy()
    ro.flags.writeable = False
    combine(a, a, ro, F32, SUM)
    np.testing.assert_array_equal(a.reshape(-1), np.arange(12, dtype=np.float32) + 1)


def test_element_size_tables() -> None:
    assert kc.ELEMENT_SIZE == {0: 1, 1: 4, 2: 2, 3: 4, 4: 8, 5: 8, 6: 8, 7: 2}
    assert kc._ELEMENT_SIZE.dtype == np.int64
    assert kc._ELEMENT_SIZE.tolist() == [kc.ELEMENT_SIZE[c] for c in range(8)]
    for code, dt in NUMPY_DTYPES.items():
        assert kc.ELEMENT_SIZE[code] == np.dtype(dt).itemsize


def test_codes_match_reference_and_protocol() -> None:
    assert (kc.DTYPE_RAW, kc.DTYPE_F32, kc.DTYPE_F16, kc.DTYPE_I32) == (0, F32, F16, I32)
    assert (kc.DTYPE_I64, kc.DTYPE_U64, kc.DTYPE_F64) == (4, U64, F64)
    assert (kc.OP_SUM, kc.OP_MIN, kc.OP_MAX) == (SUM, MIN, MAX)
    constants = pytest.importorskip("netdam.protocol.constants")
    for name, code in [("RAW", 0), ("F32", 1), ("F16", 2), ("I32", 3), ("I64", 4)]:
        assert int(getattr(constants.DType, name)) == code
    assert int(constants.DType.U64) == kc.DTYPE_U64
    assert int(constants.DType.F64) == kc.DTYPE_F64


def _buffers(nbytes: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)


def test_error_raw_dtype() -> None:
    out, a, b = _buffers()
    with pytest.raises(ValueError) as info:
        combine(out, a, b, 0, SUM)
    assert str(info.value) == (
        "combine: dtype code 0 (raw) cannot be combined; use f32, f16, bf16, i32, i64, u64 or f64"
    )


@pytest.mark.parametrize(
    ("dtype_code", "op_code", "message"),
    [
        (
            8,
            SUM,
            "combine: unknown dtype code 8; expected 1 (f32), 2 (f16), 3 (i32), 4 (i64), "
            "5 (u64), 6 (f64) or 7 (bf16)",
        ),
        (
            -1,
            SUM,
            "combine: unknown dtype code -1; expected 1 (f32), 2 (f16), 3 (i32), 4 (i64), "
            "5 (u64), 6 (f64) or 7 (bf16)",
        ),
        (F32, 3, "combine: unknown op code 3; expected 0 (sum), 1 (min) or 2 (max)"),
        (1.0, SUM, "combine: dtype code must be an int, got float"),
        (True, SUM, "combine: dtype code must be an int, got bool"),
        (F32, "sum", "combine: op code must be an int, got str"),
    ],
)
def test_error_codes(dtype_code: object, op_code: object, message: str) -> None:
    out, a, b = _buffers()
    with pytest.raises(ValueError) as info:
        combine(out, a, b, dtype_code, op_code)
    assert str(info.value) == message


def test_numpy_integer_codes_are_accepted() -> None:
    out, a, b = _buffers()
    combine(out, a, b, np.int64(F32), np.uint8(MAX))


def test_error_buffers() -> None:
    def message(out: object, a: object, b: object, dtype_code: int = F32) -> str:
        with pytest.raises(ValueError) as info:
            combine(out, a, b, dtype_code, SUM)
        return str(info.value)

    z = np.zeros(16, np.uint8)
    assert message(bytearray(16), z, z.copy()) == (
        "combine: out must be a numpy array, got bytearray"
    )
    assert message(z, [0] * 16, z.copy()) == "combine: a must be a numpy array, got list"
    assert message(z, z.copy(), np.zeros(2, object)) == (
        "combine: b has dtype object; expected a numeric or byte buffer"
    )
    assert message(z, np.zeros(32, np.uint8)[::2], z.copy()) == "combine: a is not C-contiguous"
    ro = z.copy()
    ro.flags.writeable = False
    assert message(ro, z.copy(), z.copy()) == "combine: out is read-only"
    assert message(z, np.zeros(12, np.uint8), z.copy()) == (
        "combine: a has 12 bytes but out has 16; all three buffers must be the same size"
    )
    assert message(z, z.copy(), np.zeros(8, np.float32)) == (
        "combine: b has 32 bytes but out has 16; all three buffers must be the same size"
    )
    six = np.zeros(6, np.uint8)
    assert message(six, six.copy(), six.copy()) == (
        "combine: 6 bytes is not a whole number of f32 elements (4 bytes each)"
    )
    assert message(six, six.copy(), six.copy(), U64) == (
        "combine: 6 bytes is not a whole number of u64 elements (8 bytes each)"
    )
    big = np.zeros(32, np.uint8)
    assert message(big[:16], z, big[8:24]) == (
        "combine: out overlaps b; out must be a itself or a separate buffer"
    )
    assert message(big[:16], big[8:24], z) == (
        "combine: out partially overlaps a; out must be a itself or a separate buffer"
    )
