"""The node's rkey table (open addressing, linear probing; kernels/wire.py): the datapath adds
a restarted collective's key and removes an ended one's (kernels/restart.py) without a rebuild,
so a deletion must keep every other key's probe sequence whole (backward shift). Checked
against a dict over random inserts and deletes, crowded tables and wrapped probe runs."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.kernels.state import Regions
from netdam.kernels.wire import add_rkey, find_rkey, install_rkey, remove_rkey, uninstall_rkey


def table(slots: int) -> Regions:
    return Regions(
        np.zeros(slots, np.uint32),
        np.zeros(slots, np.int64),
        np.zeros(slots, np.int64),
        np.zeros(slots, np.uint8),
        np.zeros((slots, 2), np.uint64),
    )


def check(regions: Regions, held: dict[int, int]) -> None:
    assert int(np.count_nonzero(regions.key)) == len(held)
    for key, base in held.items():
        entry = find_rkey(regions.key, key)
        assert entry >= 0, f"key {key:#x} lost"
        assert regions.base[entry] == base and regions.len[entry] == base + 1
        assert regions.rights[entry] == base % 7 and regions.tag[entry, 0] == base


@pytest.mark.parametrize("seed", range(8))
def test_adds_and_removes_keep_every_probe_sequence(seed: int) -> None:
    rng = np.random.default_rng(seed)
    regions, held = table(16), {}
    for step in range(2000):
        if held and (len(held) >= 15 or rng.random() < 0.45):
            key = int(rng.choice(list(held)))
            assert remove_rkey(regions, key)
            del held[key]
            assert find_rkey(regions.key, key) == -1
            assert not remove_rkey(regions, key)  # gone: nothing to remove
        else:
            # Few distinct homes (keys 1..40 in 16 entries): long runs that wrap the table.
            key = int(rng.integers(1, 41))
            added = add_rkey(regions, key, step, step + 1, step % 7)
            assert added == (key not in held)
            if added:
                entry = find_rkey(regions.key, key)
                regions.tag[entry, 0] = step  # the tag row moves with its key
                held[key] = step
        check(regions, held)


def test_a_full_table_takes_no_more() -> None:
    regions = table(4)
    assert all(add_rkey(regions, key, key, key + 1, key % 7) for key in (1, 2, 3, 4))
    assert not add_rkey(regions, 5, 5, 6, 5)
    assert remove_rkey(regions, 3) and add_rkey(regions, 5, 5, 6, 5)


def test_the_checked_entries_refuse_what_the_kernels_would_not_check() -> None:
    """install_rkey / uninstall_rkey (the node's Python side) check before the kernels run."""
    regions = table(8)
    install_rkey(regions, 0xDEAD, (64, 128, 3), bytes(range(1, 17)))
    entry = find_rkey(regions.key, 0xDEAD)
    assert regions.base[entry] == 64 and regions.len[entry] == 128 and regions.rights[entry] == 3
    assert regions.tag[entry].tobytes() == bytes(range(1, 17))
    with pytest.raises(ValueError, match="already in the table"):
        install_rkey(regions, 0xDEAD, (0, 1, 1))
    for bad in (0, 1 << 32):
        with pytest.raises(ValueError, match="out of range"):
            install_rkey(regions, bad, (0, 1, 1))
    with pytest.raises(ValueError, match="not 16"):
        install_rkey(regions, 7, (0, 1, 1), b"short")
    with pytest.raises(ValueError, match="power of two"):
        install_rkey(table(6), 7, (0, 1, 1))
    assert uninstall_rkey(regions, 0xDEAD) and not uninstall_rkey(regions, 0xDEAD)
    assert find_rkey(regions.key, 0xDEAD) == -1
