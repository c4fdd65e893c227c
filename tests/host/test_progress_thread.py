"""One progress thread per process (netdam.api._ProgressHub): a process playing several ranks
drives all of them from one thread, which ends once their calls are over and comes back
with the next call; the ranks' all-reduces stay exact meanwhile."""

from __future__ import annotations

import threading
import time

import numpy as np

from netdam import api
from netdam.cluster.launch import start_cluster


def _progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "netdam-progress" and t.is_alive()]


def test_ranks_of_one_process_share_one_progress_thread() -> None:
    world = 4
    with start_cluster(world, memory=4 << 20) as cluster:
        groups = [api.ProcessGroup(cluster.info, r) for r in range(world)]
        try:
            for round_ in range(2):
                bufs = [np.full(5000, r + 1.0, np.float32) for r in range(world)]
                works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs)]
                assert len(_progress_threads()) == 1
                for work in works:
                    assert work is not None
                    work.wait()
                assert all((b == 10.0).all() for b in bufs), round_
                deadline = time.monotonic() + api.PROGRESS_LINGER_S + 2.0
                while _progress_threads() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not _progress_threads()  # gone after the linger; the next call restarts it
        finally:
            for g in groups:
                g.close()
