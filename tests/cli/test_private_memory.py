"""A private cluster's run is checked against the machine before any node starts
(netdam.cli.private_memory): node memory against /dev/shm's free space, and with the run's
host copies against the memory the kernel says is available. Past either, the kernel's OOM
killer would end the run mid-way with a bare "Killed"."""

from __future__ import annotations

from pathlib import Path

import pytest

from netdam.cli import private_memory
from netdam.cli.private_memory import HOST_COPIES_PER_RANK, check_private_memory, memory_available
from netdam.outcome import CommandError, ExitCode
from netdam.tools.allreduce import private_node_memory
from netdam.units import parse_size

MIB, GIB = 1 << 20, 1 << 30


def _need(nodes: int, nbytes: int) -> int:
    """What the check counts against available memory."""
    return nodes * (private_node_memory(nbytes) + HOST_COPIES_PER_RANK * nbytes)


def _suggested_size(message: str) -> int:
    return parse_size(message.split("give --size ")[1].split(" ")[0])


def test_a_run_that_fits_both_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    check_private_memory(
        8, 256 * MIB, free=8 * private_node_memory(256 * MIB), available=_need(8, 256 * MIB)
    )
    # Where the machine does not say (no /proc/meminfo, no such directory), the node decides.
    monkeypatch.setattr(private_memory, "shm_free", lambda directory: None)
    monkeypatch.setattr(private_memory, "memory_available", lambda: None)
    check_private_memory(8, 1 << 40)


def test_node_memory_past_dev_shm_names_a_size_that_fits() -> None:
    free = 10 * GIB
    with pytest.raises(CommandError) as caught:
        check_private_memory(4, 4 * GIB, free=free, available=1 << 50)
    message = str(caught.value)
    assert caught.value.code == ExitCode.USAGE
    assert "/dev/shm" in message and "10.0 GiB free" in message, message
    assert 4 * private_node_memory(_suggested_size(message)) <= free


def test_memory_past_what_is_available_names_a_size_and_fewer_nodes_that_fit() -> None:
    """/dev/shm would hold it (a tmpfs is sized by default at half of RAM, whatever else runs),
    the machine's available memory would not: 8 x 512 MiB with 22 GiB available."""
    available = 22 * GIB
    with pytest.raises(CommandError) as caught:
        check_private_memory(8, 512 * MIB, free=1 << 50, available=available)
    message = str(caught.value)
    assert f"{_need(8, 512 * MIB) / GIB:.1f} GiB of memory" in message, message
    assert "22.0 GiB available" in message, message
    assert _need(8, _suggested_size(message)) <= available
    fewer = int(message.split("--nodes ")[1].split(",")[0])
    assert _need(fewer, 512 * MIB) <= available < _need(fewer + 1, 512 * MIB)


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   22000000 kB\n")
    assert memory_available(meminfo) == 22000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert memory_available(meminfo) is None
    assert memory_available(tmp_path / "missing") is None
