"""The pool's address map: edges of range-mapped and interleaved regions, kernel vs reference."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.kernels.switch_path import translate_many
from netdam.protocol.constants import Rights, Status
from netdam.switch.addrmap import (
    GLOBAL_BASE,
    Region,
    Way,
    backing_per_way,
    build_tables,
    check_regions,
    translate,
)

KiB = 1024
RW = int(Rights.READ | Rights.WRITE)
ALL = int(Rights.READ | Rights.WRITE | Rights.ATOMIC)
STRIDE = 8 * KiB


def interleaved(gaddr: int = GLOBAL_BASE, size: int = 10 * STRIDE + 100, ways: int = 3) -> Region:
    per = backing_per_way(size, STRIDE, ways)
    return Region(
        gaddr, size, 0xAB, ALL, STRIDE, tuple(Way(w, 4096 * (w + 1), per) for w in range(ways))
    )


def ranged(gaddr: int = GLOBAL_BASE + (16 << 20), size: int = 5000) -> Region:
    return Region(gaddr, size, 0xCD, RW, 0, (Way(1, 65536, size),))


def kernel(
    regions: list[Region], rows: list[tuple[int, int, int, int, int]]
) -> list[tuple[int, int, int]]:
    t = build_tables(regions, nodes=3)
    arr = np.array(rows, dtype=object)
    status = np.zeros(len(rows), np.int64)
    node = np.zeros(len(rows), np.int64)
    local = np.zeros(len(rows), np.int64)
    translate_many(
        np.array([int(a) for a in arr[:, 0]], np.uint64),
        np.array(arr[:, 1], np.int64),
        np.array(arr[:, 2], np.int64),
        np.array(arr[:, 3], np.int64),
        np.array(arr[:, 4], np.int64),
        t.bundle(),
        status,
        node,
        local,
    )
    return list(zip(status.tolist(), node.tolist(), local.tolist()))


def test_backing_is_whole_stripes() -> None:
    assert backing_per_way(10 * STRIDE + 100, STRIDE, 3) == 4 * STRIDE  # 11 stripes over 3 ways
    assert backing_per_way(3 * STRIDE, STRIDE, 3) == STRIDE
    assert backing_per_way(5000, 0, 1) == 5000


def test_interleaved_edges() -> None:
    r = interleaved()
    g = r.gaddr
    cases = {
        # first byte, last byte of the first stripe, first byte of the second, third, fourth
        (g, 1): (Status.OK, 0, 4096),
        (g + STRIDE - 1, 1): (Status.OK, 0, 4096 + STRIDE - 1),
        (g + STRIDE, 1): (Status.OK, 1, 8192),
        (g + 2 * STRIDE, 8): (Status.OK, 2, 12288),
        (g + 3 * STRIDE, 8): (Status.OK, 0, 4096 + STRIDE),  # wraps to way 0, second stripe
        (g + STRIDE - 8, 8): (Status.OK, 0, 4096 + STRIDE - 8),  # ends exactly at the boundary
        (g + STRIDE - 8, 16): (Status.SPANS_NODES, -1, -1),  # crosses it
        (g + r.size - 1, 1): (Status.OK, 1, 8192 + 3 * STRIDE + 99),  # last byte (stripe 10)
        (g + r.size - 1, 2): (Status.OUT_OF_BOUNDS, -1, -1),
        (g + r.size, 1): (Status.NO_ROUTE, -1, -1),
        (g - 1, 1): (Status.NO_ROUTE, -1, -1),
        (0, 8): (Status.NO_ROUTE, -1, -1),
    }
    rows = [(a, n, 0xAB, int(Rights.READ), 1) for (a, n) in cases]
    got = kernel([r], rows)
    for (key, want), have in zip(cases.items(), got):
        assert translate([r], key[0], key[1], 0xAB, int(Rights.READ), 1) == want, key
        assert have == (int(want[0]), want[1], want[2]), key


def test_range_mapped_edges_rkey_rights_alignment() -> None:
    a, b = interleaved(), ranged()
    g = b.gaddr
    rows = [
        (g, 8, 0xCD, int(Rights.READ), 8),  # first byte
        (g + 4999, 1, 0xCD, int(Rights.WRITE), 1),  # last byte
        (g + 4992, 16, 0xCD, int(Rights.READ), 8),  # past the end
        (g, 8, 0xAB, int(Rights.READ), 8),  # the other tenant's key
        (g, 8, 0, int(Rights.READ), 8),  # no key
        (g, 8, 0xCD, int(Rights.ATOMIC), 8),  # no atomic right
        (g + 4, 8, 0xCD, int(Rights.READ), 8),  # misaligned for u64
        (a.gaddr, 8, 0xCD, int(Rights.READ), 8),  # key of b on region a
    ]
    want = [
        (0, 1, 65536),
        (0, 1, 65536 + 4999),
        (int(Status.OUT_OF_BOUNDS), -1, -1),
        (int(Status.BAD_RKEY), -1, -1),
        (int(Status.BAD_RKEY), -1, -1),
        (int(Status.NO_RIGHTS), -1, -1),
        (int(Status.MISALIGNED), -1, -1),
        (int(Status.BAD_RKEY), -1, -1),
    ]
    assert kernel([b, a], rows) == want
    for row, w in zip(rows, want):
        status, node, local = translate([a, b], *row)
        assert (int(status), node, local) == w


def test_kernel_agrees_with_reference_on_random_requests() -> None:
    rng = np.random.default_rng(5)
    regions = [interleaved(), ranged(), interleaved(GLOBAL_BASE + (32 << 20), 7 * STRIDE, 2)]
    rows = []
    for _ in range(3000):
        r = regions[rng.integers(len(regions))]
        addr = int(r.gaddr + rng.integers(-64, r.size + 64))
        rows.append(
            (
                max(addr, 0),
                int(rng.choice([1, 8, 64, 4096, 8192])),
                int(rng.choice([r.rkey, 0xAB, 0xCD, 7])),
                int(rng.choice([1, 2, 4])),
                int(rng.choice([1, 4, 8])),
            )
        )
    got = kernel(regions, rows)
    for row, have in zip(rows, got):
        status, node, local = translate(sorted(regions, key=lambda x: x.gaddr), *row)
        assert have == (int(status), node, local), row


def test_every_byte_maps_once_and_stays_in_its_way() -> None:
    r = interleaved(size=7 * STRIDE + 8, ways=3)
    seen: set[tuple[int, int]] = set()
    for offset in range(0, r.size, 8):
        node, local = r.locate(offset)
        way = r.ways[node]
        assert way.local <= local < way.local + way.size
        assert (node, local) not in seen
        seen.add((node, local))
    assert r.chunks(STRIDE - 16, 48) == [(r.gaddr + STRIDE - 16, 16), (r.gaddr + STRIDE, 32)]
    assert [n for _, n in ranged().chunks(0, 20000)] == [8192, 8192, 3616]


def test_table_checks_name_the_problem() -> None:
    a = interleaved()
    with pytest.raises(ValueError, match="overlap"):
        check_regions([a, ranged(gaddr=a.gaddr + 8)], 3)
    with pytest.raises(ValueError, match="needs"):
        check_regions([Region(GLOBAL_BASE, 3 * STRIDE, 1, 1, STRIDE, (Way(0, 0, 1),))], 3)
    with pytest.raises(ValueError, match="cluster has 3 nodes"):
        check_regions([Region(GLOBAL_BASE, 10, 1, 1, 0, (Way(5, 0, 10),))], 3)
    with pytest.raises(ValueError, match="multiple of 8"):
        check_regions([Region(GLOBAL_BASE, 10, 1, 1, 12, (Way(0, 0, 12),))], 3)
