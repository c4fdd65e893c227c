"""The plan of an all-reduce past one chain (netdam.core.torus, SPEC.md 4.2): its shape, its
steps, and its numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.core.torus import longest_chain, splits, torus_groups, torus_shape, torus_steps
from netdam.protocol.constants import MAX_SEGMENTS, ReduceOp
from netdam.protocol.payloads import Algo
from netdam.tools.allreduce import reference_chain_allreduce, reference_torus_allreduce


@pytest.mark.parametrize(
    ("world", "shape"),
    [
        (2, (1, 2)),
        (64, (1, 64)),
        (65, (5, 13)),
        (66, (6, 11)),
        (100, (10, 10)),
        (128, (8, 16)),
        (256, (16, 16)),
        (1024, (32, 32)),
        (4032, (63, 64)),
        (4096, (64, 64)),
    ],
)
def test_the_most_square_equal_rows_of_at_most_64(world: int, shape: tuple[int, int]) -> None:
    assert torus_shape(world) == shape
    rows, size = shape
    assert rows * size == world and size <= MAX_SEGMENTS and rows <= MAX_SEGMENTS
    assert longest_chain(world) == max(rows, size)


@pytest.mark.parametrize(("world", "near"), [(67, "66 or 68"), (134, "133 or 135")])
def test_a_count_that_does_not_split_is_refused_naming_the_nearest(world: int, near: str) -> None:
    assert not splits(world)
    with pytest.raises(ValueError, match=f"use {near} ranks"):
        torus_shape(world)
    with pytest.raises(ValueError, match="at most 4096"):
        torus_shape(4097)


def test_rows_and_columns_cover_every_rank_once_each() -> None:
    groups = torus_groups(12, max_chain=4)
    rows, columns, gathers = groups[:3], groups[3:7], groups[7:]
    assert rows == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert columns == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    assert gathers == rows  # a row's gathers are a group of their own, over the same ranks
    assert (
        sorted(r for g in rows for r in g)
        == sorted(r for g in columns for r in g)
        == list(range(12))
    )


@pytest.mark.parametrize("count", [1, 3, 4, 1000])
def test_every_rank_reduces_its_row_then_its_block_down_its_column_then_gathers(count: int) -> None:
    world, max_chain = 12, 4
    for rank in range(world):
        steps = torus_steps(world, rank, count, max_chain)
        r, c = divmod(rank, 4)
        lo, hi = c * count // 4, (c + 1) * count // 4
        assert steps[0].algo == Algo.REDUCE_SCATTER and steps[0].members == (
            4 * r,
            4 * r + 1,
            4 * r + 2,
            4 * r + 3,
        )
        assert steps[-1].algo == Algo.ALL_GATHER and (
            steps[-1].in_offset,
            steps[-1].out_offset,
        ) == (lo, 0)
        middle = steps[1:-1]
        # An empty block (fewer elements than a row has members) has no column chain.
        assert len(middle) == (1 if hi > lo else 0)
        for step in middle:
            assert step.algo == Algo.ALL_REDUCE and step.members == (c, c + 4, c + 8)
            assert (step.in_offset, step.count) == (lo, hi - lo)
        # Each step in a sub-group of its own: row r's reduce-scatters, column c, row r's
        # gathers (torus_groups' order), whose ranks are the step's.
        groups = torus_groups(world, max_chain)
        assert [s.group for s in steps] == [r, *(3 + c for _ in middle), 7 + r]
        assert all(groups[s.group] == s.members for s in steps)


def test_reference_is_rows_then_columns_in_chain_order() -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(999).astype(np.float32) for _ in range(6)]
    got = reference_torus_allreduce(inputs, ReduceOp.SUM, max_chain=3)
    rows = [
        reference_chain_allreduce(inputs[:3], ReduceOp.SUM),
        reference_chain_allreduce(inputs[3:], ReduceOp.SUM),
    ]
    for c in range(3):
        lo, hi = c * 999 // 3, (c + 1) * 999 // 3
        want = reference_chain_allreduce([rows[0][lo:hi], rows[1][lo:hi]], ReduceOp.SUM)
        assert got[lo:hi].tobytes() == want.tobytes()
    np.testing.assert_allclose(got, np.sum(inputs, axis=0), rtol=1e-5, atol=1e-5)
    # Below the limit it is the flat chain.
    assert (
        reference_torus_allreduce(inputs, ReduceOp.SUM).tobytes()
        == reference_chain_allreduce(inputs, ReduceOp.SUM).tobytes()
    )
