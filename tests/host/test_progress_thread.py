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


def test_groups_closed_and_opened_under_a_running_thread_are_still_driven() -> None:
    """The thread keeps one epoll set across its turns. Groups closed while it runs leave it,
    and their descriptor numbers come back as the new groups' sockets: those must be watched
    (a torus all-reduce needs its sockets watched to start its next step), the old ones gone."""
    world, max_chain = 8, 4  # 2 x 4: a torus, whose steps the progress thread starts
    with start_cluster(world, memory=4 << 20) as cluster:
        for round_ in range(3):
            groups = [api.ProcessGroup(cluster.info, r, max_chain=max_chain) for r in range(world)]
            try:
                bufs = [np.full(3000, r + round_, np.float32) for r in range(world)]
                works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs)]
                started = time.monotonic()
                for work in works:
                    assert work is not None
                    work.wait(timeout=10.0)
                want = sum(r + round_ for r in range(world))
                assert all((b == want).all() for b in bufs), round_
                # Driven from the sockets: ~15 ms here. With the new sockets left out of the
                # set, the steps wait for a timer turn and a call took 1-2 s.
                assert time.monotonic() - started < 0.6, round_
            finally:
                for g in groups:
                    g.close()
            assert len(_progress_threads()) <= 1
