"""The machine's node processes share their loops' pass lengths (netdam.shell.turns): a NIC's
timers cover the longest pass of any process of its cluster on the machine, since a chain's ACK
may come from a NIC of another process. Only a file of this user that nobody else may write is
used: another user could slow a cluster's loss recovery by publishing long passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from netdam.shell.turns import IN_PASS_STALE_S, TurnBoard

MEMBERS = (("127.0.0.1", 21000), ("127.0.0.1", 21001), ("127.0.0.1", 21002), ("127.0.0.1", 21003))


def test_each_process_sees_the_longest_pass_any_published(tmp_path: Path) -> None:
    first = TurnBoard.open(tmp_path, MEMBERS, 4, 0)
    second = TurnBoard.open(tmp_path, MEMBERS, 4, 2)
    assert first is not None and second is not None
    try:
        assert first.path == second.path  # one file for the cluster
        assert second.longest(10.0, 1.0) == 0.0  # nothing published yet
        first.publish(0.2, 10.0)
        second.publish(0.01, 10.0)
        assert second.longest(10.0, 1.0) == pytest.approx(0.2)
        assert first.longest(11.0, 1.0) == pytest.approx(0.1)  # halved after a half-life
        # Another cluster (other members) has a board of its own.
        other = TurnBoard.open(tmp_path, MEMBERS[:2], 2, 0)
        assert other is not None and other.path != first.path and other.longest(10.0, 1.0) == 0.0
        other.close()
    finally:
        first.close()
        second.close()
    assert not first.path.exists()


def test_the_board_counts_the_processes_that_published(tmp_path: Path) -> None:
    """Each node process writes the row of its first NIC's rank: the rows written are the
    cluster's node processes on this machine (nic_host spins only while they fit the cores)."""
    first = TurnBoard.open(tmp_path, MEMBERS, 4, 0)
    second = TurnBoard.open(tmp_path, MEMBERS, 4, 2)
    assert first is not None and second is not None
    try:
        assert first.processes() == 1  # none yet: this process at least
        first.publish(0.01, 10.0)
        assert second.processes() == 1
        second.publish(0.02, 10.0)
        assert first.processes() == second.processes() == 2
    finally:
        first.close()
        second.close()


def _board_path(tmp_path: Path) -> Path:
    """Where the cluster's board lives (nothing there now): what an attacker plants."""
    board = TurnBoard.open(tmp_path, MEMBERS, 4, 0)
    assert board is not None
    board.close()
    return board.path


def test_a_file_others_may_write_is_not_used(tmp_path: Path) -> None:
    path = _board_path(tmp_path)
    path.write_bytes(b"\0" * 64)
    path.chmod(0o666)  # planted, writable by anyone: long passes could be published into it
    assert TurnBoard.open(tmp_path, MEMBERS, 4, 1) is None


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_a_file_of_another_user_is_not_used(tmp_path: Path) -> None:
    path = _board_path(tmp_path)
    path.write_bytes(b"\0" * 64)
    os.chown(path, 65534, 65534)  # nobody's (mode 0644), planted before the cluster started
    assert TurnBoard.open(tmp_path, MEMBERS, 4, 1) is None


def test_a_symlink_in_its_place_is_not_followed(tmp_path: Path) -> None:
    path = _board_path(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    path.symlink_to(target)
    assert TurnBoard.open(tmp_path, MEMBERS, 4, 0) is None
    assert target.read_bytes() == b"keep"


def test_a_pass_in_progress_counts_for_its_length_so_far(tmp_path: Path) -> None:
    """A datagram for a process in a long pass waits from the pass's start, before the pass is
    published: the others' timers cover the pass while it runs, until it looks stopped."""
    first = TurnBoard.open(tmp_path, MEMBERS, 4, 0)
    second = TurnBoard.open(tmp_path, MEMBERS, 4, 2)
    assert first is not None and second is not None
    try:
        first.publish(0.01, 10.0)
        first.begin(10.0)
        assert second.longest(10.05, 1.0) == pytest.approx(0.05)  # 50 ms into its pass
        first.publish(0.06, 10.06)  # the pass ended: its length is published instead
        assert second.longest(10.06, 1.0) == pytest.approx(0.06)
        first.begin(20.0)
        stopped = 20.0 + IN_PASS_STALE_S + 0.1
        assert second.longest(stopped, 1.0) < 0.001  # stopped or dead: only its old, halved turn
    finally:
        first.close()
        second.close()
