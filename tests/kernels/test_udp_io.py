"""The batched UDP kernels (netdam/kernels/udp_io.py) and socket setup (netdam/shell/udp.py) on real
loopback sockets. Ports come from binding port 0; every wait is bounded."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from netdam.kernels import udp_io as U
from netdam.protocol.packet import endpoint_to_u64
from netdam.shell.udp import (
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    check_mtu_fits,
    granted_buffers,
    join_multicast,
    leave_multicast,
    open_udp_socket,
    pin_multicast_sender,
)

LO = "127.0.0.1"
MAX_N = 1024


class Receiver:
    """A socket plus receive arrays; ``take(count)`` gathers datagrams until it has *count*."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = np.zeros(64 << 16, np.uint8)
        self.offs = np.zeros(MAX_N, np.int64)
        self.lens = np.zeros(MAX_N, np.int32)
        self.srcs = np.zeros(MAX_N, np.uint64)
        self.state = U.new_state()

    @property
    def endpoint(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return host, port

    def take(self, count: int, timeout: float = 2.0) -> list[tuple[bytes, int]]:
        got: list[tuple[bytes, int]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            n = U.recv_batch_kernel(
                self.sock.fileno(), self.buf, self.offs, self.lens, self.srcs, MAX_N, 50, self.state
            )
            for k in range(n):
                o, ln = int(self.offs[k]), int(self.lens[k])
                got.append((bytes(self.buf[o : o + ln]), int(self.srcs[k])))
        return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def pair() -> tuple[socket.socket, Receiver]:
    tx = open_udp_socket((LO, 0), rcvbuf=1 << 20, gro=False)
    rx = Receiver(open_udp_socket((LO, 0), rcvbuf=8 << 20))
    yield tx, rx
    tx.close()
    rx.close()


def send(sock: socket.socket, datagrams: list[tuple[bytes, tuple[str, int]]], packed: bool = True):
    """Lay *datagrams* out in one buffer (back to back when *packed*, else with gaps) and send
    them with send_batch_kernel; returns (done, state)."""
    gap = 0 if packed else 8
    offs, pos = [], 0
    for data, _ in datagrams:
        offs.append(pos)
        pos += len(data) + gap
    buf = np.zeros(max(pos, 1), np.uint8)
    for (data, _), o in zip(datagrams, offs):
        buf[o : o + len(data)] = np.frombuffer(data, np.uint8)
    state = U.new_state()
    done = U.send_batch_kernel(
        sock.fileno(),
        buf,
        np.array(offs, np.int64),
        np.array([len(d) for d, _ in datagrams], np.int32),
        np.array([endpoint_to_u64(dst) for _, dst in datagrams], np.uint64),
        len(datagrams),
        U.new_send_scratch(),
        state,
    )
    return int(done), state


def payloads(count: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]


def test_gso_run_arrives_as_seven_datagrams(pair) -> None:
    tx, rx = pair
    data = payloads(7, 8972, 1)
    done, state = send(tx, [(d, rx.endpoint) for d in data])
    assert done == 7
    assert state[U.ST_GSO_RUNS] == 1 and state[U.ST_SEND_CALLS] == 1  # one sendmmsg, one run
    got = rx.take(7)
    assert [g[0] for g in got] == data
    assert {g[1] for g in got} == {endpoint_to_u64(tx.getsockname())}
    assert rx.state[U.ST_GRO_RUNS] == 1  # coalesced: one message carried all seven
    # Zero copy: the run's datagrams lie back to back in the receive buffer.
    assert list(np.diff(rx.offs[:7])) == [8972] * 6


def test_gso_run_with_shorter_last_segment(pair) -> None:
    tx, rx = pair
    data = payloads(6, 8972, 2) + payloads(1, 100, 3)
    done, state = send(tx, [(d, rx.endpoint) for d in data])
    assert done == 7 and state[U.ST_GSO_RUNS] == 1
    assert [g[0] for g in rx.take(7)] == data


def test_mixed_sizes_and_destinations() -> None:
    tx = open_udp_socket((LO, 0), gro=False)
    a = Receiver(open_udp_socket((LO, 0)))
    b = Receiver(open_udp_socket((LO, 0)))
    try:
        sizes_dsts = [
            (1000, a),
            (1000, a),
            (1000, a),  # one GSO run
            (500, b),
            (500, b),  # another destination: a second run
            (700, a),  # a lone datagram
            (1200, b),
            (1200, b),
            (300, b),  # a run whose last segment is shorter
            (1300, b),  # longer than the run's segment size: starts a new message
            (64, a),
            (65, a),  # longer after shorter: two messages
        ]
        data = payloads(len(sizes_dsts), 1300, 4)
        datagrams = [(d[:size], r.endpoint) for d, (size, r) in zip(data, sizes_dsts)]
        done, state = send(tx, datagrams)
        assert done == len(datagrams)
        assert state[U.ST_TX_DATAGRAMS] == len(datagrams)
        assert state[U.ST_GSO_RUNS] == 3
        assert state[U.ST_SEND_CALLS] == 1  # every message in one sendmmsg
        want_a = [d for d, (_, r) in zip(datagrams, sizes_dsts) if r is a]
        want_b = [d for d, (_, r) in zip(datagrams, sizes_dsts) if r is b]
        assert [g[0] for g in a.take(len(want_a))] == [d for d, _ in want_a]
        assert [g[0] for g in b.take(len(want_b))] == [d for d, _ in want_b]
    finally:
        tx.close()
        a.close()
        b.close()


def test_datagrams_with_gaps_are_sent_one_by_one(pair) -> None:
    tx, rx = pair
    data = payloads(5, 2000, 5)
    done, state = send(tx, [(d, rx.endpoint) for d in data], packed=False)
    assert done == 5 and state[U.ST_GSO_RUNS] == 0
    assert [g[0] for g in rx.take(5)] == data


def test_non_gro_sender_and_non_gro_receiver() -> None:
    plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    plain.bind((LO, 0))
    rx = Receiver(open_udp_socket((LO, 0)))
    no_gro = Receiver(open_udp_socket((LO, 0), gro=False))
    gso_tx = open_udp_socket((LO, 0), gro=False)
    try:
        data = payloads(5, 3000, 6)
        for d in data:  # one datagram per sendto: no cmsg at the receiver, one each
            plain.sendto(d, rx.endpoint)
        got = rx.take(5)
        assert [g[0] for g in got] == data
        assert {g[1] for g in got} == {endpoint_to_u64(plain.getsockname())}
        assert rx.state[U.ST_GRO_RUNS] == 0
        # A GSO run to a socket without UDP_GRO is split by the kernel: still 7 datagrams.
        run = payloads(7, 8972, 7)
        done, _ = send(gso_tx, [(d, no_gro.endpoint) for d in run])
        assert done == 7
        assert [g[0] for g in no_gro.take(7)] == run
        assert no_gro.state[U.ST_GRO_RUNS] == 0
    finally:
        plain.close()
        rx.close()
        no_gro.close()
        gso_tx.close()


def test_so_rxq_ovfl_counts_kernel_drops() -> None:
    rx = Receiver(open_udp_socket((LO, 0), rcvbuf=4096))
    flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        data = bytes(1400)
        for _ in range(3):
            for _ in range(300):
                flood.sendto(data, rx.endpoint)
            rx.take(MAX_N, timeout=0.2)  # drain
            # The drop count rides on datagrams queued after the drops (socket(7)).
            flood.sendto(data, rx.endpoint)
            rx.take(1, timeout=1.0)
            if rx.state[U.ST_KERNEL_DROPS] > 0:
                break
        assert rx.state[U.ST_KERNEL_DROPS] > 0
    finally:
        rx.close()
        flood.close()


def test_multicast_three_members_receive_one_gso_run() -> None:
    group = f"239.77.{random.randint(100, 250)}.{random.randint(1, 250)}"
    first = open_udp_socket((group, 0), reuse_addr=True)
    port = first.getsockname()[1]
    members = [Receiver(first)] + [
        Receiver(open_udp_socket((group, port), reuse_addr=True)) for _ in range(2)
    ]
    tx = open_udp_socket((LO, 0), gro=False)
    try:
        for m in members:
            join_multicast(m.sock, group)
        pin_multicast_sender(tx)
        run = payloads(7, 8972, 8)
        done, state = send(tx, [(d, (group, port)) for d in run])
        assert done == 7 and state[U.ST_GSO_RUNS] == 1
        for m in members:
            got = m.take(7)
            assert [g[0] for g in got] == run
            assert {g[1] for g in got} == {endpoint_to_u64((LO, tx.getsockname()[1]))}
        for m in members:
            leave_multicast(m.sock, group)
            leave_multicast(m.sock, group)  # twice: harmless
    finally:
        tx.close()
        for m in members:
            m.close()


def test_join_refuses_a_unicast_group() -> None:
    with open_udp_socket((LO, 0)) as s, pytest.raises(ValueError, match="not a multicast"):
        join_multicast(s, "127.0.0.2")


def test_pmtudisc_do_and_oversize_datagram_fails_cleanly(pair) -> None:
    tx, rx = pair
    assert tx.getsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER) == IP_PMTUDISC_DO
    good = payloads(2, 1000, 9)
    # 70000 bytes fit no IPv4 datagram (nor any MTU): EMSGSIZE, counted, and the batch goes on.
    datagrams = [(good[0], rx.endpoint), (bytes(70000), rx.endpoint), (good[1], rx.endpoint)]
    done, state = send(tx, datagrams, packed=False)
    assert done == 3
    assert state[U.ST_SEND_ERRNO] == errno.EMSGSIZE
    assert state[U.ST_SEND_DROPPED] == 1
    assert state[U.ST_TX_DATAGRAMS] == 2
    assert [g[0] for g in rx.take(2)] == good


def test_check_mtu_fits_names_the_flag() -> None:
    check_mtu_fits(9000, 8972)
    with pytest.raises(ValueError, match="--mtu 9001"):
        check_mtu_fits(9000, 8973)


def test_buffers_are_granted() -> None:
    with open_udp_socket((LO, 0), rcvbuf=8 << 20, sndbuf=4 << 20) as s:
        rcv, snd = granted_buffers(s)
        if os.geteuid() == 0:  # SO_RCVBUFFORCE: exactly double what was asked (socket(7))
            assert (rcv, snd) == (16 << 20, 8 << 20)
        else:
            assert rcv > 0 and snd > 0


def test_poll_and_recv_timeouts_are_bounded(pair) -> None:
    tx, rx = pair
    fd = rx.sock.fileno()
    t = time.monotonic()
    assert not U._poll_in(fd, 50)
    n = U.recv_batch_kernel(fd, rx.buf, rx.offs, rx.lens, rx.srcs, MAX_N, 50, rx.state)
    assert n == 0 and time.monotonic() - t < 1.0
    assert U.recv_batch_kernel(fd, rx.buf, rx.offs, rx.lens, rx.srcs, MAX_N, 0, rx.state) == 0
    send(tx, [(b"x" * 10, rx.endpoint)])
    assert U._poll_in(fd, 1000)
    assert U._poll_out(fd, 0)


def test_small_batch_counts_segments_it_cannot_hold(pair) -> None:
    tx, rx = pair
    send(tx, [(d, rx.endpoint) for d in payloads(7, 1000, 10)])
    assert U._poll_in(rx.sock.fileno(), 1000)
    n = U.recv_batch_kernel(rx.sock.fileno(), rx.buf, rx.offs, rx.lens, rx.srcs, 4, 100, rx.state)
    assert n == 4 and rx.state[U.ST_TRUNCATED] == 3


def test_a_receive_says_whether_it_may_have_left_datagrams_queued() -> None:
    """ST_RECV_FULL: 1 when a receive ran out of room with every message it offered taken (the
    serve loop reads that socket again at once), 0 when the socket gave fewer (drained)."""
    tx = open_udp_socket((LO, 0), rcvbuf=1 << 20, gro=False)
    sock = open_udp_socket((LO, 0), rcvbuf=8 << 20, gro=False)  # one datagram per message
    try:
        buf = np.zeros(2 * U.RUN_BYTES, np.uint8)  # room for two messages a call
        offs, lens = np.zeros(MAX_N, np.int64), np.zeros(MAX_N, np.int32)
        srcs, state = np.zeros(MAX_N, np.uint64), U.new_state()
        send(tx, [(d, sock.getsockname()) for d in payloads(5, 100, 11)], packed=False)
        assert U._poll_in(sock.fileno(), 1000)
        time.sleep(0.05)  # all five queued
        taken = []
        for _ in range(3):
            n = U.recv_batch_kernel(sock.fileno(), buf, offs, lens, srcs, MAX_N, 0, state)
            taken.append((n, int(state[U.ST_RECV_FULL])))
        assert taken == [(2, 1), (2, 1), (1, 0)]
        assert U.recv_batch_kernel(sock.fileno(), buf, offs, lens, srcs, MAX_N, 0, state) == 0
        assert state[U.ST_RECV_FULL] == 0
        send(tx, [(d, sock.getsockname()) for d in payloads(3, 100, 12)], packed=False)
        assert U._poll_in(sock.fileno(), 1000)
        time.sleep(0.05)
        # A batch of fewer than a run's 64 datagrams takes one message a call: room ran out.
        assert U.recv_batch_kernel(sock.fileno(), buf, offs, lens, srcs, 2, 0, state) == 1
        assert state[U.ST_RECV_FULL] == 1
    finally:
        tx.close()
        sock.close()


def test_now_ns_is_the_monotonic_clock() -> None:
    before = time.monotonic_ns()
    now = U.clock_ns()
    assert before <= now <= time.monotonic_ns()


@pytest.mark.slow
def test_kernels_load_from_cache_in_a_new_process() -> None:
    """cache=True really works (libc is called by symbol, not by a baked-in pointer): a fresh
    process loads every I/O kernel from the cache without compiling."""
    code = (
        "import numpy as np, socket\n"
        "from netdam.kernels import udp_io as U\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 0))\n"
        "s.setblocking(False)\n"
        "b = np.zeros(1 << 16, np.uint8); o = np.zeros(64, np.int64)\n"
        "ln = np.zeros(64, np.int32); a = np.zeros(64, np.uint64); st = U.new_state()\n"
        "U.recv_batch_kernel(s.fileno(), b, o, ln, a, 64, 0, st)\n"
        "U.send_batch_kernel(s.fileno(), b, o, ln, a, 0, U.new_send_scratch(), st)\n"
        "U._poll_in(s.fileno(), 0); U.clock_ns()\n"
        "fs = [U.recv_batch_kernel, U.send_batch_kernel, U._poll_in, U.clock_ns]\n"
        "print(sum(len(f.stats.cache_misses) for f in fs), sum(len(f.stats.cache_hits) for f in fs))\n"
    )
    for _ in range(2):  # the first run may compile (fresh checkout); the second must not
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
    misses, hits = map(int, out.stdout.split())
    assert misses == 0 and hits == 4


def gather(
    sock: socket.socket, heads: list[bytes], body: np.ndarray, pieces: list[tuple[int, int]], dst
) -> tuple[int, np.ndarray]:
    """send_gather datagrams header k + body[start:start + length] of pieces[k] to *dst*."""
    state = U.new_state()
    done = U.send_gather(
        sock.fileno(),
        np.frombuffer(b"".join(heads), np.uint8).copy(),
        len(heads[0]),
        body,
        np.array([p[0] for p in pieces], np.int64),
        np.array([p[1] for p in pieces], np.int32),
        endpoint_to_u64(dst),
        len(pieces),
        U.new_gather_scratch(),
        state,
    )
    return done, state


def test_gathered_datagrams_arrive_whole_in_gso_runs(pair) -> None:
    """Each datagram is its header then its slice of the body, sent with no copy between: 9
    of 8232 bytes and a shorter last one, out of order in the body, go as GSO runs of 7 (the
    64 KiB bound) and arrive as the datagrams the pieces make."""
    tx, rx = pair
    body = np.frombuffer(payloads(1, 10 * 8192, 4)[0], np.uint8).copy()
    pieces = [((k * 3 % 10) * 8192, 8192) for k in range(9)] + [(5, 100)]
    heads = [bytes([k]) * 40 for k in range(10)]
    done, state = gather(tx, heads, body, pieces, rx.endpoint)
    assert done == 10 and state[U.ST_TX_DATAGRAMS] == 10
    assert state[U.ST_GSO_RUNS] == 2  # 7 full, then 2 full and the shorter last one
    expected = [h + body[o : o + n].tobytes() for h, (o, n) in zip(heads, pieces, strict=True)]
    assert [g[0] for g in rx.take(10)] == expected


def test_send_gather_refuses_what_would_read_outside_its_arrays(pair) -> None:
    tx, rx = pair
    body = np.zeros(1000, np.uint8)
    with pytest.raises(ValueError, match="outside the body"):
        gather(tx, [bytes(40)], body, [(900, 101)], rx.endpoint)
    with pytest.raises(ValueError, match="outside the body"):
        gather(tx, [bytes(40)], body, [(-1, 10)], rx.endpoint)
    with pytest.raises(ValueError, match="largest UDP payload"):
        gather(tx, [bytes(40)], np.zeros(70000, np.uint8), [(0, 65500)], rx.endpoint)
    with pytest.raises(ValueError, match="do not fit"):
        U.send_gather(
            tx.fileno(),
            np.zeros(40, np.uint8),
            40,
            body,
            np.zeros(2, np.int64),
            np.ones(2, np.int32),
            endpoint_to_u64(rx.endpoint),
            2,  # two datagrams, one header
            U.new_gather_scratch(),
            U.new_state(),
        )
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        gather(tx, [bytes(40)], np.zeros(10, np.int32), [(0, 4)], rx.endpoint)
    assert rx.take(1, timeout=0.2) == []  # nothing was sent


def test_gathered_datagrams_of_mixed_sizes_arrive_in_order(pair) -> None:
    """Random sizes (runs of equal ones, a shorter one ending a run, empty bodies, one past a
    GSO run's 64 KiB) and random places in the body, seeded: every datagram arrives whole and
    in order, however the kernel cuts the runs."""
    tx, rx = pair
    rng = random.Random(7)
    body = np.frombuffer(payloads(1, 1 << 17, 8)[0], np.uint8).copy()
    for _ in range(20):
        sizes: list[int] = []
        while len(sizes) < 40:
            size = rng.choice([0, 1, 100, 8192, 8192, 8192, 9000])
            sizes += [size] * rng.randint(1, 9)
        pieces = [(rng.randrange(0, body.shape[0] - size + 1), size) for size in sizes]
        heads = [rng.randbytes(40) for _ in pieces]
        done, _ = gather(tx, heads, body, pieces, rx.endpoint)
        assert done == len(pieces)
        expected = [h + body[o : o + n].tobytes() for h, (o, n) in zip(heads, pieces, strict=True)]
        assert [g[0] for g in rx.take(len(pieces))] == expected
