"""The one byte-size parser every flag uses (BRIEF section 7)."""

from __future__ import annotations

import pytest

from netdam.units import format_size, parse_size, parse_size_range


@pytest.mark.parametrize(
    "text,value",
    [
        ("0", 0),
        ("4096", 4096),
        ("4000004B", 4000004),
        ("64KiB", 65536),
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("2 mib", 2 << 20),
        ("8b", 8),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_decimal_units_rejected_with_hint() -> None:
    with pytest.raises(ValueError) as info:
        parse_size("64MB")
    assert str(info.value) == (
        "invalid size '64MB': decimal units are not accepted; write 64MiB for 64x1048576 bytes "
        "or give plain bytes"
    )


@pytest.mark.parametrize("text", ["", "abc", "1.5MiB", "-4", "12XB"])
def test_garbage_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_ranges() -> None:
    assert parse_size_range("1KiB..8KiB") == [1024, 2048, 4096, 8192]
    assert parse_size_range("64MiB") == [64 << 20]
    with pytest.raises(ValueError, match="powers of two"):
        parse_size_range("1000..4096")
    with pytest.raises(ValueError, match="need 0 < A <= B"):
        parse_size_range("8KiB..1KiB")


def test_format_size() -> None:
    assert [format_size(v) for v in (65536, 1 << 30, 1000, 3 << 20)] == [
        "64KiB",
        "1GiB",
        "1000B",
        "3MiB",
    ]
