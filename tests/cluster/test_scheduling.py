"""Node processes run under SCHED_BATCH unless told otherwise (netdam.shell.startup.SCHEDULING):
a NIC woken by its host's datagram must not preempt that host on a shared core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netdam.cli.main import main
from netdam.cluster.clusterfile import load_cluster
from netdam.cluster.launch import start_cluster
from netdam.shell.process import ServedProcess, serve_main
from netdam.shell.startup import restore_scheduling, use_scheduling

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux policy"
)


def _policies(pids: set[int]) -> set[int]:
    """The scheduling policy of every thread of *pids*."""
    return {
        os.sched_getscheduler(int(task)) for pid in pids for task in os.listdir(f"/proc/{pid}/task")
    }


def test_node_processes_run_as_batch_by_default() -> None:
    with start_cluster(3, memory=1 << 20, nics_per_process=2) as cluster:
        pids = {n.pid for n in cluster.info.nodes}
        assert len(pids) == 2
        assert _policies(pids) == {os.SCHED_BATCH}


def test_normal_scheduling_keeps_the_default_policy() -> None:
    with start_cluster(2, memory=1 << 20, scheduling="normal") as cluster:
        assert _policies({n.pid for n in cluster.info.nodes}) == {os.SCHED_OTHER}


@pytest.mark.slow
def test_up_passes_scheduling_to_the_node_command(tmp_path: Path) -> None:
    """A detached `netdam up` starts `netdam node` processes: the flag reaches their argv."""
    path = tmp_path / "c.toml"
    up = [sys.executable, "-m", "netdam", "up", "--nodes", "2", "--memory", "1MiB"]
    subprocess.run(
        [*up, "--detach", "--cluster", str(path), "--scheduling", "normal"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        assert _policies({n.pid for n in load_cluster(path).nodes}) == {os.SCHED_OTHER}
    finally:
        subprocess.run(
            [sys.executable, "-m", "netdam", "down", "--cluster", str(path)],
            check=True,
            capture_output=True,
            timeout=60,
        )


def test_an_unknown_policy_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--nodes", "2", "--scheduling", "fifo"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice: 'fifo'" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="one of batch, normal"):
        use_scheduling("fifo")


def test_a_node_served_inside_another_program_gives_its_policy_back() -> None:
    """serve_main sets the policy for its life and puts the caller's back, even on an error."""
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    seen: list[int] = []

    def create() -> ServedProcess:
        seen.append(os.sched_getscheduler(0))
        raise ValueError("no such node")

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert serve_main(create, lambda proc: "", with_parent=False, scheduling="batch") == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert seen == [os.SCHED_BATCH] and os.sched_getscheduler(0) == os.SCHED_OTHER
    before = use_scheduling("batch")
    try:
        assert before == os.SCHED_OTHER and os.sched_getscheduler(0) == os.SCHED_BATCH
    finally:
        restore_scheduling(before)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
