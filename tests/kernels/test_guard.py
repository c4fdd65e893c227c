"""The source guard on real processes (SPEC.md 12): a key-guessing campaign is locked out while
other sources are served, and no unproven address gets more than 3x its bytes back."""

from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from netdam.cluster.control import ControlClient
from netdam.cluster.launch import LocalCluster, SwitchHandle, start_pool_cluster
from netdam.kernels.guard import siphash_u64
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    AMPLIFICATION_FACTOR,
    LOCKOUT_BURST,
    LOCKOUT_RATE_PER_S,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.switch.controller import PoolController

RKEY = 0x600DC0DE
BASE = 0x10000


def test_siphash_matches_the_reference_vector() -> None:
    """SipHash-2-4, key 00..0f, message 00..07 (Aumasson and Bernstein, appendix A)."""
    k0 = int.from_bytes(bytes(range(8)), "little")
    k1 = int.from_bytes(bytes(range(8, 16)), "little")
    assert siphash_u64(k0, k1, int.from_bytes(bytes(range(8)), "little")) == 0x93F5F5799A932462


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, SwitchHandle]]:
    cluster, switch = start_pool_cluster(
        2, memory=1 << 20, cluster_path=tmp_path_factory.mktemp("guard") / "c.toml"
    )
    try:
        with ControlClient.for_cluster(cluster.info) as admin:
            for ep in cluster.endpoints:
                admin.register(ep, BASE, 0x10000, Rights.READ | Rights.WRITE, rkey=RKEY)
        yield cluster, switch
    finally:
        switch.stop()
        cluster.stop()


@pytest.fixture(autouse=True)
def _backlog_served(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the shared pool, wait until each node answers a PING: a campaign leaves
    ~10^5 datagrams in a node's 128 MiB receive buffer, and on a loaded machine (3 test workers
    on 2 cores) the next test's ALLOC timed out behind them."""
    yield
    if "pool" in request.fixturenames:
        cluster, _ = request.getfixturevalue("pool")
        ping = encode_packet(Packet(Opcode.PING, client_id=5))
        with _socket("127.0.0.1") as sock:
            for node in cluster.endpoints:
                sock.sendto(ping, node)
                assert _answers(sock, 1, 10.0), f"{node} answers no PING 10 s after the test"


def _answers(sock: socket.socket, expect: int, within: float = 2.0) -> list[bytes]:
    """What *sock* receives until *expect* datagrams came or *within* seconds passed: a node
    working off a flood's backlog answers late, not never."""
    got: list[bytes] = []
    end = time.monotonic() + within
    while len(got) < expect and time.monotonic() < end:
        time.sleep(0.002)
        got += _drain(sock)
    return got


def _socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 0))
    sock.setblocking(False)
    return sock


def _read(txn: int, rkey: int, length: int = 8, addr: int = BASE, token: int = 0) -> bytes:
    return encode_packet(
        Packet(
            Opcode.READ,
            client_id=3,
            txn_id=txn,
            rkey=rkey,
            addr=addr,
            length=length,
            aux_addr=token,
        )
    )


def _drain(sock: socket.socket) -> list[bytes]:
    got = []
    while True:
        try:
            got.append(sock.recv(65536))
        except BlockingIOError:
            return got


def _campaign(socks: list[socket.socket], target: Endpoint, seconds: float) -> tuple[int, int]:
    """Random-rkey READs from *socks* as fast as they go for *seconds*: (sent, answered)."""
    rng = random.Random(7)
    sent = answered = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for sock in socks:
            for _ in range(16):
                try:
                    sock.sendto(_read(sent & 0xFFFFFFFF, rng.randrange(1, 1 << 32) | 1), target)
                    sent += 1
                except BlockingIOError:
                    break
            answered += len(_drain(sock))
    time.sleep(0.05)
    return sent, answered + sum(len(_drain(s)) for s in socks)


def _counters(cluster: LocalCluster, ep: Endpoint) -> dict[str, object]:
    with ControlClient.for_cluster(cluster.info) as admin:
        return C.counters_to_dict(admin.counters(ep))


@pytest.mark.slow
def test_guessing_campaign_is_locked_out_and_others_are_served(
    pool: tuple[LocalCluster, SwitchHandle],
) -> None:
    cluster, _ = pool
    node = cluster.endpoints[0]
    attacker, legit = _socket("127.0.0.2"), _socket("127.0.0.1")
    before = _counters(cluster, node)
    served = 0
    start = time.monotonic()
    sent = answered = 0
    for second in range(3):
        s, a = _campaign([attacker], node, 1.0)
        sent, answered = sent + s, answered + a
        legit.sendto(_read(100 + second, RKEY), node)  # another source, same address range
        answers = _answers(legit, 1, 1.0)
        served += sum(1 for r in answers if decode_packet(r).opcode == Opcode.READ_RESP)
    elapsed = time.monotonic() - start
    # One endpoint: a burst at t = 0, locked out 1 s, a burst at 1 s, locked out 2 s, a burst
    # at 3 s, ... (the k-th lockout ends at 2^k - 1 seconds).
    bursts = sum(1 for k in range(20) if 2**k - 1 < elapsed)
    bound = bursts * LOCKOUT_BURST + LOCKOUT_RATE_PER_S * elapsed + 2
    print(
        f"\nguessing campaign, one endpoint: {sent} READs with random rkeys in {elapsed:.2f} s, "
        f"{answered} answered ({answered / elapsed:.1f} per second; bound {bound:.0f})"
    )
    assert sent > 10_000 and answered <= bound
    assert served == 3  # the legitimate source was never slowed
    # Locked out: the right key from the attacker is dropped too.
    attacker.sendto(_read(999_999, RKEY), node)
    time.sleep(0.2)
    assert _drain(attacker) == []
    after = _counters(cluster, node)
    assert after["drop_lockout"] > before["drop_lockout"]
    assert after["lockouts"] >= before["lockouts"] + 2
    assert after["auth_failures"] - before["auth_failures"] == answered


@pytest.mark.slow
def test_many_ports_of_one_address_share_its_budget(
    pool: tuple[LocalCluster, SwitchHandle],
) -> None:
    cluster, _ = pool
    node = cluster.endpoints[1]
    socks = [_socket("127.0.0.3") for _ in range(24)]
    start = time.monotonic()
    sent, answered = _campaign(socks, node, 2.0)
    elapsed = time.monotonic() - start
    # Every port of one address draws from the address's one bucket: bursts at 0 s and 1 s.
    bursts = sum(1 for k in range(20) if 2**k - 1 < elapsed)
    bound = bursts * LOCKOUT_BURST + LOCKOUT_RATE_PER_S * elapsed + 24
    print(
        f"\n24 ports of one address: {sent} guesses in {elapsed:.2f} s, {answered} answered (bound {bound:.0f})"
    )
    assert answered <= bound
    legit = _socket("127.0.0.1")
    legit.sendto(_read(7, RKEY), node)
    answers = _answers(legit, 1, 2.0)
    time.sleep(0.05)  # a second answer would be here by now
    assert [decode_packet(r).opcode for r in answers + _drain(legit)] == [Opcode.READ_RESP]


def test_switch_locks_out_guessers_of_pool_rkeys(pool: tuple[LocalCluster, SwitchHandle]) -> None:
    cluster, switch = pool
    region = PoolController(cluster.path).alloc(
        8192, tagged=False
    )  # its rkey alone opens it (SPEC v1)
    attacker = _socket("127.0.0.4")
    rng = random.Random(1)
    for k in range(LOCKOUT_BURST + 40):
        attacker.sendto(_read(k, rng.randrange(1, 1 << 32), addr=region.gaddr), switch.vip)
        time.sleep(0.0005)
    time.sleep(0.1)
    replies = [decode_packet(r) for r in _drain(attacker)]
    assert all(r.opcode == Opcode.NACK and r.status == Status.BAD_RKEY for r in replies)
    assert LOCKOUT_BURST <= len(replies) <= LOCKOUT_BURST + 2
    attacker.sendto(_read(10_000, region.rkey, addr=region.gaddr), switch.vip)  # the right key
    time.sleep(0.1)
    assert _drain(attacker) == []
    with ControlClient.for_cluster(cluster.info) as admin:
        counters = C.counters_to_dict(admin.counters(switch.entry.control_endpoint))
    assert counters["drop_lockout"] >= 1 and counters["lockouts"] >= 1


def _amplification(
    sock: socket.socket, target: Endpoint, datagrams: list[bytes]
) -> tuple[int, int]:
    """Send *datagrams* one by one; (bytes sent, bytes received back)."""
    out = back = 0
    for data in datagrams:
        sock.sendto(data, target)
        out += len(data)
        time.sleep(0.001)
        back += sum(len(r) for r in _drain(sock))
    time.sleep(0.1)
    return out, back + sum(len(r) for r in _drain(sock))


@pytest.mark.slow
def test_unvalidated_sources_get_at_most_three_times_their_bytes(
    pool: tuple[LocalCluster, SwitchHandle],
) -> None:
    """A spoofed source never sees the token INFO carries: its READs (here: a client that never
    PINGs) bring back at most 3x their bytes, at a node and through the VIP; with the token the
    same READs run at full size."""
    cluster, switch = pool
    # Untagged (SPEC v1): what is measured is the rkey's READs, with and without a token.
    region = PoolController(cluster.path).alloc(64 << 10, interleave=8192, tagged=False)
    node = cluster.endpoints[0]
    cases = [(node, RKEY, BASE), (switch.vip, region.rkey, region.gaddr)]
    for target, rkey, addr in cases:
        victim = _socket("127.0.0.5")
        big = [_read(k, rkey, 8192, addr) for k in range(200)]
        out, back = _amplification(victim, target, big)
        factor = back / out
        print(
            f"\nunvalidated 8 KiB READs to {target}: {out} bytes out, {back} back: factor {factor:.2f}"
        )
        assert factor <= AMPLIFICATION_FACTOR
        small = [_read(1000 + k, rkey, 128, addr) for k in range(50)]  # 192-byte answers: 3x
        out, back = _amplification(victim, target, small)
        assert back == 50 * (64 + 128) and back / out <= AMPLIFICATION_FACTOR
        # The token round trip: PING, then READs carrying INFO's aux_addr run at full size.
        victim.sendto(encode_packet(Packet(Opcode.PING, client_id=3, txn_id=5000)), target)
        time.sleep(0.1)
        token = decode_packet(_drain(victim)[0]).aux_addr
        assert token != 0
        out, back = _amplification(
            victim, target, [_read(2000 + k, rkey, 8192, addr, token) for k in range(20)]
        )
        assert back == 20 * (64 + 8192)
        # Another address cannot use that token.
        thief = _socket("127.0.0.6")
        out, back = _amplification(thief, target, [_read(3000, rkey, 8192, addr, token)])
        assert back == 0
    _ = struct
    with ControlClient.for_cluster(cluster.info) as admin:
        node_ctr = C.counters_to_dict(admin.counters(node))
        switch_ctr = C.counters_to_dict(admin.counters(switch.entry.control_endpoint))
    assert node_ctr["drop_amplification"] >= 200 and switch_ctr["drop_amplification"] >= 200


def test_lockout_backoff_on_a_synthetic_clock() -> None:
    """The lockout's schedule, on a node core with the guard on and a clock the test sets: 32
    failures pass, the 33rd locks out for 1 s, then 2, 4 ... up to an hour; an hour after the end
    of the last lockout the doubling restarts; every datagram of a locked address is dropped."""
    from netdam.core.guard import GuardConfig
    from netdam.core.node import NodeConfig, NodeCore

    me = ("10.0.0.1", 7744)
    core = NodeCore(
        NodeConfig(endpoint=me, memory_bytes=1 << 16, admin_key=0xAD, guard=GuardConfig.on())
    )
    core.register_region(0, 4096, Rights.READ, rkey=RKEY)
    guesser = ("10.9.9.9", 5000)
    other_port = ("10.9.9.9", 5001)

    def guess(now: float, src: Endpoint = guesser, rkey: int = RKEY ^ 1) -> list[Packet]:
        core.receive_datagram(_read(1, rkey, addr=0), src, now)
        return [decode_packet(d) for d, _ in core.datagrams_to_send(now)]

    answered = sum(len(guess(0.0)) for _ in range(LOCKOUT_BURST + 5))
    assert answered == LOCKOUT_BURST + 1  # the 33rd failure is answered, then locked out
    assert (
        guess(0.5, rkey=RKEY) == [] and guess(0.5, other_port) == []
    )  # right key, other port: dropped
    assert [p.opcode for p in guess(0.6, ("10.9.9.8", 1))] == [Opcode.NACK]  # another address
    ends = []
    now = 0.0
    for _ in range(14):  # each lockout twice as long, up to an hour
        while _locked_at(core, guesser, now):
            now += 0.25
        ends.append(now)
        while len(guess(now)) == 1:
            pass
    lengths = [round(b - a) for a, b in zip(ends, ends[1:])]
    assert lengths == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3600, 3600]
    # Quiet for an hour after the last lockout ended: the doubling starts over at 1 s.
    while _locked_at(core, guesser, now):
        now += 1.0
    now += 3601.0
    for _ in range(LOCKOUT_BURST + 1):
        guess(now)
    assert _locked_at(core, guesser, now + 0.9) and not _locked_at(core, guesser, now + 1.01)
    counters = C.counters_to_dict(core.counters)
    assert counters["lockouts"] >= 16 and counters["drop_lockout"] >= 4


def _locked_at(core: object, src: Endpoint, now: float) -> bool:
    from netdam.kernels.guard import G_NOW, is_locked
    from netdam.protocol.packet import endpoint_to_u64

    guard = core.guard
    guard.cfg[G_NOW] = now
    return is_locked(guard, endpoint_to_u64(src))


def _raw_udp(src: Endpoint, dst: Endpoint, payload: bytes) -> bytes:
    """An IPv4/UDP datagram claiming *src*: the kernel fills in the IP checksum and total length
    (raw(7), IP_HDRINCL); a UDP checksum of 0 means none (RFC 768)."""
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        0,
        0,
        0x4000,
        64,
        socket.IPPROTO_UDP,
        0,
        socket.inet_aton(src[0]),
        socket.inet_aton(dst[0]),
    )
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0)
    return ip + udp + payload


def test_forged_source_reads_bring_the_victim_at_most_three_times(
    pool: tuple[LocalCluster, SwitchHandle],
) -> None:
    """The reflection attack itself: a raw socket sends 8 KiB READs with a right key whose IP
    source is a victim's address and port; the victim (a socket bound there, which never sent a
    thing) counts what it receives, against the bytes the attacker put on the wire."""
    try:
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    except PermissionError:
        pytest.skip("forging a source address needs CAP_NET_RAW (run as root)")
    cluster, switch = pool
    # Untagged (SPEC v1): the reflection needs only the rkey, which is what is measured here.
    region = PoolController(cluster.path).alloc(64 << 10, interleave=8192, tagged=False)
    with raw:
        for target, rkey, addr in [
            (cluster.endpoints[1], RKEY, BASE),
            (switch.vip, region.rkey, region.gaddr),
        ]:
            victim = _socket("127.0.0.9")
            src = victim.getsockname()
            out = 0
            for k in range(200):
                raw.sendto(_raw_udp(src, target, _read(k, rkey, 8192, addr)), (target[0], 0))
                out += 64
                time.sleep(0.0005)
            time.sleep(0.2)
            back = sum(len(r) for r in _drain(victim))
            print(
                f"\nforged-source 8 KiB READs to {target}: {out} bytes sent, {back} reached the victim "
                f"(factor {back / out:.2f}; 129 without validation)"
            )
            assert back <= AMPLIFICATION_FACTOR * out
            # The same datagrams with the victim's own token (which a forger never sees) would be
            # answered in full: the drop above is the validation, not a lost datagram.
            victim.sendto(encode_packet(Packet(Opcode.PING, client_id=3, txn_id=7000)), target)
            time.sleep(0.1)
            token = decode_packet(_drain(victim)[0]).aux_addr
            raw.sendto(_raw_udp(src, target, _read(7001, rkey, 8192, addr, token)), (target[0], 0))
            time.sleep(0.1)
            assert [len(r) for r in _drain(victim)] == [64 + 8192]
            victim.close()
