"""All-reduce over more NICs than one SR list names: a 2-D torus of chains (SPEC.md 4.2).

A collective's SR list names at most MAX_SEGMENTS (64) NICs. Past that, a group of N ranks is
laid out as ``rows`` rows of ``size`` consecutive ranks (N = rows x size, both at most the chain
limit), and an all-reduce is three collectives of sub-groups, one after another on each rank:

1. a chained reduce-scatter along the rank's row: member c of a row holds block c of the row's
   sum (elements ``c * count // size`` up to ``(c + 1) * count // size``);
2. a chained all-reduce of that block along the rank's column (the members holding block c in
   every row): each holds block c of the whole sum;
3. a multicast all-gather along the row: every member holds the whole sum.

Each datum crosses 2 (size - 1) / size + 2 (rows - 1) / (rows x size) of the buffer, which is a
flat chain's 2 (N - 1) / N, with chains of at most 64 hops; it is the scheme the NetDAM authors
propose for torus fabrics, and ``netdam-chain-2d`` in the cycle model (fpga_model/collectives.py)
costs the same three phases. The result is exact and the same bits on every rank: every row
reduces in its chain order, every column adds the same rows' blocks in its chain order
(``reference_torus_allreduce`` in netdam.tools.allreduce).

Rows must be equal: block c must mean the same elements in every row. A rank count with no
divisor between ``ceil(N / 64)`` and 64 (67, a prime past 64, or 134) is refused with the nearest
counts that split. This module is the plan alone, as data; ``netdam.api`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from netdam.protocol.constants import MAX_SEGMENTS
from netdam.protocol.payloads import Algo


@dataclass(frozen=True)
class TorusStep:
    """One collective of a rank's torus all-reduce: over which of the group's ranks (group
    ranks, in chain order), in which sub-group (its index in torus_groups), which algorithm,
    and where in the buffer (elements)."""

    members: tuple[int, ...]
    group: int
    algo: Algo
    in_offset: int
    out_offset: int
    count: int


def splits(world: int, max_chain: int = MAX_SEGMENTS) -> bool:
    """Whether *world* ranks form a torus of rows and columns of at most *max_chain*."""
    return world >= 1 and _rows(world, max_chain) is not None


def _rows(world: int, max_chain: int) -> int | None:
    """The rows of the torus: 1 when one chain names every rank, else the most square split
    into equal rows of at most *max_chain* ranks, at most *max_chain* rows (the fewer rows of
    two alike); None: there is none."""
    if world <= max_chain:
        return 1
    rows = [r for r in range(-(-world // max_chain), max_chain + 1) if world % r == 0]
    return min(rows, key=lambda r: (r + world // r, r)) if rows else None


def torus_shape(world: int, max_chain: int = MAX_SEGMENTS) -> tuple[int, int]:
    """(rows, size) of the torus of *world* ranks: (1, world) when one chain names them all,
    else the most square split into equal rows of at most *max_chain* ranks, with at most
    *max_chain* rows (rows + size smallest; of two alike, the fewer rows). Every shape moves
    the same bytes per rank (2 - 2/N of the buffer); the square one has the shortest chains
    (size + rows hops, one after the other) and the fewest DONE and STARTED datagrams, which
    every member of a row or column multicasts to all the others: ~N (rows + size) per call.
    Measured on 2 cores, 256 NICs x 1 MiB: 16 x 16 took 0.468-0.472 s a call, 4 x 64
    0.494-0.495 s (docs/PERFORMANCE.md)."""
    if world < 1 or max_chain < 2:
        raise ValueError(f"a torus needs at least 1 rank and chains of 2, got {world}, {max_chain}")
    rows = _rows(world, max_chain)
    if rows is not None:
        return rows, world // rows
    most = max_chain * max_chain
    if world > most:
        raise ValueError(
            f"an all-reduce spans at most {most} ranks ({max_chain} x {max_chain}, SPEC.md 4.2), "
            f"not {world}"
        )
    below = next(n for n in range(world - 1, 0, -1) if _rows(n, max_chain) is not None)
    above = next((n for n in range(world + 1, most + 1) if _rows(n, max_chain) is not None), None)
    near = f"{below}" + (f" or {above}" if above is not None else "")
    raise ValueError(
        f"an all-reduce over {world} ranks needs chains over groups (one SR list names at most "
        f"{max_chain}), and {world} does not split into equal rows and columns of at most "
        f"{max_chain} (SPEC.md 4.2): use {near} ranks (new_group), or split the job"
    )


def torus_groups(world: int, max_chain: int = MAX_SEGMENTS) -> list[tuple[int, ...]]:
    """The sub-groups of the torus, as group ranks, in the order in which every rank makes them
    (new_group numbers groups in the order they are made): the rows (their reduce-scatters),
    the columns, then the rows again (their all-gathers). A row's two steps are groups of their
    own, so every sub-group repeats one collective call after call, and a node starts each
    call after the first in its datapath (SPEC.md 4.1, "Restart in the datapath"), where one
    group alternating a reduce-scatter and an all-gather sent every step through the control
    plane; a torus takes three of a node's four collective slots."""
    rows, size = torus_shape(world, max_chain)
    row_groups = [tuple(range(r * size, (r + 1) * size)) for r in range(rows)]
    columns = [tuple(c + r * size for r in range(rows)) for c in range(size)]
    return row_groups + columns + row_groups


def torus_steps(
    world: int, rank: int, count: int, max_chain: int = MAX_SEGMENTS
) -> list[TorusStep]:
    """The collectives group rank *rank* runs, in order, for an all-reduce of *count* elements
    (SPEC.md 4.2). A column whose block is empty (fewer elements than a row has members) has
    nothing to add and skips its chain on every member alike."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    rows, size = torus_shape(world, max_chain)
    r, c = divmod(rank, size)
    row = tuple(range(r * size, (r + 1) * size))
    column = tuple(c + k * size for k in range(rows))
    lo, hi = c * count // size, (c + 1) * count // size
    # The sub-groups' indices in torus_groups: row r, column c, row r's gathers.
    steps = [TorusStep(row, r, Algo.REDUCE_SCATTER, 0, 0, count)]
    if hi > lo:
        steps.append(TorusStep(column, rows + c, Algo.ALL_REDUCE, lo, lo, hi - lo))
    steps.append(TorusStep(row, rows + size + r, Algo.ALL_GATHER, lo, 0, count))
    return steps


def longest_chain(world: int, max_chain: int = MAX_SEGMENTS) -> int:
    """Members of the longest SR list an all-reduce over *world* ranks sends (its MTU needs room
    for it, core.chunk_plan.min_mtu)."""
    if world <= max_chain:
        return world
    rows, size = torus_shape(world, max_chain)
    return max(rows, size)
