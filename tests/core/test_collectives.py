"""Collectives run by the node cores' engines on the in-memory fabric, against numpy references:
all ranks bitwise identical and equal to the chain-order reference, under loss, duplication
and reordering, with every single packet dropped in turn."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
from helpers import ADMIN_KEY, RKEY, Cluster, make_cluster
from reference import all_reduce_reference

from netdam.core.chunk_plan import chunk_bounds
from netdam.core.faults import FaultSpec
from netdam.kernels import collective as L
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    COUNTERS_EPOCH,
    DEFAULT_MTU,
    NUMPY_DTYPE,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Status,
    max_elements,
)
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import (
    FLAG_AWAIT_STARTED,
    Algo,
    CollectiveDescriptor,
    unpack_completion,
    unpack_completion_phases,
)
from netdam.protocol.tag import verify as tag_verify

IN, OUT = 0, 1 << 19
MEMORY = 1 << 20
GROUP = ("239.77.0.2", 7744)
#: The collectives here are tagged (SPEC.md 2.6) unless a test passes tag_key=b"" (v1).
TAG_KEY = bytes(range(1, 17))


@dataclass
class Outcome:
    outputs: list[np.ndarray]
    replies: list[Packet]
    cluster: Cluster


def hosts(n: int) -> list[tuple[str, int]]:
    return [("127.0.0.1", 9100 + r) for r in range(n)]


def run(
    n: int,
    inputs: list[np.ndarray],
    algo: Algo = Algo.ALL_REDUCE,
    op: ReduceOp = ReduceOp.SUM,
    faults: FaultSpec | None = None,
    multicast: bool = False,
    in_place: bool = False,
    root: int = 0,
    out_count: int | None = None,
    epoch: int = 1,
    cluster: Cluster | None = None,
    max_rounds: int = 20_000,
    flags: int = 0,
    on_round: Callable[[Cluster, int], None] | None = None,
    tag_key: bytes = TAG_KEY,
    late: dict[int, int | None] | None = None,
    timeout_ms: int = 30_000,
) -> Outcome:
    """Stage inputs by host store, START_COLL from every rank's host, run until every host heard.
    *on_round(cluster, round)* runs before each fabric step (to inject datagrams); *late* maps
    a rank to the round its host first sends START_COLL (a start skew; None: never, and the
    run ends when every other host heard)."""
    cluster = cluster or make_cluster(n, faults, memory=MEMORY)
    dtype = {np.dtype(v): DType(k) for k, v in NUMPY_DTYPE.items()}[inputs[0].dtype]
    count = out_count if out_count is not None else inputs[0].size
    out_addr = IN if in_place else OUT
    for node, data in zip(cluster.nodes, inputs, strict=True):
        node.memory[IN : IN + data.nbytes] = data.view(np.uint8)
    if multicast:
        for endpoint in cluster.endpoints:
            cluster.fabric.join(GROUP, endpoint)
    starts = []
    for rank, host in enumerate(hosts(n)):
        cluster.fabric.add_endpoint(host)
        desc = CollectiveDescriptor(
            algo,
            rank,
            count,
            IN,
            out_addr,
            RKEY,
            root=root,
            group=GROUP if multicast else None,
            timeout_ms=timeout_ms,
            flags=flags,
            tag_key=tag_key,
        )
        start = Packet(
            Opcode.START_COLL,
            rkey=ADMIN_KEY,
            client_id=50 + rank,
            txn_id=epoch,
            coll_id=3,
            epoch=epoch,
            dtype=dtype,
            reduce_op=op,
            segments=tuple(cluster.endpoints),
        ).with_payload(desc.encode())
        starts.append(encode_packet(start))
    finals: dict[int, Packet] = {}
    never = {rank for rank, first in (late or {}).items() if first is None}
    for round_ in range(max_rounds):
        if on_round is not None:
            on_round(cluster, round_)
        for rank, host in enumerate(hosts(n)):
            first = (late or {}).get(rank, 0)
            # Hosts re-send START_COLL until they hear the completion.
            if (
                first is not None
                and round_ >= first
                and (round_ - first) % 200 == 0
                and rank not in finals
            ):
                cluster.fabric.send(host, cluster.endpoints[rank], starts[rank])
        if cluster.fabric.step() == 0:
            cluster.fabric.advance(0.005)
        for rank, host in enumerate(hosts(n)):
            for data, _ in cluster.fabric.receive(host):
                reply = decode_packet(data)
                if reply.aux_addr == 1:
                    finals.setdefault(rank, reply)
        if len(finals) == n - len(never):
            break
    missing = set(range(n)) - never - set(finals)
    assert not missing, f"hosts without completion: {sorted(missing)}"
    cluster.fabric.run_until_idle(max_rounds=max_rounds)  # let stragglers settle
    replies = [finals[rank] for rank in range(n) if rank not in never]
    nbytes = count * inputs[0].itemsize
    outputs = [
        node.memory[out_addr : out_addr + nbytes].view(inputs[0].dtype).copy()
        for node in cluster.nodes
    ]
    return Outcome(outputs, replies, cluster)


def run_under_forgery(
    seed: int, forged: Callable[[int, int], list[Packet]], made_up_tags: bool = False
) -> None:
    """A 3-rank all-reduce while, every third round of the first 300, each node gets
    forged(seq, victim) for seq 0-3 from another member's address (and, with *made_up_tags*, each
    also flagged TAGGED with a random tag): every rank's result is exact and every node counted
    forgeries."""
    n = 3
    rng = np.random.default_rng(seed)
    inputs = random_inputs(rng, n, 6000, np.float32)

    def forge(cluster: Cluster, round_: int) -> None:
        if round_ % 3 or round_ > 300:
            return
        for seq in range(4):
            for victim in range(n):
                forger = cluster.endpoints[(victim + 1) % n]  # a member's source address
                for packet in forged(seq, victim):
                    cluster.fabric.send(forger, cluster.endpoints[victim], encode_packet(packet))
                    if made_up_tags:
                        made_up = replace(
                            packet,
                            flags=packet.flags | Flags.TAGGED,
                            tag=int(rng.integers(1, 2**63)),
                        )
                        cluster.fabric.send(
                            forger, cluster.endpoints[victim], encode_packet(made_up)
                        )

    out = run(n, inputs, on_round=forge)
    assert all(r.opcode == Opcode.ACK for r in out.replies), [r.status for r in out.replies]
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert all(int(node.counters[C.DROP_COLL_FORGED]) > 0 for node in out.cluster.nodes)


def test_forged_replies_without_the_key_abort_nothing() -> None:
    """Before: NACKs forged from a member's address, without any key, aborted 28 of 40
    all-reduces. Replies and DONEs of a collective must carry its key: forged NACKs (every
    fatal status), DONEs and READ_RESPs from members' addresses are dropped and counted, and
    the result is exact."""

    def forged(seq: int, victim: int) -> list[Packet]:
        return [
            Packet(
                Opcode.NACK, status=Status.NO_RIGHTS, seq=seq, coll_id=3, epoch=1, rkey=RKEY ^ 1
            ),
            Packet(Opcode.ACK, seq=(victim + 1) % 3, coll_id=3, epoch=1, rkey=0, aux_addr=2),
            Packet(
                Opcode.READ_RESP,
                seq=seq,
                coll_id=3,
                epoch=1,
                rkey=RKEY ^ 1,
                addr=OUT,
                length=8,
                dtype=DType.F32,
                payload=b"\xff" * 8,
            ),
        ]

    run_under_forgery(11, forged)


def test_forged_datagrams_with_the_live_key_change_nothing() -> None:
    """A forger that saw a running collective's key on the wire (its rkey, coll_id and epoch are
    in every datagram; a local user reads them from the all-gather's multicast group) and sends
    from members' addresses: fatal NACKs, DONEs, READ_RESPs, ALL_WRITEs and CHAIN_ADDs of that
    very collective, WRITEs into its output under its key, and the same datagrams flagged TAGGED
    with made-up tags. Untagged (v1) collectives took them: the NACKs aborted, the ALL_WRITEs and
    READ_RESPs wrote the result. A tagged collective takes none (SPEC.md 2.6)."""
    garbage = b"\xff" * 64

    def forged(seq: int, victim: int) -> list[Packet]:
        ids = {"coll_id": 3, "epoch": 1, "rkey": RKEY}
        return [
            Packet(Opcode.NACK, status=Status.NO_RIGHTS, seq=seq, **ids),
            Packet(Opcode.ACK, seq=(victim + 1) % 3, aux_addr=2, **ids),
            Packet(Opcode.READ_RESP, seq=seq, addr=OUT, dtype=DType.F32, **ids).with_payload(
                garbage
            ),
            Packet(
                Opcode.ALL_WRITE, seq=seq, addr=OUT + 4 * 16 * seq, dtype=DType.F32, **ids
            ).with_payload(garbage),
            Packet(Opcode.WRITE, rkey=RKEY, addr=OUT + 64 * seq).with_payload(garbage),
            Packet(
                Opcode.CHAIN_ADD,
                seq=seq,
                addr=IN,
                aux_addr=OUT,
                dtype=DType.F32,
                segments=(GROUP,),
                **ids,
            ).with_payload(garbage),
        ]

    run_under_forgery(12, forged, made_up_tags=True)


def test_a_forged_chain_to_pass_on_holds_no_timer() -> None:
    """A chain a node passes on holds its own chains' timers (the collective moves there:
    "Loss recovery"), so a forger with the live key and a member's address, but not the
    collective's tag key, sends chains to pass on: they are dropped as forged before they count.
    Two members pass nothing on, so the stamp stays unset."""
    inputs = [np.full(20_000, r + 1.0, np.float32) for r in range(2)]
    cluster = make_cluster(2, memory=MEMORY)
    # The collective runs ~0.1 s of fabric time, so the forgeries land while it runs: an
    # untagged collective (no tag key) passed them on and stamped 0.035 s.
    _fifo_hop(cluster, 1, 0.001)
    ids = {"coll_id": 3, "epoch": 1, "rkey": RKEY}

    def forge(cluster: Cluster, round_: int) -> None:
        if round_ % 3 or round_ > 300:
            return
        chain = Packet(
            Opcode.CHAIN_ADD,
            seq=round_ % 4,
            addr=IN,
            aux_addr=OUT,
            dtype=DType.F32,
            segments=(cluster.endpoints[0], cluster.endpoints[1]),
            segments_left=1,
            **ids,
        ).with_payload(b"\xff" * 64)
        cluster.fabric.send(cluster.endpoints[1], cluster.endpoints[0], encode_packet(chain))

    out = run(2, inputs, cluster=cluster, on_round=forge)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    node = cluster.nodes[0]
    assert int(node.counters[C.DROP_COLL_FORGED]) > 0
    slots = node.collective
    assert slots.fcfg[slots.cfg[:, L.CFG_COLL] == 3, L.F_LAST_PASSED].tolist() == [0.0]


@pytest.mark.parametrize("tag_key", [TAG_KEY, b""], ids=["tagged", "untagged"])
def test_a_collectives_answers_carry_its_tag_or_none(tag_key: bytes) -> None:
    """A tagged collective's completion is sealed under its key (SPEC.md 2.6); a START_COLL
    with a 64-byte descriptor (no tag key) runs untagged, as before tags."""
    rng = np.random.default_rng(13)
    inputs = random_inputs(rng, 3, 5003, np.float32)
    out = run(3, inputs, tag_key=tag_key)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    for reply in out.replies:
        data = encode_packet(reply)
        assert reply.opcode == Opcode.ACK and bool(reply.flags & Flags.TAGGED) == bool(tag_key)
        assert not tag_verify(bytes(16), data)
        assert tag_verify(tag_key, data) if tag_key else reply.tag == 0


def random_inputs(rng: np.random.Generator, n: int, count: int, dtype: type) -> list[np.ndarray]:
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(count).astype(dtype) for _ in range(n)]
    return [rng.integers(-(10**6), 10**6, count).astype(dtype) for _ in range(n)]


def assert_all_equal(outputs: list[np.ndarray], expected: np.ndarray) -> None:
    for out in outputs:
        assert out.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.float64])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_all_reduce_every_dtype_and_op(dtype: type, op: ReduceOp, rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 4, 5003, dtype)
    outcome = run(4, inputs, op=op)
    assert all(r.opcode == Opcode.ACK and r.status == Status.OK for r in outcome.replies)
    assert_all_equal(outcome.outputs, all_reduce_reference(inputs, op))


@pytest.mark.parametrize("count", [1, 2, 3, 7, 2049, 6151])
def test_all_reduce_any_count(count: int, rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 3, count, np.float32)
    assert_all_equal(run(3, inputs).outputs, all_reduce_reference(inputs, ReduceOp.SUM))


@pytest.mark.parametrize("faults", [None, FaultSpec(loss=0.1, dup=0.05, reorder=0.1, seed=7)])
def test_an_emulation_mtu_carries_each_chunk_in_one_large_payload(
    faults: FaultSpec | None, rng: np.random.Generator
) -> None:
    """SPEC.md 2.7: at MTU 65000 a chunk is 61440 bytes (15360 f32 with a 3-segment SR list and
    a tag) where MTU 9000 cuts 8192: the same all-reduce, exact at both, in ~7.5x fewer
    datagrams, and exact under loss, duplicates and reordering too."""
    count = 4 * 2 * 15360 - 5  # two chunks a block at 65000, fifteen at 9000
    inputs = random_inputs(rng, 4, count, np.float32)
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    sent = {}
    for mtu in (DEFAULT_MTU, 65000):
        outcome = run(4, inputs, faults=faults, cluster=make_cluster(4, faults, MEMORY, mtu))
        assert_all_equal(outcome.outputs, expected)
        sent[mtu] = sum(int(node.counters[C.TX_PACKETS]) for node in outcome.cluster.nodes)
        chunks = [int(n.collective.last_started().cfg[L.CFG_CHUNKS]) for n in outcome.cluster.nodes]
        assert chunks == [8 if mtu == 65000 else 60] * 4, (mtu, chunks)
    if faults is None:
        # A chunk costs 3 chain hops and 3 unicast all-gather copies on 4 ranks at either MTU;
        # the rest (START answers, DONE) is per call: 52 chunks fewer, 312 datagrams fewer.
        assert sent[DEFAULT_MTU] - sent[65000] == (60 - 8) * 6, sent


def test_all_reduce_special_values(rng: np.random.Generator) -> None:
    special = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38], np.float32)
    inputs = [np.resize(np.roll(special, r), 4099) for r in range(4)]
    for op in ReduceOp:
        assert_all_equal(run(4, inputs, op=op).outputs, all_reduce_reference(inputs, op))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_all_reduce_node_counts(n: int, rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, n, 3 * 2048 + 17, np.float32)
    assert_all_equal(run(n, inputs).outputs, all_reduce_reference(inputs, ReduceOp.SUM))


def test_all_reduce_in_place_with_multicast(rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 4, 20_000, np.float32)
    outcome = run(4, inputs, multicast=True, in_place=True)
    assert_all_equal(outcome.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    totals = np.sum([node.counters for node in outcome.cluster.nodes], axis=0)
    assert totals[C.RETRANSMITS] == 0  # a clean run needs no recovery


def test_reduce_scatter(rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 4, 10_001, np.float32)
    outcome = run(4, inputs, algo=Algo.REDUCE_SCATTER)
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    for rank, out in enumerate(outcome.outputs):
        lo, hi = rank * 10_001 // 4, (rank + 1) * 10_001 // 4
        assert out[lo:hi].tobytes() == expected[lo:hi].tobytes()


def test_all_gather(rng: np.random.Generator) -> None:
    count = 9_001
    n = 3
    full = rng.standard_normal(count).astype(np.float32)
    inputs = []
    for rank in range(n):
        lo, hi = rank * count // n, (rank + 1) * count // n
        contribution = np.zeros(count, np.float32)
        contribution[: hi - lo] = full[lo:hi]  # each rank's block at IN
        inputs.append(contribution)
    outcome = run(n, inputs, algo=Algo.ALL_GATHER, multicast=True)
    assert_all_equal(outcome.outputs, full)


def _gather_inputs(
    rng: np.random.Generator, n: int, count: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """A whole vector and each rank's block of it at IN (an all-gather's inputs)."""
    full = rng.standard_normal(count).astype(np.float32)
    inputs = []
    for rank in range(n):
        lo, hi = rank * count // n, (rank + 1) * count // n
        contribution = np.zeros(count, np.float32)
        contribution[: hi - lo] = full[lo:hi]
        inputs.append(contribution)
    return full, inputs


@pytest.mark.parametrize("multicast", [False, True])
def test_a_late_member_gets_the_all_gather_sent_again_on_resume(
    multicast: bool, rng: np.random.Generator
) -> None:
    """A member whose host starts an all-gather after its peers spread their blocks drops them
    as early (SPEC.md 4.1, "BUSY and RESUME"); once started, its RESUME makes each peer send its
    block again, at once: the late member completes with no repair READ."""
    full, inputs = _gather_inputs(rng, 4, 30_000)
    out = run(4, inputs, algo=Algo.ALL_GATHER, multicast=multicast, late={3: 60})
    assert_all_equal(out.outputs, full)
    late = out.cluster.nodes[3]
    assert int(late.counters[C.DROP_COLL_EARLY]) > 0  # the skew did happen
    # No repair READ: not by the late member, and not by those waiting for its block (a
    # gather READs a block it heard nothing of only after a long stall: its owner may not have
    # started, SPEC.md 4.1).
    assert [unpack_completion(r.payload)[1] for r in out.replies] == [0, 0, 0, 0]


@pytest.mark.parametrize("forged", [True, False])
def test_only_a_resume_under_the_key_sends_a_block_again(
    forged: bool, rng: np.random.Generator
) -> None:
    """RESUME is a collective's message: from a member's source address but without the
    collective's key it is counted as forged and sends nothing again (member 1 holds node 0's
    block already and sees no duplicate); under the key (the control: an untagged, v1
    collective) the same RESUME does make node 0 send its block to member 1 again."""
    full, inputs = _gather_inputs(rng, 3, 6_000)

    def resume(cluster: Cluster, round_: int) -> None:
        if 5 <= round_ < 25:  # node 0 runs, waiting for late member 2
            packet = Packet(
                Opcode.ACK, rkey=RKEY ^ 1 if forged else RKEY, aux_addr=4, seq=1, coll_id=3, epoch=1
            )
            cluster.fabric.send(cluster.endpoints[1], cluster.endpoints[0], encode_packet(packet))

    out = run(3, inputs, algo=Algo.ALL_GATHER, on_round=resume, late={2: 40}, tag_key=b"")
    assert_all_equal(out.outputs, full)
    forgeries = int(out.cluster.nodes[0].counters[C.DROP_COLL_FORGED])
    duplicates = int(out.cluster.nodes[1].counters[C.DUP_SILENT])
    if forged:
        assert forgeries >= 20 and duplicates == 0
    else:
        assert forgeries == 0 and duplicates > 0


@pytest.mark.parametrize("resumes", [True, False])
def test_a_resume_restarts_the_timer_of_a_chain_in_flight(
    resumes: bool, rng: np.random.Generator
) -> None:
    """A hop that held a member's early chain RESUMEs its originator when it starts, and the
    originator restarts the timers of its chains in flight (SPEC.md 4.1, "Early chains"): a
    chain held at several late hops in turn is not re-sent while they keep starting. Here node
    0's first chain is lost on its way (to its originator, a held chain looks the same) and
    node 1 RESUMEs every 5 ms until 0.3 s: the chain is re-sent once, only after that, and the
    result is exact. Without the RESUMEs it is re-sent within one RTO (at most RTO_MAX_S)."""
    n, until = 3, 0.3
    inputs = random_inputs(rng, n, 600, np.float32)
    cluster = make_cluster(n, memory=MEMORY)
    lost: list[float] = []
    resent: list[float] = []
    resumed = [-1.0]

    def lose_first_chain(src: tuple[str, int], dst: tuple[str, int], data: bytes) -> bool:
        if lost or src != cluster.endpoints[0] or data[HEADER.at("opcode")] != Opcode.CHAIN_ADD:
            return False
        lost.append(cluster.fabric.now)
        return True

    resume = encode_packet(
        Packet(Opcode.ACK, rkey=RKEY, aux_addr=L.AUX_RESUME, seq=1, coll_id=3, epoch=1)
    )

    def watch(cluster: Cluster, round_: int) -> None:
        slots = cluster.nodes[0].collective.cfg
        chains = slots[slots[:, L.CFG_COLL] == 3, L.CFG_RETRANSMITS]
        if not resent and chains.size and chains.max() > 0:
            resent.append(cluster.fabric.now)
        # Every 5 ms of the fabric's clock, which moves only in rounds that deliver nothing: a
        # RESUME every few rounds (each one answered by the all-gather's chunks sent again)
        # kept every round busy and the clock still.
        now = cluster.fabric.now
        if resumes and lost and now < until and now - resumed[-1] >= 0.005:
            resumed.append(now)
            cluster.fabric.send(cluster.endpoints[1], cluster.endpoints[0], resume)

    cluster.fabric.drop_if = lose_first_chain
    out = run(n, inputs, cluster=cluster, on_round=watch, tag_key=b"")
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert lost and resent, (lost, resent)
    assert unpack_completion(out.replies[0].payload)[0] == 1  # re-sent once, either way
    if resumes:
        assert resent[0] >= until
    else:
        assert resent[0] - lost[0] <= L.RTO_MAX_S + 0.02


def test_a_multicast_gather_waits_for_every_members_started(rng: np.random.Generator) -> None:
    """A gather by multicast has no chain to prove its members started: each multicasts
    STARTED when its host starts it, and an owner spreads its block once every member's came
    (SPEC.md 4.1, "All-gather"). A member a few rounds late drops nothing as early, and nobody
    sends a block again or READs it."""
    full, inputs = _gather_inputs(rng, 4, 30_000)
    out = run(4, inputs, algo=Algo.ALL_GATHER, multicast=True, late={3: 8})
    assert_all_equal(out.outputs, full)
    totals = np.sum([node.counters for node in out.cluster.nodes], axis=0)
    assert totals[C.DROP_COLL_EARLY] == 0
    assert totals[C.RETRANSMITS] == 0
    assert [unpack_completion(r.payload)[1] for r in out.replies] == [0, 0, 0, 0]
    # Without STARTED (unicast: no group), the same skew is dropped as early and RESUMEd.
    out = run(4, inputs, algo=Algo.ALL_GATHER, multicast=False, late={3: 8})
    assert_all_equal(out.outputs, full)
    assert int(out.cluster.nodes[3].counters[C.DROP_COLL_EARLY]) > 0


def test_a_gather_waits_past_its_watchdog_for_a_member_that_has_not_started(
    rng: np.random.Generator,
) -> None:
    """A multicast gather's member that has not said STARTED is late, not dead: the others
    wait START_SKEW_STALLS watchdog periods for it (a torus's row all-gather waits for its
    slowest column, SPEC.md 4.2). Member 3 starts ~0.5 s late under a 0.2 s watchdog: exact.
    The control: the same skew in a unicast gather (no STARTEDs) fails on the watchdog."""
    full, inputs = _gather_inputs(rng, 4, 6_000)
    out = run(4, inputs, algo=Algo.ALL_GATHER, multicast=True, late={3: 100}, timeout_ms=200)
    assert [r.opcode for r in out.replies] == [Opcode.ACK] * 4
    assert_all_equal(out.outputs, full)
    skewed = run(4, inputs, algo=Algo.ALL_GATHER, multicast=False, late={3: 100}, timeout_ms=200)
    assert Status.TIMEOUT in [r.status for r in skewed.replies]


def test_a_member_that_never_starts_still_fails_the_gather_naming_its_block(
    rng: np.random.Generator,
) -> None:
    """The longer wait is bounded: member 3's host never starts, so after START_SKEW_STALLS
    watchdog periods the others fail TIMEOUT, and the missing chunks they name are its block's."""
    full, inputs = _gather_inputs(rng, 4, 6_000)
    out = run(4, inputs, algo=Algo.ALL_GATHER, multicast=True, late={3: None}, timeout_ms=200)
    assert [r.status for r in out.replies] == [Status.TIMEOUT] * 3
    assert out.cluster.fabric.now >= L.START_SKEW_STALLS * 0.2
    per_packet = max_elements(out.cluster.nodes[0].config.mtu, DType.F32, segments=3)
    cb = chunk_bounds(int(Algo.ALL_GATHER), 6_000, 4, 0, per_packet)
    for reply in out.replies:
        first, last = unpack_completion(reply.payload)
        assert cb[3] <= first <= last < cb[4]


OUTSIDER = ("127.0.0.1", 9999)  # no member of the collective: a host or another user's socket


@pytest.mark.parametrize("sender", ["member without the key", "outsider with the key", "member"])
def test_only_a_started_under_the_key_lets_a_gather_spread(
    sender: str, rng: np.random.Generator
) -> None:
    """STARTED is a collective's message: one from member 1's address saying "rank 2 started"
    but without the collective's key is counted as forged, and one with the key from an address
    that is no member's counts for nothing either: node 0 keeps its block until member 2 really
    starts (which then drops nothing as early). Under the key from a member (the control: an
    untagged, v1 collective) the same STARTED lets node 0 spread before member 2 started, and
    member 2 drops it as early. Either way the result is exact."""
    full, inputs = _gather_inputs(rng, 3, 6_000)
    forged = sender == "member without the key"

    def started(cluster: Cluster, round_: int) -> None:
        if round_ == 0:
            cluster.fabric.add_endpoint(OUTSIDER)
        if 2 <= round_ < 10:  # node 0 runs, member 2 not yet
            packet = Packet(
                Opcode.ACK,
                rkey=RKEY ^ 1 if forged else RKEY,
                aux_addr=5,
                txn_id=1,
                seq=2,
                coll_id=3,
                epoch=1,
            )
            source = OUTSIDER if sender == "outsider with the key" else cluster.endpoints[1]
            cluster.fabric.send(source, cluster.endpoints[0], encode_packet(packet))

    out = run(
        3, inputs, algo=Algo.ALL_GATHER, multicast=True, on_round=started, late={2: 12}, tag_key=b""
    )
    assert_all_equal(out.outputs, full)
    forgeries = int(out.cluster.nodes[0].counters[C.DROP_COLL_FORGED])
    early = int(out.cluster.nodes[2].counters[C.DROP_COLL_EARLY])
    if forged:
        assert forgeries > 0 and early == 0
    elif sender == "outsider with the key":
        assert early == 0
    else:
        assert forgeries == 0 and early > 0


def _busy_nacks(outcome: Outcome) -> int:
    return int(sum(int(node.counters[C.NACK_BASE + Status.BUSY]) for node in outcome.cluster.nodes))


def _is_started(data: bytes, txn: int) -> bool:
    """*data* is a STARTED (an ACK with aux_addr 5) with txn_id *txn* (1 a word, 0 a question)."""
    packet = decode_packet(data)
    return packet.opcode == Opcode.ACK and packet.aux_addr == L.AUX_STARTED and packet.txn_id == txn


@pytest.mark.parametrize("multicast", [True, False], ids=["group", "unicast"])
def test_chains_that_await_started_meet_no_member_before_it_runs(
    multicast: bool, rng: np.random.Generator
) -> None:
    """Descriptor flags bit 2 (SPEC.md 4.1, "STARTED"): every member says STARTED when its host
    starts the collective, to the group or (no group: a torus's column) to each member, and an
    originator starts its chains once every member's came. Member 3 starts 60 rounds (~0.3 s of
    fabric time, far past the 5 ms a node holds early chains) after the others: no chain meets
    it before, so nothing is answered BUSY or re-sent, and the result is exact. The control:
    the same skew without the flag is answered BUSY."""
    inputs = random_inputs(rng, 4, 4 * 20_000, np.float32)
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    out = run(4, inputs, multicast=multicast, flags=FLAG_AWAIT_STARTED, late={3: 60})
    assert_all_equal(out.outputs, expected)
    totals = np.sum([node.counters for node in out.cluster.nodes], axis=0)
    assert _busy_nacks(out) == 0 and totals[C.RETRANSMITS] == 0
    eager = run(4, inputs, multicast=multicast, late={3: 60})
    assert_all_equal(eager.outputs, expected)
    assert _busy_nacks(eager) > 0


def test_a_lost_started_is_asked_for_and_the_chains_go(rng: np.random.Generator) -> None:
    """Member 2 starts last; its STARTED to member 0 is lost, and so is the RESUME that would
    have told member 0 too (member 0's STARTED reached it before it started). Past a repair
    period member 0 asks the members it lacks (STARTED with txn_id 0), member 2 answers with
    its own, and member 0's chains go: exact, nothing answered BUSY."""
    inputs = random_inputs(rng, 3, 3 * 20_000, np.float32)
    cluster = make_cluster(3, memory=MEMORY)
    lost: dict[int, bytes] = {}  # aux_addr -> the datagram dropped
    asked: list[bytes] = []

    def lose_2s_first_words_to_0(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        if src == cluster.endpoints[0] and dst == cluster.endpoints[2] and _is_started(data, 0):
            asked.append(data)
        if src != cluster.endpoints[2] or dst != cluster.endpoints[0]:
            return False
        packet = decode_packet(data)
        word = packet.opcode == Opcode.ACK and packet.aux_addr in (L.AUX_STARTED, L.AUX_RESUME)
        if word and packet.aux_addr not in lost:
            lost[packet.aux_addr] = data
            return True
        return False

    cluster.fabric.drop_if = lose_2s_first_words_to_0
    out = run(3, inputs, cluster=cluster, flags=FLAG_AWAIT_STARTED, late={2: 4})
    assert set(lost) == {L.AUX_STARTED, L.AUX_RESUME}, lost
    assert asked, "member 0 never asked member 2 for its STARTED"
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert _busy_nacks(out) == 0
    assert out.cluster.fabric.now >= L.REPAIR_MIN_S  # member 0 waited a repair period, then asked


@pytest.mark.parametrize("algo", [Algo.REDUCE_SCATTER, Algo.ALL_REDUCE])
def test_a_member_that_starts_after_the_others_are_ready_gets_their_done_at_once(
    algo: Algo,
) -> None:
    """One element over 4 members (a torus's warm-up call): members 0-2 own empty blocks, so
    they are ready the moment they start, and their DONEs reach member 3 before it starts:
    dropped there as early. Member 3's RESUME (their STARTEDs came early) asks for them again,
    so it completes at once. Before, it asked only after a retransmission timeout (50 ms
    here); at 16 and 128 NICs a host stall had raised that timeout (4 turns of its process)
    past the watchdog, and the torus failed (docs/PERFORMANCE.md)."""
    inputs = [np.full(1, rank + 1, np.float32) for rank in range(4)]
    out = run(4, inputs, algo=algo, multicast=True, flags=FLAG_AWAIT_STARTED, late={3: 60})
    assert out.outputs[3][0] == 10.0
    phases = unpack_completion_phases(out.replies[3].payload)
    assert phases is not None and phases.done_us < 1_000 * L.RTO_MIN_S * 1_000 / 2
    totals = np.sum([node.counters for node in out.cluster.nodes], axis=0)
    assert totals[C.RETRANSMITS] == 0


def _dones_from_1_to_2(sender: str | None) -> tuple[int, int]:
    """Node 1's DONE answers to member 2, and node 1's forged-datagram count, in a one-element
    reduce-scatter over 4 (untagged, v1) whose member 3 is late, with a RESUME naming member 2
    sent to node 1 in 20 rounds by *sender* (None: nobody)."""
    inputs = [np.full(1, rank + 1, np.float32) for rank in range(4)]
    cluster = make_cluster(4, memory=MEMORY)
    source = OUTSIDER if sender == "outsider" else cluster.endpoints[2]
    answers = 0

    def count_dones_to_2(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        nonlocal answers
        packet = decode_packet(data)
        answers += (
            src == cluster.endpoints[1]
            and dst == cluster.endpoints[2]
            and packet.aux_addr == L.AUX_DONE
            and packet.txn_id == 1
        )
        return False

    def resume(cluster: Cluster, round_: int) -> None:
        if sender is None:
            return
        if round_ == 0 and sender == "outsider":
            cluster.fabric.add_endpoint(OUTSIDER)
        if 5 <= round_ < 25:
            rkey = RKEY ^ 1 if sender == "member without the key" else RKEY
            packet = Packet(Opcode.ACK, rkey=rkey, aux_addr=4, seq=2, coll_id=3, epoch=1)
            cluster.fabric.send(source, cluster.endpoints[1], encode_packet(packet))

    cluster.fabric.drop_if = count_dones_to_2
    out = run(
        4,
        inputs,
        algo=Algo.REDUCE_SCATTER,
        multicast=True,
        cluster=cluster,
        on_round=resume,
        late={3: 40},
        tag_key=b"",
    )
    assert out.outputs[3][0] == 10.0
    return answers, int(cluster.nodes[1].counters[C.DROP_COLL_FORGED])


@pytest.mark.parametrize("sender", ["outsider", "member without the key", "member"])
def test_only_a_members_resume_under_the_key_is_answered_with_a_done(sender: str) -> None:
    """A RESUME asks a ready node for its DONE (SPEC.md 4.1, "DONE"), answered to that member
    alone. Node 1 (an empty block: ready at once) gets 20 RESUMEs naming member 2 while member
    3 is late. From an outsider's address, or a member's without the key (dropped as forged),
    member 2 gets no more DONEs from node 1 than with no RESUME at all; from the member under
    the key (the control), one more for each."""
    quiet, _ = _dones_from_1_to_2(None)
    answers, forged = _dones_from_1_to_2(sender)
    if sender == "member":
        assert answers >= quiet + 10
    else:
        assert answers == quiet
        assert forged >= 20 if sender == "member without the key" else forged == 0


def test_the_watchdog_outlasts_timers_that_cover_long_host_turns() -> None:
    """Member 3's process took 0.7 s turns (a stop): its timers cover 4 of them, 2.8 s, past
    its 2.5 s watchdog. With its RESUME lost, it asks members 0-2 for the DONEs it dropped as
    early only when that RTO runs out; the watchdog waits 3 RTO floors there
    (WATCHDOG_MIN_RTOS), so the question is asked and answered, and the call completes."""
    inputs = [np.full(1, rank + 1, np.float32) for rank in range(4)]
    cluster = make_cluster(4, memory=MEMORY)
    cluster.nodes[3].collective.set_host_turn(0.7)
    resumes: list[bytes] = []

    def lose_3s_resumes(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        packet = decode_packet(data)
        if src == cluster.endpoints[3] and packet.aux_addr == L.AUX_RESUME:
            resumes.append(data)
            return packet.opcode == Opcode.ACK
        return False

    cluster.fabric.drop_if = lose_3s_resumes
    out = run(
        4,
        inputs,
        algo=Algo.REDUCE_SCATTER,
        multicast=True,
        flags=FLAG_AWAIT_STARTED,
        late={3: 60},
        cluster=cluster,
        timeout_ms=2_500,
    )
    assert resumes, "member 3 sent no RESUME to lose"
    assert [reply.opcode for reply in out.replies] == [Opcode.ACK] * 4
    assert out.outputs[3][0] == 10.0
    phases = unpack_completion_phases(out.replies[3].payload)
    assert phases is not None and phases.done_us >= 4 * 0.7 * 1e6


def test_a_failed_reduce_scatter_names_only_the_chunks_its_node_needs() -> None:
    """One element over 4, member 2 never starts: member 3 lacks the one chunk (its own block);
    members 0 and 1 own empty blocks and lack nothing but DONEs, which their failure says (no
    chunk: all ones, then the members whose DONE had not come), where it named chunk 0,
    member 3's, as missing at theirs."""
    inputs = [np.full(1, rank + 1, np.float32) for rank in range(4)]
    out = run(4, inputs, algo=Algo.REDUCE_SCATTER, late={2: None}, timeout_ms=200)
    none = (1 << 64) - 1
    missing = {rank: unpack_completion(out.replies[k].payload) for k, rank in enumerate((0, 1, 3))}
    assert all(reply.opcode == Opcode.NACK for reply in out.replies)
    # Both lack the DONEs of 2 (never started) and 3 (not ready); member 1 lacks member 0's
    # too (its chain, through member 2, was never ACKed): the bits of those group ranks.
    assert missing == {0: (none, 0b1100), 1: (none, 0b1101), 3: (0, 0)}


def _settled_epoch_ask(cluster: Cluster, rank: int, rkey: int = ADMIN_KEY) -> None:
    """COUNTERS with aux_addr COUNTERS_EPOCH for collective 3 (run's coll_id) to *rank*'s node."""
    packet = Packet(
        Opcode.COUNTERS,
        rkey=rkey,
        client_id=7,
        txn_id=100 + rank,
        coll_id=3,
        aux_addr=COUNTERS_EPOCH,
    )
    cluster.send(rank, packet)


def test_a_node_tells_the_last_epoch_of_a_collective_it_settled() -> None:
    """COUNTERS_EPOCH (SPEC.md 6.5, "Epochs"): the last epoch of the collective a node started,
    less one while it still runs (a member asking then may not have started it yet); 0 for
    one it never ran. Member 0 alone starts epoch 1 (the others never do): asked while it
    runs, its node says 0; after its watchdog, 1; the others' say 0. So a new group's ranks,
    which take the highest their members' nodes say, all go on to epoch 2. Only the admin's
    question is answered."""
    inputs = [np.ones(100, np.float32) for _ in range(4)]
    cluster = make_cluster(4, memory=MEMORY)

    def ask_while_running(cluster: Cluster, round_: int) -> None:
        if round_ == 3:
            _settled_epoch_ask(cluster, 0)

    run(
        4,
        inputs,
        cluster=cluster,
        late={1: None, 2: None, 3: None},
        timeout_ms=200,
        on_round=ask_while_running,
    )
    while_running = [decode_packet(data) for data, _ in cluster.fabric.receive(cluster.client)]
    for rank in range(4):
        _settled_epoch_ask(cluster, rank)
    _settled_epoch_ask(cluster, 0, rkey=RKEY)  # not the admin's key
    cluster.fabric.run_until_idle()
    after = [decode_packet(data) for data, _ in cluster.fabric.receive(cluster.client)]
    assert [(p.opcode, p.aux_addr) for p in while_running] == [(Opcode.ACK, 0)]
    answers = {p.txn_id - 100: p.aux_addr for p in after if p.opcode == Opcode.ACK}
    assert answers == {0: 1, 1: 0, 2: 0, 3: 0}
    assert [p.status for p in after if p.opcode == Opcode.NACK] == [Status.UNAUTHORIZED]


@pytest.mark.parametrize("sender", ["outsider", "member without the key", "member"])
def test_only_a_members_started_question_under_the_key_is_answered(
    sender: str, rng: np.random.Generator
) -> None:
    """A STARTED question (txn_id 0) is answered with the node's own STARTED, by unicast to the
    asker, only for a member under the collective's key. From an address that is no member's
    nothing is sent back (no reflection); from a member's address without the key it is
    counted as forged and answered with nothing. The control: a member's question under the
    key is answered. The collective itself is exact either way."""
    inputs = random_inputs(rng, 3, 3 * 2_000, np.float32)
    cluster = make_cluster(3, memory=MEMORY)
    fabric = cluster.fabric
    route = fabric._route
    unicast_words: list[tuple[int, int]] = []  # (source, destination) of STARTED answers

    def recording_route(src: int, dst: int, data: bytes) -> None:
        if _is_started(data, txn=1) and dst != endpoint_to_u64(GROUP):
            unicast_words.append((src, dst))
        route(src, dst, data)

    fabric._route = recording_route  # type: ignore[method-assign]

    def ask(cluster: Cluster, round_: int) -> None:
        if round_ == 0:
            fabric.add_endpoint(OUTSIDER)
        if round_ == 3:  # node 0 runs the collective
            packet = Packet(
                Opcode.ACK,
                rkey=RKEY ^ 1 if sender == "member without the key" else RKEY,
                aux_addr=L.AUX_STARTED,
                txn_id=0,
                seq=1,
                coll_id=3,
                epoch=1,
            )
            source = OUTSIDER if sender == "outsider" else cluster.endpoints[1]
            fabric.send(source, cluster.endpoints[0], encode_packet(packet))

    out = run(
        3,
        inputs,
        cluster=cluster,
        multicast=True,
        flags=FLAG_AWAIT_STARTED,
        on_round=ask,
        tag_key=b"",
    )
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    answered = (endpoint_to_u64(cluster.endpoints[0]), endpoint_to_u64(cluster.endpoints[1]))
    assert fabric.receive(OUTSIDER) == []
    forged = int(cluster.nodes[0].counters[C.DROP_COLL_FORGED])
    if sender == "member":
        assert answered in unicast_words and forged == 0
    else:
        assert answered not in unicast_words
        assert forged > 0 if sender == "member without the key" else forged == 0


def test_a_busy_hop_slow_to_read_gets_probes_not_retransmissions(rng: np.random.Generator) -> None:
    """A hop that answered BUSY (its host has not started the collective) and then reads its
    socket only after a long while (a NIC of a busy process, 4.1 "BUSY and RESUME"): the chains
    asked again meanwhile are probes, asked again after each RTO but never counted as
    retransmissions. Counted, this run made 15; the result is exact either way."""
    inputs = random_inputs(rng, 2, 20_000, np.float32)
    cluster = make_cluster(2, memory=MEMORY)
    slow = cluster.nodes[1]
    deliver = cluster.fabric._deliver_to_core
    held: list[tuple[int, bytes]] = []

    def slow_reader(core: object, items: list[tuple[int, bytes]]) -> None:
        if core is slow and 0.004 <= cluster.fabric.now < 0.25:  # 5 RTOs unread
            held.extend(items)
            return
        if core is slow and held:
            items = [*held, *items]
            held.clear()
        deliver(core, items)  # type: ignore[arg-type]

    cluster.fabric._deliver_to_core = slow_reader  # type: ignore[method-assign]
    out = run(2, inputs, cluster=cluster, late={1: 30})
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert int(slow.counters[C.NACK_BASE + Status.BUSY]) > 0  # it did say BUSY
    assert [int(node.counters[C.RETRANSMITS]) for node in cluster.nodes] == [0, 0]


def _fifo_hop(cluster: Cluster, rank: int, service_s: float) -> None:
    """Make *rank* take its datagrams one per *service_s* of fabric time, in order (a NIC
    whose process is busy: a backlog, nothing lost)."""
    fabric = cluster.fabric
    slow = endpoint_to_u64(cluster.endpoints[rank])
    free_at = [0.0]
    schedule = fabric._schedule

    def fifo_server(src: int, dst: int, data: bytes) -> None:
        if dst != slow:
            schedule(src, dst, data)
            return
        free_at[0] = max(fabric.now, free_at[0]) + service_s
        fabric._order += 1
        heapq.heappush(fabric._flight, (free_at[0], fabric._round, fabric._order, src, dst, data))

    fabric._schedule = fifo_server  # type: ignore[method-assign]


def test_a_hop_with_a_backlog_makes_chains_late_not_lost(rng: np.random.Generator) -> None:
    """A hop that takes a datagram per millisecond: the chains that cross it, and the slow
    hop's own chains, whose answers queue behind the chains it passes on, are answered up to
    ~0.2 s after they left, far past the RTO, while the collective keeps moving. Timers restart
    on progress (SPEC.md 4.1, "Loss recovery"), so nothing goes again. With a timer per chain
    from its send, this run re-sent 216, 229, 214 and 134 chains, and the re-sends deepened the
    backlog: 1.40 s of fabric time against 0.62."""
    inputs = random_inputs(rng, 4, 130_000, np.float32)
    cluster = make_cluster(4, memory=MEMORY, mtu=1500)
    _fifo_hop(cluster, 1, 0.001)
    out = run(4, inputs, cluster=cluster)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert [int(node.counters[C.RETRANSMITS]) for node in cluster.nodes] == [0, 0, 0, 0]
    assert cluster.fabric.now < 1.0


def test_a_chain_lost_mid_window_goes_again_once_on_the_later_chains_acks(
    rng: np.random.Generator,
) -> None:
    """Chains after a lost one are ACKed (their owner spreads what it stored past the gap:
    SPEC.md 4.1, "All-gather"), which tells the originator, an RTO after the send, that this
    one was lost, while the rest of the collective still moves behind a slow hop (which holds
    the timer of a chain with no later one ACKed). From then on that node's chains keep their
    own timers (its path loses datagrams: "Loss recovery"), so it re-sends chains late behind
    the slow hop too, as every node did before; the nodes that lost nothing re-send nothing."""
    inputs = random_inputs(rng, 4, 130_000, np.float32)
    cluster = make_cluster(4, memory=MEMORY, mtu=1500)
    _fifo_hop(cluster, 2, 0.001)  # the collective takes ~0.6 s of fabric time
    lost: list[float] = []
    resent: list[float] = []
    first_seq: list[int] = []

    def lose_one_chain(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        packet = decode_packet(data)
        if lost or packet.opcode != Opcode.CHAIN_ADD or src != cluster.endpoints[0]:
            return False
        if packet.segments_left != len(packet.segments) - 1:
            return False  # a chain node 0 passes on, not one of its own
        first_seq.append(packet.seq)
        if packet.seq - first_seq[0] < 40:
            return False
        lost.append(cluster.fabric.now)
        return True

    def watch(cluster: Cluster, round_: int) -> None:
        if lost and not resent and int(cluster.nodes[0].counters[C.RETRANSMITS]) > 0:
            resent.append(cluster.fabric.now)

    cluster.fabric.drop_if = lose_one_chain
    out = run(4, inputs, cluster=cluster, on_round=watch)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert lost and resent
    resends = [int(node.counters[C.RETRANSMITS]) for node in cluster.nodes]
    assert resends[0] >= 1 and resends[1:] == [0, 0, 0]
    # 0.165 s here: the later chains' round trip through the slow hop, then the RTO. Without
    # them (an owner spreading in order stops at the gap), the timer is held until the cap of
    # 3 RTOs (up to 0.3 s); with a timer per chain from its send, 194-412 chains per node went.
    assert resent[0] - lost[0] < 0.25
    assert resent[0] < cluster.fabric.now - 0.2  # the collective still ran


def test_broadcast(rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 4, 7_777, np.float64)
    outcome = run(4, inputs, algo=Algo.BROADCAST, root=2)
    assert_all_equal(outcome.outputs, inputs[2])


def test_barrier_is_a_one_element_all_reduce() -> None:
    inputs = [np.array([1], np.int32) for _ in range(5)]
    assert_all_equal(run(5, inputs).outputs, np.array([5], np.int32))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_all_reduce_under_loss_dup_reorder(
    seed: int, rate: float, rng: np.random.Generator
) -> None:
    inputs = random_inputs(rng, 4, 30_000, np.float32)
    faults = FaultSpec(loss=rate, dup=rate, reorder=rate, seed=seed)
    outcome = run(4, inputs, faults=faults, multicast=seed % 2 == 1)
    assert all(r.status == Status.OK for r in outcome.replies)
    assert_all_equal(outcome.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    totals = np.sum([node.counters for node in outcome.cluster.nodes], axis=0)
    assert totals[C.RETRANSMITS] > 0


def test_every_single_packet_dropped_in_turn(rng: np.random.Generator) -> None:
    """Drop the k-th datagram the fabric delivers, for every k of a clean run: always exact."""
    inputs = random_inputs(rng, 3, 3 * 2048, np.float32)
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    clean = run(3, inputs)
    total = clean.cluster.fabric.stats["delivered"]
    for k in range(total):
        cluster = make_cluster(3, memory=MEMORY)
        cluster.fabric.drop_nth = k
        outcome = run(3, inputs, cluster=cluster)
        assert_all_equal(outcome.outputs, expected)


def test_duplicate_chains_after_ack_and_resend_after_gather(rng: np.random.Generator) -> None:
    """Every chain packet duplicated after its ACK, and every chain re-sent once the all-gather
    started: the guard re-ACKs, nothing is added twice."""
    inputs = random_inputs(rng, 4, 12_000, np.float32)
    outcome = run(4, inputs, faults=FaultSpec(dup=1.0, seed=9), multicast=True)
    assert_all_equal(outcome.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    cluster = outcome.cluster
    # Re-send every chain of the finished epoch by hand: re-ACKed, memory unchanged.
    before = [n.memory.copy() for n in cluster.nodes]
    reacks_before = sum(int(n.counters[C.CHAIN_REACKS]) for n in cluster.nodes)
    for node in cluster.nodes:  # every originator forgets its ACKs, as if all were lost
        engine = node.collective.last_started()
        origin = int(engine.cfg[L.CFG_ORIG_BLOCK])
        first, last = int(engine.cb[origin]), int(engine.cb[origin + 1])
        engine.acked[first:last] = 0
        engine.sent[first:last] = 0.0
        engine.cfg[L.CFG_ACKED] -= last - first
        engine.cfg[L.CFG_LOW_UNACKED] = first
        engine.cfg[L.CFG_STATE] = L.STATE_RUNNING
    cluster.fabric.run_until_idle()
    for node, snapshot in zip(cluster.nodes, before, strict=True):
        np.testing.assert_array_equal(node.memory, snapshot)
    resent = sum(int(n.counters[C.CHAIN_REACKS]) for n in cluster.nodes) - reacks_before
    assert resent >= sum(
        int(n.collective.last_started().cfg[L.CFG_CHUNKS]) for n in cluster.nodes[:1]
    )


def test_stale_epoch_dropped(rng: np.random.Generator) -> None:
    inputs = random_inputs(rng, 3, 4096, np.float32)
    outcome = run(3, inputs, epoch=5)
    cluster = outcome.cluster
    old = Packet(
        Opcode.CHAIN_ADD,
        rkey=RKEY,
        addr=IN,
        aux_addr=OUT,
        dtype=DType.F32,
        coll_id=3,
        epoch=4,
        segments=(cluster.endpoints[1],),
        length=8,
        payload=bytes(8),
    )
    assert cluster.request(1, old) == []
    assert cluster.nodes[1].counters[C.DROP_STALE_EPOCH] == 1


def test_bad_descriptors_are_refused() -> None:
    cluster = make_cluster(2, memory=MEMORY)
    host = hosts(1)[0]
    cluster.fabric.add_endpoint(host)

    def start(desc: CollectiveDescriptor, **kw: object) -> Packet:
        fields = dict(
            rkey=ADMIN_KEY,
            coll_id=3,
            epoch=1,
            dtype=DType.F32,
            segments=tuple(cluster.endpoints),
            payload=desc.encode(),
            length=64,
        )
        fields.update(kw)
        cluster.fabric.send(
            host, cluster.endpoints[0], encode_packet(Packet(Opcode.START_COLL, **fields))
        )
        cluster.fabric.run_until_idle()
        (reply,) = [decode_packet(d) for d, _ in cluster.fabric.receive(host)]
        return reply

    good = CollectiveDescriptor(Algo.ALL_REDUCE, 0, 100, IN, OUT, RKEY)
    assert start(good, rkey=1).status == Status.UNAUTHORIZED
    assert (
        start(CollectiveDescriptor(Algo.ALL_REDUCE, 1, 100, IN, OUT, RKEY)).status
        == Status.BAD_SEGMENT
    )
    # A key no region has names this collective's own key (SPEC.md 4.1): its buffers must then
    # lie in registered memory, and beyond it they do not.
    assert (
        start(CollectiveDescriptor(Algo.ALL_REDUCE, 0, 100, MEMORY, MEMORY, 0xBAD)).status
        == Status.BAD_RKEY
    )
    assert (
        start(CollectiveDescriptor(Algo.ALL_REDUCE, 0, 100, IN, MEMORY - 8, RKEY)).status
        == Status.OUT_OF_BOUNDS
    )
    assert (
        start(CollectiveDescriptor(Algo.ALL_REDUCE, 0, 100, IN, OUT + 2, RKEY)).status
        == Status.MISALIGNED
    )
    assert start(good, dtype=DType.RAW).status == Status.BAD_DTYPE
    assert start(good, coll_id=0).status == Status.BAD_FIELD
    # A member named twice, asked twice: the engine caches a list's members by the list, and
    # the cached answer must be the first's.
    twice = (cluster.endpoints[0], cluster.endpoints[0])
    for _ in range(2):
        assert start(good, segments=twice).status == Status.BAD_SEGMENT


# ---------------------------------------------------------------- sparse mode (SPEC.md 2.5, 4.1)


def sparse_inputs(
    rng: np.random.Generator, n: int, count: int, dtype: type, density: float
) -> list[np.ndarray]:
    dense = random_inputs(rng, n, count, dtype)
    return [
        np.where(rng.random(count) < density, x, np.zeros(1, dtype)).astype(dtype) for x in dense
    ]


def run_both(n: int, inputs: list[np.ndarray], **kwargs: object) -> tuple[Outcome, Outcome]:
    """The same inputs dense and sparse; both bitwise equal the chain-order reference."""
    op = kwargs.get("op", ReduceOp.SUM)
    assert isinstance(op, ReduceOp)
    expected = all_reduce_reference(inputs, op)
    dense = run(n, inputs, **kwargs)
    sparse = run(n, inputs, flags=1, **kwargs)
    for outcome in (dense, sparse):
        assert all(r.opcode == Opcode.ACK and r.status == Status.OK for r in outcome.replies)
        assert_all_equal(outcome.outputs, expected)
    return dense, sparse


def _tx_bytes(outcome: Outcome) -> int:
    return sum(int(node.counters[C.TX_BYTES]) for node in outcome.cluster.nodes)


def _chains(outcome: Outcome) -> int:
    return sum(
        int(node.counters[C.OPCODE_BASE + Opcode.CHAIN_ADD]) for node in outcome.cluster.nodes
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_sparse_all_reduce_equals_dense(dtype: type, rng: np.random.Generator) -> None:
    inputs = sparse_inputs(rng, 4, 20_000, dtype, 0.1)
    dense, sparse = run_both(4, inputs, multicast=True)
    assert _tx_bytes(sparse) < _tx_bytes(dense) * 0.6


@pytest.mark.parametrize("op", list(ReduceOp))
def test_sparse_negative_zero_denormals_and_zero_chunks(
    op: ReduceOp, rng: np.random.Generator
) -> None:
    count = 12_000
    inputs = sparse_inputs(rng, 3, count, np.float32, 0.05)
    tiny = np.float32(1e-45)  # a denormal
    inputs[0][10:20] = -0.0
    inputs[1][15:25] = tiny
    inputs[2][30] = -tiny
    for x in inputs:
        x[2048 * 2 : 2048 * 3] = 0.0  # a whole chunk zero everywhere: skipped
        x[count // 3 : count // 3 + 100] = 0.0  # an all-zero run inside a chunk
    inputs[1][9000:11000] = rng.standard_normal(2000).astype(np.float32)  # dense chunks
    dense, sparse = run_both(3, inputs, op=op, in_place=True)
    assert _chains(sparse) < _chains(dense)


def test_sparse_all_zero_input_skips_every_chain() -> None:
    inputs = [np.zeros(9000, np.float32) for _ in range(4)]
    dense, sparse = run_both(4, inputs)
    assert _chains(sparse) == 0 < _chains(dense)


def test_sparse_reduce_scatter(rng: np.random.Generator) -> None:
    inputs = sparse_inputs(rng, 4, 9000, np.int32, 0.1)
    for x in inputs:
        x[:2500] = 0
    expected = all_reduce_reference(inputs, ReduceOp.SUM)
    outcome = run(4, inputs, algo=Algo.REDUCE_SCATTER, flags=1)
    for rank, out in enumerate(outcome.outputs):
        lo, hi = rank * 9000 // 4, (rank + 1) * 9000 // 4
        assert out[lo:hi].tobytes() == expected[lo:hi].tobytes()


@pytest.mark.parametrize("multicast", [False, True])
def test_sparse_under_loss_duplication_and_reordering(
    multicast: bool, rng: np.random.Generator
) -> None:
    inputs = sparse_inputs(rng, 4, 30_000, np.float32, 0.1)
    for x in inputs:
        x[:5000] = 0.0
    faults = FaultSpec(seed=7, loss=0.2, dup=0.2, reorder=0.2)
    outcome = run(4, inputs, faults=faults, multicast=multicast, flags=1)
    assert_all_equal(outcome.outputs, all_reduce_reference(inputs, ReduceOp.SUM))


def test_sparse_flag_rejected_for_gathers() -> None:
    inputs = [np.ones(10, np.float32) for _ in range(2)]
    cluster = make_cluster(2, None, memory=MEMORY)
    desc = CollectiveDescriptor(Algo.ALL_GATHER, 0, 20, IN, OUT, RKEY, flags=1)
    start = Packet(
        Opcode.START_COLL,
        rkey=ADMIN_KEY,
        coll_id=3,
        epoch=1,
        dtype=DType.F32,
        segments=tuple(cluster.endpoints),
        payload=desc.encode(),
        length=64,
    )
    host = ("127.0.0.1", 9100)
    cluster.fabric.add_endpoint(host)
    cluster.fabric.send(host, cluster.endpoints[0], encode_packet(start))
    cluster.fabric.run_until_idle()
    replies = [decode_packet(d) for d, _ in cluster.fabric.receive(host)]
    assert [(r.opcode, r.status) for r in replies] == [(Opcode.NACK, Status.BAD_FIELD)]
    del inputs


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.float64])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce_scatter_every_dtype_and_op(
    dtype: type, op: ReduceOp, rng: np.random.Generator
) -> None:
    inputs = random_inputs(rng, 3, 4099, dtype)
    outcome = run(3, inputs, algo=Algo.REDUCE_SCATTER, op=op)
    expected = all_reduce_reference(inputs, op)
    for rank, out in enumerate(outcome.outputs):
        lo, hi = rank * 4099 // 3, (rank + 1) * 4099 // 3
        assert out[lo:hi].tobytes() == expected[lo:hi].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.float64])
def test_all_gather_and_broadcast_every_dtype(dtype: type, rng: np.random.Generator) -> None:
    count, n = 5_003, 3
    full = random_inputs(rng, 1, count, dtype)[0]
    blocks = []
    for rank in range(n):
        lo, hi = rank * count // n, (rank + 1) * count // n
        contribution = np.zeros(count, dtype)
        contribution[: hi - lo] = full[lo:hi]
        blocks.append(contribution)
    assert_all_equal(run(n, blocks, algo=Algo.ALL_GATHER).outputs, full)
    inputs = random_inputs(rng, n, count, dtype)
    assert_all_equal(run(n, inputs, algo=Algo.BROADCAST, root=1).outputs, inputs[1])


def _chain_traffic(cluster: Cluster, lose: Callable[[Endpoint, Endpoint, bytes], bool]) -> dict:
    """Counts, between nodes, of chains sent with and without ACK_REQ and of the chain ACKs
    (an ACK echoes the chain's aux_addr, its store address: not one of the engine's own
    answers, DONE, BITMAP, RESUME, STARTED), with *lose* deciding which datagrams are dropped."""
    seen = {"asked": 0, "unasked": 0, "acks": 0}
    nodes = set(cluster.endpoints)
    engine_answers = {L.AUX_DONE, L.AUX_BITMAP, L.AUX_RESUME, L.AUX_STARTED}

    def watch(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        opcode = data[HEADER.at("opcode")]
        if src in nodes and dst in nodes:
            first_hop = HEADER.read(data, "segments_left") == HEADER.read(data, "seg_count") - 1
            if opcode == Opcode.CHAIN_ADD and first_hop:
                asked = HEADER.read(data, "flags") & Flags.ACK_REQ
                seen["asked" if asked else "unasked"] += 1
            elif opcode == Opcode.ACK and HEADER.read(data, "aux_addr") not in engine_answers:
                seen["acks"] += 1
        return lose(src, dst, data)

    cluster.fabric.drop_if = watch
    return seen


def _lose_first_gather_to_its_originator(cluster: Cluster) -> tuple[list[bytes], dict]:
    """Drop the first ALL_WRITE node 0 (an owner) sends node 1 (its block's chain originator)
    and count the chain traffic (_chain_traffic): (the dropped datagram, once dropped; counts)."""
    owner, originator = cluster.endpoints[0], cluster.endpoints[1]
    lost: list[bytes] = []

    def lose_first_gather(src: Endpoint, dst: Endpoint, data: bytes) -> bool:
        if lost or (src, dst) != (owner, originator):
            return False
        if data[HEADER.at("opcode")] != Opcode.ALL_WRITE:
            return False
        lost.append(data)
        return True

    return lost, _chain_traffic(cluster, lose_first_gather)


@pytest.mark.parametrize("multicast", [True, False])
def test_an_all_reduces_gather_acknowledges_its_chains(
    multicast: bool, rng: np.random.Generator
) -> None:
    """A dense all-reduce's chains ask no ACK on their first send: the owner's ALL_WRITE of
    the chunk, which its originator receives like every member, frees the originator's window
    (SPEC.md 4.1, "Reduce-scatter by chain"). A clean run has no chain ACK and no re-send; a
    reduce-scatter, which spreads nothing, still asks for and gets each ACK."""
    n = 4
    inputs = random_inputs(rng, n, 9000, np.float32)
    cluster = make_cluster(n, memory=MEMORY)
    seen = _chain_traffic(cluster, lambda src, dst, data: False)
    out = run(n, inputs, cluster=cluster, multicast=multicast)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert seen["unasked"] > 0 and seen["asked"] == 0 and seen["acks"] == 0, seen
    assert [unpack_completion(r.payload)[0] for r in out.replies] == [0] * n  # no re-send

    cluster = make_cluster(n, memory=MEMORY)
    seen = _chain_traffic(cluster, lambda src, dst, data: False)
    run(n, inputs, algo=Algo.REDUCE_SCATTER, cluster=cluster, multicast=multicast)
    assert seen["unasked"] == 0 and seen["asked"] == seen["acks"] > 0, seen


def test_a_chain_whose_gather_chunk_was_lost_is_acknowledged_by_its_resend(
    rng: np.random.Generator,
) -> None:
    """The owner's ALL_WRITE that was to acknowledge a chain is lost on its way to the chain's
    originator: the originator sends the chain again after its RTO, asking ACK_REQ, and the
    owner (which stored it already) ACKs it without adding it twice; the originator READs the
    chunk it missed. The result is exact."""
    n = 3
    inputs = random_inputs(rng, n, 3000, np.float32)
    cluster = make_cluster(n, memory=MEMORY)
    lost, seen = _lose_first_gather_to_its_originator(cluster)
    out = run(n, inputs, cluster=cluster)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert lost and seen["asked"] == 1 and seen["acks"] == 1, seen
    assert int(cluster.nodes[0].counters[C.CHAIN_REACKS]) == 1
    assert unpack_completion(out.replies[1].payload)[0] >= 1  # the originator's re-send


def test_only_an_all_write_the_node_takes_acknowledges_a_chain(rng: np.random.Generator) -> None:
    """The ALL_WRITE that would acknowledge a chain is lost; in its place the originator gets
    a copy with its tag changed, from the owner's address (a sender without the collective's
    tag key). It is dropped and counted, so it acknowledges nothing: the chain is sent again,
    asking ACK_REQ, and the result is exact. (A copy with the real tag and another payload
    from the owner's own address is SPEC.md 2.6's documented residual: the tag skips the
    payload; a non-member is refused by the members-only collective key first,
    tests/security.)"""
    n = 3
    inputs = random_inputs(rng, n, 3000, np.float32)
    cluster = make_cluster(n, memory=MEMORY)
    lost, seen = _lose_first_gather_to_its_originator(cluster)
    forged: list[bool] = []

    def forge(cluster: Cluster, round_: int) -> None:
        if lost and not forged:
            changed = bytearray(lost[0])
            changed[-1] ^= 1  # the tag's last byte
            cluster.fabric.send(cluster.endpoints[0], cluster.endpoints[1], bytes(changed))
            forged.append(True)

    out = run(n, inputs, cluster=cluster, on_round=forge)
    assert_all_equal(out.outputs, all_reduce_reference(inputs, ReduceOp.SUM))
    assert forged and seen["asked"] == 1 and seen["acks"] == 1, seen
    assert int(cluster.nodes[1].counters[C.DROP_COLL_FORGED]) == 1
