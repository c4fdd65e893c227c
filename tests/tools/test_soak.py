"""``netdam soak``: the bookkeeping (checksums, exactly-once counter), the clients' fault-injecting
socket, and real runs: one under loss/dup/reorder/delay that must come out all zero, one whose
memory is corrupted out of band that must fail."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from netdam.cli import main as cli
from netdam.cli import soak as cli_soak
from netdam.core.faults import FaultSpec, decide, packet_id
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet, encode_packet, endpoint_to_u64
from netdam.switch.faults import parse_faults
from netdam.tools.soak.client import ProbeSocket
from netdam.tools.soak.parent import bump_counter, flip_block_byte, run_soak, switch_fault_text
from netdam.tools.soak.plan import (
    BLOCK_MAX,
    CORRUPT,
    LOST,
    OK,
    BlockBook,
    SoakConfig,
    check_counter,
    checksum,
    client_ids,
    draw_region,
    layout_blocks,
)

RESULT_KEYS = {
    "ok",
    "ops",
    "ops_per_second",
    "lost_writes",
    "corrupt_reads",
    "counter_error",
    "errors",
    "counter_old_value_errors",
    "unconfirmed_writes",
    "unconfirmed_increments",
    "counter",
    "latency_us",
    "retransmits",
    "faults",
    "injected",
    "node_counters",
    "regions",
}


# ---------------------------------------------------------------- plan and bookkeeping


def test_blocks_cover_the_region_and_never_cross_a_stripe() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        size, stride, ways = draw_region(rng, nodes=3)
        assert (stride == 0) == (ways == 1)
        blocks = layout_blocks(size, stride, rng)
        assert blocks[0][0] == 0 and sum(n for _, n in blocks) == size
        for (off, n), (nxt, _) in zip(blocks, blocks[1:] + [(size, 0)]):
            assert off + n == nxt and 1 <= n <= BLOCK_MAX
            assert not stride or off // stride == (off + n - 1) // stride


def test_client_ids_are_nonzero_and_distinct_modulo_256() -> None:
    ids = client_ids(seed=5, count=65)
    assert 0 not in ids and len({i % 256 for i in ids}) == 65
    assert ids == client_ids(seed=5, count=65) != client_ids(seed=6, count=65)


def test_book_tells_ok_lost_and_corrupt_apart() -> None:
    book = BlockBook(2)
    v1, v2, v3 = b"first version", b"second version", b"third version"
    book.acknowledged(0, checksum(v1))
    assert book.check(0, v1) == OK
    book.acknowledged(0, checksum(v2))
    assert book.check(0, v2) == OK
    assert book.check(0, v1) == LOST and book.check(0, v1) == LOST  # one lost write, seen twice
    assert book.lost_writes == 1
    assert book.check(0, b"garbage") == CORRUPT and book.corrupt_reads == 1
    # An unacknowledged write may or may not have landed: both versions pass ...
    book.unconfirmed(0, checksum(v3))
    assert book.check(0, v2) == OK and book.check(0, v3) == OK
    # ... until the next acknowledged write: then finding it is a lost write.
    book.acknowledged(0, checksum(v1))
    assert book.check(0, v3) == LOST and book.lost_writes == 2
    assert book.check(1, v1) == CORRUPT  # block 1 was never written


def test_counter_accounting_is_exact_and_honest_about_unconfirmed_increments() -> None:
    def olds(*values: int) -> np.ndarray:
        return np.array(values, np.uint64)

    exact = check_counter(10, 13, olds(10, 11, 12), unconfirmed=0)
    assert exact["counter_error"] == 0 and exact["counter_old_value_errors"] == 0
    assert check_counter(10, 12, olds(10, 11, 11), 0)["counter_error"] == -1  # an increment lost
    assert check_counter(10, 12, olds(10, 11, 11), 0)["counter_old_value_errors"] == 1
    assert check_counter(10, 14, olds(10, 11, 12), 0)["counter_error"] == 1  # applied twice
    # Unconfirmed increments may have been applied, or not: either is no error ...
    for final in (13, 14, 15):
        assert check_counter(10, final, olds(10, 11, 12), unconfirmed=2)["counter_error"] == 0
    assert check_counter(10, 15, olds(10, 11, 12), 2)["applied_unconfirmed"] == 2
    # ... but not more than all of them.
    assert check_counter(10, 16, olds(10, 11, 12), 2)["counter_error"] == 1
    assert (
        check_counter(10, 13, olds(10, 11, 13), 0)["counter_old_value_errors"] == 1
    )  # 13 >= final
    wrapped = check_counter(2**64 - 1, 1, olds(2**64 - 1, 0), 0)
    assert wrapped["counter_error"] == 0 and wrapped["counter_old_value_errors"] == 0


def test_switch_fault_text_parses_and_names_every_request_link() -> None:
    config = SoakConfig(loss=0.01, dup=0.01, reorder=0.05, delay_ms=5, delay_prob=0.2)
    entries = parse_faults(switch_fault_text(config, nodes=3), nodes=3)
    assert [(port, direction) for port, direction, _ in entries] == [(0, 0), (1, 1), (2, 1), (3, 1)]
    spec = entries[0][2]
    assert (spec.loss, spec.dup, spec.reorder, spec.delay, spec.delay_s) == (
        0.01,
        0.01,
        0.05,
        0.2,
        0.005,
    )
    assert switch_fault_text(SoakConfig(), nodes=3) == ""
    with pytest.raises(ValueError, match="fault site 'wire'"):
        SoakConfig(fault_site="wire")
    with pytest.raises(ValueError, match="--loss must be a probability"):
        SoakConfig(loss=1.5)


# ---------------------------------------------------------------- the clients' socket


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx.bind(("127.0.0.1", 0))
    yield rx, tx
    rx.close()
    tx.close()


def _replies(count: int) -> list[bytes]:
    return [encode_packet(Packet(Opcode.ACK, client_id=7, txn_id=t)) for t in range(1, count + 1)]


def _drain(probe: ProbeSocket) -> list[bytes]:
    got = []
    probe.settimeout(0.05)
    while True:
        try:
            got.append(probe.recvfrom(65536)[0])
        except TimeoutError:
            return got


def _seed_with_every_fault(rx: socket.socket, tx: socket.socket, spec: FaultSpec) -> FaultSpec:
    """*spec*, or with the first seed from its own on under which 100 replies from *tx* to *rx*
    see enough of each fault: the fates hash the ports too, which the system picks."""
    source = endpoint_to_u64(tx.getsockname())
    me = endpoint_to_u64(rx.getsockname())
    for seed in range(spec.seed, spec.seed + 1000):
        candidate = dataclasses.replace(spec, seed=seed)
        fates = [decide(candidate, source, me, packet_id(d), 0) for d in _replies(100)]
        kept = [f for f in fates if not f.drop]
        drops, dups = len(fates) - len(kept), sum(f.copies - 1 for f in kept)
        reordered = sum(f.copies for f in kept if f.reorder and not f.delay_s)
        if drops > 10 and dups > 5 and reordered > 5:
            return candidate
    raise AssertionError("no seed in 1000 gives every fault")


def test_probe_socket_faults_replay_and_retries_get_fresh_decisions(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    rx, tx = pair
    spec = _seed_with_every_fault(rx, tx, FaultSpec(loss=0.3, dup=0.2, reorder=0.2, seed=11))
    outcomes = []
    for _ in range(2):  # a fresh socket wrapper with the same seed decides the same way
        probe = ProbeSocket(rx, spec)
        for data in _replies(100):
            tx.sendto(data, rx.getsockname())
        time.sleep(0.05)
        got = _drain(probe)
        outcomes.append((sorted(got), dict(probe.injected)))
    assert outcomes[0] == outcomes[1]
    injected = outcomes[0][1]
    assert injected["drops"] > 10 and injected["dups"] > 5 and injected["reordered"] > 5
    assert len(outcomes[0][0]) == 100 - injected["drops"] + injected["dups"]
    # The same datagram again and again (a retried request's cached reply): each sighting is a
    # new attempt with its own decision, so some get through and some are lost.
    probe = ProbeSocket(rx, FaultSpec(loss=0.5, seed=11))
    data = _replies(1)[0]
    for _ in range(40):
        tx.sendto(data, rx.getsockname())
    time.sleep(0.05)
    assert 5 < len(_drain(probe)) < 35


def test_probe_socket_times_requests_and_delays_replies(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    rx, tx = pair
    probe = ProbeSocket(rx, FaultSpec(delay=1.0, delay_s=0.03, seed=1))
    request = encode_packet(Packet(Opcode.READ, client_id=7, txn_id=1, length=8))
    start = time.monotonic()
    probe.sendto(request, tx.getsockname())
    assert tx.recvfrom(65536)[0] == request
    tx.sendto(_replies(1)[0], rx.getsockname())
    probe.settimeout(1.0)
    probe.recvfrom(65536)
    assert time.monotonic() - start >= 0.03 and probe.injected["delayed"] == 1
    [latency] = probe.latency_us[int(Opcode.READ)]
    assert 30_000 <= latency < 1_000_000


# ---------------------------------------------------------------- real runs


@pytest.mark.slow
def test_soak_under_loss_dup_reorder_delay_is_all_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "soak",
            "--clients",
            "3",
            "--seconds",
            "2",
            "--nodes",
            "2",
            "--loss",
            "0.02",
            "--dup",
            "0.02",
            "--reorder",
            "0.05",
            "--delay",
            "60",
            "--delay-prob",
            "0.01",
            "--fault-site",
            "nodes",
            "--seed",
            "4",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert RESULT_KEYS <= result.keys()
    assert result["ok"] is True
    for key in (
        "lost_writes",
        "corrupt_reads",
        "counter_error",
        "errors",
        "counter_old_value_errors",
    ):
        assert result[key] == 0, (key, result["error_samples"])
    assert result["ops"] > 300 and result["reads"] > 0 and result["writes"] > 0
    counter = result["counter"]
    assert (
        counter["final"] - counter["initial"]
        == counter["acknowledged_increments"]
        == result["fetch_adds"]
        > 0
    )
    assert result["verified_blocks"] == sum(r["blocks"] for r in result["regions"])
    # The faults really happened, on requests (at the nodes) and on replies (at the clients) ...
    assert (
        result["injected"]["client_recv"]["drops"] > 0
        and result["node_counters"]["fault_drops"] > 0
    )
    # ... and retries met the nodes' duplicate windows instead of executing twice.
    assert result["retransmits"] > 0 and result["node_counters"]["dup_replays"] > 0
    assert result["latency_us"]["fetch_add"]["p50"] > 0
    assert (
        result["latency_us"]["write"]["count"] == result["writes"]
    )  # the timed phase's, not the fill's
    assert result["faults"]["links"] == ["node0:recv", "node1:recv", "client:recv"]


@pytest.mark.slow
def test_soak_detects_corruption_and_phantom_increments() -> None:
    """The checker can fail: after the clients stop, one byte of a block is flipped in node
    memory and the counter is bumped out of band (host stores through netdam.shell.shm.attach).
    Faults on the switch's links (dup and reorder: never loss, see test_fault_attempt_...)."""

    def tamper(layout, info) -> None:
        flip_block_byte(layout, info, client=1, block=len(layout.plans[1].blocks) // 2)
        bump_counter(layout, info, 1)

    result = run_soak(
        SoakConfig(clients=2, seconds=0.5, nodes=1, dup=0.02, reorder=0.05, seed=9, tamper=tamper)
    )
    assert result["ok"] is False and "error" not in result
    assert result["corrupt_reads"] == 1 and result["lost_writes"] == 0 and result["errors"] == 0
    assert result["counter_error"] == 1  # one increment more than acknowledged
    assert any("client 1 block" in s and "corrupt" in s for s in result["error_samples"])
    assert (
        result["injected"]["switch_fault_dups"] > 0 and result["injected"]["switch_fault_held"] > 0
    )
    assert result["faults"]["links"] == ["client:rx", "node0:tx", "client:recv"]


def test_exit_codes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        cli.main(["soak", "--clients", "65", "--json"])
    assert usage.value.code == 2
    assert (
        "--clients: 65 is out of range: give 1..64" in json.loads(capsys.readouterr().out)["error"]
    )
    with pytest.raises(SystemExit) as usage:  # a missing file is a usage error, found at parse time
        cli.main(["soak", "--cluster", "/nonexistent/c.toml", "--json"])
    assert usage.value.code == 2
    failed = json.loads(capsys.readouterr().out)
    assert failed["ok"] is False and "/nonexistent/c.toml" in failed["error"]
    canned = {"ok": False, "error_samples": []}
    monkeypatch.setattr("netdam.tools.soak.parent.run_soak", lambda config: dict(canned))
    monkeypatch.setattr(cli_soak, "summary_text", lambda result: "x")
    assert cli.main(["soak", "--json"]) == 1
    capsys.readouterr()


def _full_attempt_table() -> tuple[np.ndarray, np.ndarray]:
    from netdam.kernels.faults import fault_attempt

    keys = np.zeros(16, np.uint64)
    counts = np.zeros(16, np.uint32)
    for key in range(16, 32):  # fill the table: key k sits in slot k mod 16
        fault_attempt(keys, counts, np.uint64(key))
    return keys, counts


def test_fault_attempt_table_counts_retries_when_full() -> None:
    """Regression test of a bug the soak found (/tmp/notes/soak-bugs.md). Fault decisions hash
    (seed, src, dst, packet id, attempt), the attempt coming from a table of sightings (1 << 14
    entries in the switch, 1 << 16 in a node). Once the 8 slots a new key probes were taken,
    `fault_attempt` stored the key one slot past its probe window, where no lookup found it: every
    retransmission was attempt 0 again and got the first decision again, so a dropped request
    was dropped for ever (the soak: 'no answer ... after 21 tries' within seconds)."""
    from netdam.kernels.faults import fault_attempt

    keys, counts = _full_attempt_table()
    retried = np.uint64(16 * 99 + 5)
    attempts = [int(fault_attempt(keys, counts, retried)) for _ in range(3)]
    assert attempts[0] < attempts[1] < attempts[2]


def test_fault_attempt_table_two_retried_keys_of_one_slot() -> None:
    """Regression test of the second bug: with the table full, a key missing from its window
    evicted the window's first slot and restarted at attempt 0. Two packets whose keys start at
    the same slot and are both being retried (two clients' dropped requests, at the soak's rate
    about once per 30 s) evicted each other on every sighting, so both stayed at attempt 0, got
    their first decision (drop) every time, and both clients timed out together. The victim
    slot now depends on the key's hash bits."""
    from netdam.kernels.faults import fault_attempt

    keys, counts = _full_attempt_table()
    first, second = np.uint64(16 * 99 + 5), np.uint64(16 * 77 + 5)
    seen: dict[int, list[int]] = {int(first): [], int(second): []}
    for _ in range(3):
        for key in (first, second):
            seen[int(key)].append(int(fault_attempt(keys, counts, key)))
    assert all(len(set(attempts)) == 3 for attempts in seen.values()), seen


def test_fault_attempt_table_no_pair_of_one_slot_repeats_attempts() -> None:
    """Every pair of keys of one start slot, retried alternately in a full table, must keep
    counting. With the victim slot chosen by the key's hash bits alone, pairs that also agree on
    those bits (about 1 in 8) evicted each other for ever (the table never drains), so two
    clients' dropped requests of such a pair both timed out. The new key now carries the evicted
    slot's count on."""
    from netdam.kernels.faults import fault_attempt

    candidates = [np.uint64(16 * k + 5) for k in range(2, 40)]  # all start at slot 5
    stuck = []
    for i, first in enumerate(candidates):
        for second in candidates[i + 1 :]:
            keys, counts = _full_attempt_table()
            seen: dict[int, list[int]] = {int(first): [], int(second): []}
            for _ in range(3):
                for key in (first, second):
                    seen[int(key)].append(int(fault_attempt(keys, counts, key)))
            if any(len(set(attempts)) < 3 for attempts in seen.values()):
                stuck.append((int(first), int(second)))
    assert not stuck, f"{len(stuck)} of 703 pairs repeat an attempt number, e.g. {stuck[:3]}"
