"""One progress thread per process (netdam.api._ProgressHub): a process playing several ranks
drives all of them from one thread, which ends once their calls are over and comes back
with the next call; the ranks' all-reduces stay exact meanwhile."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from netdam import api
from netdam.cluster.launch import LocalCluster, start_cluster


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


@pytest.mark.alone
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


def test_answers_another_thread_takes_wake_a_wait_asleep_on_the_socket(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A wait() checks its call, then sleeps in select() on the rank's socket. When another
    thread (the progress thread's turn, another wait) takes the completion in between, the
    socket is empty: without a wake-up the wait slept its whole 0.2 s turn. Forced here: the
    waiter's first select() runs only after a second thread took every answer. No progress
    thread here: on a loaded machine it took rank 0's completion while the test waited on rank
    1, and rank 0's wait() then never reached select(). And no poll before the sleep (as if on
    1 core): the select() forced is the one that sleeps."""
    world = 2
    monkeypatch.setattr(api._HUB, "add", lambda root, wake=False: None)
    monkeypatch.setattr(api, "_CORES", 1)
    with start_cluster(world, memory=4 << 20) as cluster:
        groups = [api.ProcessGroup(cluster.info, r) for r in range(world)]
        try:
            bufs = [np.full(1000, r + 1.0, np.float32) for r in range(world)]
            works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs)]
            works[1].wait()
            work, group = works[0], groups[0]
            real_select = api.select.select
            forced: list[tuple[float, bool]] = []

            def select_after_a_theft(rlist, wlist, xlist, timeout=None):  # type: ignore[no-untyped-def]
                if threading.current_thread() is threading.main_thread() and not forced:
                    # The first answer may be the START_COLL's ACK, not the completion (a loaded
                    # machine): the thief takes answers until it took the completion.
                    deadline = time.monotonic() + 5.0
                    while not work.ended and time.monotonic() < deadline:
                        real_select(rlist, [], [], 5.0)  # an answer is in the socket now
                        thief = threading.Thread(target=group._step, args=(None, 0.0))
                        thief.start()
                        thief.join()  # it took the answers: the socket is empty again
                    assert work.ended
                    began = time.monotonic()
                    readable = real_select(rlist, wlist, xlist, timeout)[0]
                    forced.append((time.monotonic() - began, bool(readable)))
                    return readable, [], []
                return real_select(rlist, wlist, xlist, timeout)

            monkeypatch.setattr(api.select, "select", select_after_a_theft)
            work.wait()
            ((slept, woken),) = forced
            assert woken, f"the wait slept {slept:.3f} s on an empty socket"
            assert (bufs[0] == 3.0).all()
        finally:
            for g in groups:
                g.close()


def test_empty_datagrams_from_a_stranger_neither_end_nor_fail_a_call() -> None:
    """What wakes a wait is an empty datagram to the rank's socket, which anyone who reaches
    that socket may send too: it wakes the wait early, and nothing else."""
    world = 2
    with start_cluster(world, memory=4 << 20) as cluster:
        groups = [api.ProcessGroup(cluster.info, r) for r in range(world)]
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            target = groups[0].client.sock.getsockname()
            address = ("127.0.0.1" if target[0] == "0.0.0.0" else target[0], target[1])
            for round_ in range(3):
                bufs = [np.full(2000, r + round_, np.float32) for r in range(world)]
                works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs)]
                for _ in range(200):
                    stranger.sendto(b"", address)
                for work in works:
                    assert work is not None
                    work.wait(timeout=10.0)
                assert all((b == 1 + 2 * round_).all() for b in bufs), round_
        finally:
            stranger.close()
            for g in groups:
                g.close()


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The process *pid* stopped (SIGSTOP) for the block, and let go on after it whatever
    happened (SIGCONT)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _rank_0_beside_a_stopped_node(
    timeout_s: float | None = None,
) -> Iterator[tuple[LocalCluster, api.ProcessGroup]]:
    """Two NICs, a process each; rank 0's group, and node 1 stopped (SIGSTOP) until the end."""
    with start_cluster(2, memory=1 << 22, nics_per_process=1) as cluster:
        group = api.ProcessGroup(cluster.info, 0, timeout_s=timeout_s)
        try:
            with _stopped(cluster.info.nodes[1].pid):
                yield cluster, group
        finally:
            group.close()


def test_a_failure_the_progress_thread_reads_is_raised_by_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The progress thread reads a call's failure (its node's TIMEOUT NACK: the peer is stopped)
    while nobody waits. The error is built by the wait() begun after, in its own thread and
    outside the group's lock (it PINGs the nodes: 0.5 s with one stopped, during which the
    progress thread served no other rank of the process, and the lock held them all), and
    raised: before the outcome was read under the lock, such a wait returned as if the call
    had completed, its buffer never reduced."""
    real_failure = api.Work._failure
    built: list[tuple[str, bool]] = []

    def recorded_failure(self: api.Work, *args: object) -> api.CollectiveError:
        built.append((threading.current_thread().name, self.group._lock._is_owned()))  # type: ignore[attr-defined]  # RLock's own test of its owner
        return real_failure(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(api.Work, "_failure", recorded_failure)
    with _rank_0_beside_a_stopped_node(timeout_s=0.5) as (_, group):
        data = np.ones(1024, np.float32)
        work = api.all_reduce(data, group=group, async_op=True)
        assert work is not None
        deadline = time.monotonic() + 10.0
        while not work.ended and time.monotonic() < deadline:
            time.sleep(0.002)  # no wait(): only the progress thread reads the answers
        assert work.ended and work.nack is not None
        with pytest.raises(api.CollectiveError, match="TIMEOUT.*not answering: rank 1"):
            work.wait()
        assert built == [(threading.current_thread().name, False)]
        assert (data == 1).all()


def test_naming_the_silent_nodes_leaves_the_ranks_answers_on_its_socket() -> None:
    """dead_nodes() PINGs every node and waits up to 0.5 s for their answers (one node here is
    stopped: the whole wait); an answer to one of the rank's calls waiting on the rank's socket
    stays there for the call (the wait read it and dropped it)."""
    with _rank_0_beside_a_stopped_node() as (cluster, group):
        port = group.client.sock.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"an answer in flight", ("127.0.0.1", port))
        node = cluster.info.nodes[1]
        assert group.dead_nodes() == [
            f"rank 1 ({node.address}:{node.port}) [its process {node.pid} is stopped]"
        ]
        group.client.sock.settimeout(1.0)
        assert group.client.sock.recvfrom(64)[0] == b"an answer in flight"


def test_a_new_groups_first_call_returns_before_its_node_answers() -> None:
    """start() of a group's first call used to wait up to 1 s for its node's answer (to settle
    a STALE_EPOCH there). Rank 1's node is stopped here: its call returns at once all the same,
    and runs, exact, once the node goes on."""
    with start_cluster(2, memory=1 << 22, nics_per_process=1) as cluster:
        groups = [api.ProcessGroup(cluster.info, r) for r in range(2)]
        try:
            bufs = [np.full(1024, r + 1.0, np.float32) for r in range(2)]
            with _stopped(cluster.info.nodes[1].pid):
                began = time.monotonic()
                late = api.all_reduce(bufs[1], group=groups[1], async_op=True)
                assert time.monotonic() - began < 0.9  # the old wait took 1.0 s, to the microsecond
                assert late is not None and not late.started
            first = api.all_reduce(bufs[0], group=groups[0], async_op=True)
            for work in (first, late):
                assert work is not None
                work.wait(timeout=10.0)
            assert all((b == 3.0).all() for b in bufs)
        finally:
            for g in groups:
                g.close()


def test_new_groups_past_their_nodes_epoch_are_moved_on_by_the_progress_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups made again count from epoch 1, which their nodes ran: each node answers the first
    call STALE_EPOCH, and it must go again at the next epoch. One thread starts every rank's
    call, then waits on rank 0, whose chain needs the others running: the progress thread
    moves them on from their answers. The re-send timers are put out of reach (30 s), so a
    call moved on only by a re-send would leave rank 0 silent past its 10 s."""
    from netdam.core import host

    world = 4
    with start_cluster(world, memory=4 << 20) as cluster:
        for round_ in range(2):
            if round_ == 1:
                monkeypatch.setattr(host, "START_RESEND_S", 30.0)
                monkeypatch.setattr(host, "UNANSWERED_RESEND_S", 30.0)
            groups = [api.ProcessGroup(cluster.info, r) for r in range(world)]
            try:
                bufs = [np.full(3000, r + round_, np.float32) for r in range(world)]
                works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs)]
                for work in works:
                    assert work is not None
                    work.wait(timeout=10.0)
                assert all(w is not None and w.packet.epoch == round_ + 1 for w in works)
                want = sum(r + round_ for r in range(world))
                assert all((b == want).all() for b in bufs), round_
            finally:
                for g in groups:
                    g.close()


def test_the_ranks_of_a_process_failed_by_one_node_share_one_round_of_pings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node 2 stopped fails ranks 0 and 1, played by this process. Each error names it, from one
    round of PINGs (0.5 s with a node silent), not one round per rank's wait."""
    rounds: list[int] = []
    real_dead_nodes = api.ProcessGroup.dead_nodes

    def counted(self: api.ProcessGroup) -> list[str]:
        rounds.append(self.global_rank)
        return real_dead_nodes(self)

    monkeypatch.setattr(api.ProcessGroup, "dead_nodes", counted)
    monkeypatch.setattr(api, "NAMING_REUSE_S", 30.0)  # the two waits may be seconds apart here
    with start_cluster(3, memory=1 << 22, nics_per_process=1) as cluster:
        groups = [api.ProcessGroup(cluster.info, r, timeout_s=0.5) for r in range(2)]
        try:
            with _stopped(cluster.info.nodes[2].pid):
                works = [
                    api.all_reduce(np.ones(1024, np.float32), group=g, async_op=True)
                    for g in groups
                ]
                named = f"not answering: rank 2 ({cluster.info.nodes[2].address}:"
                for work in works:
                    assert work is not None
                    with pytest.raises(api.CollectiveError) as failed:
                        work.wait()
                    assert named in str(failed.value)
            assert len(rounds) == 1
        finally:
            for g in groups:
                g.close()


def test_a_node_that_dies_after_an_error_named_none_is_named_in_the_next() -> None:
    """An error that found every node answering keeps no answer for the next: a node silent
    from then on is named in the next error, however soon it comes."""
    with start_cluster(2, memory=1 << 22, nics_per_process=1) as cluster:
        group = api.ProcessGroup(cluster.info, 0, timeout_s=0.5)
        try:
            with pytest.raises(api.CollectiveError, match="OUT_OF_BOUNDS") as first:
                api.all_reduce(np.ones(1024, np.float32), group=group, update=(1 << 40, 1))
            assert "not answering" not in str(first.value)
            with (
                _stopped(cluster.info.nodes[1].pid),
                pytest.raises(api.CollectiveError, match="not answering: rank 1"),
            ):
                api.all_reduce(np.ones(1024, np.float32), group=group)
        finally:
            group.close()


def test_only_a_process_playing_every_rank_polls_before_it_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait() polls its socket before sleeping (api.HOST_SPIN_S) only where this process
    plays every rank of a group no wider than the machine's cores: one rank per process, each
    polling, took the cores their NICs needed (examples/ddp_train.py, 2 ranks)."""
    monkeypatch.setattr(api, "_CORES", 2)
    with start_cluster(2, memory=4 << 20) as cluster:
        first = api.ProcessGroup(cluster.info, 0)
        try:
            assert not first._polls_before_sleeping()  # rank 1 is another process's
            second = api.ProcessGroup(cluster.info, 1)
            try:
                assert first._polls_before_sleeping() and second._polls_before_sleeping()
                monkeypatch.setattr(api, "_CORES", 1)
                api._POLLS.clear()  # the answers are kept while the process's ranks stay
                assert not first._polls_before_sleeping()  # 2 ranks on 1 core
                monkeypatch.setattr(api, "_CORES", 2)
                api._POLLS.clear()
                # Only the waits of small calls poll (api.HOST_POLL_MAX_BYTES): a large one's
                # answer seldom comes within the poll.
                polled: dict[int, set[bool]] = {}
                real_step = api.ProcessGroup._step
                size = 0  # the progress thread may step before the first call

                def step(group, timeout, wait_s, poll=False):  # type: ignore[no-untyped-def]
                    polled.setdefault(size, set()).add(poll)
                    return real_step(group, timeout, wait_s, poll)

                monkeypatch.setattr(api.ProcessGroup, "_step", step)
                for size in (1000, 1 << 18):  # 4 KB and 1 MiB of float32 per rank
                    bufs = [np.full(size, r + 1.0, np.float32) for r in range(2)]
                    pair = zip((first, second), bufs)
                    works = [api.all_reduce(b, group=g, async_op=True) for g, b in pair]
                    for work in works:
                        work.wait()
                    assert all((b == 3.0).all() for b in bufs)
                assert True in polled[1000] and True not in polled[1 << 18], polled
            finally:
                second.close()
            assert not first._polls_before_sleeping()  # rank 1's arena let go
        finally:
            first.close()
