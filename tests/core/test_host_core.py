"""The host's side of a collective, sans-I/O (netdam/core/host.py): ranks' call queues against
node cores on the in-memory fabric, with the fabric's hand clock as ``now``. Every rule the
socket shell (netdam.api) relies on is tried here without a socket or a sleep: completion,
a lost START_COLL sent again, BUSY and its backoff, a silent node failing its call, a node past
the group's epoch, and answers that are not the call's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
from helpers import ADMIN_KEY, RKEY, Cluster, make_cluster
from reference import all_reduce_reference

from netdam.core.faults import FaultSpec
from netdam.core.host import (
    BUSY_BACKOFF_MAX_S,
    BUSY_BACKOFF_S,
    SILENCE_GRACE_S,
    START_RESEND_S,
    UNANSWERED_RESEND_S,
    Call,
    CallQueue,
    Heard,
)
from netdam.kernels import collective as L
from netdam.kernels.wire import find_rkey
from netdam.protocol.constants import DType, Opcode, ReduceOp, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import Algo, CollectiveDescriptor, pack_completion, unpack_descriptor
from netdam.protocol.tag import seal

COUNT = 3_001  # elements per collective: a few chunks per block on 4 nodes
SPAN = COUNT * 4


@dataclass
class Group:
    """A group as the call queue sees it (CallGroup): one rank's place and the epoch counter."""

    rank: int
    coll_id: int
    epoch: int = 0

    def descriptor_for_epoch(self, packet: Packet, epoch: int) -> Packet:
        desc = unpack_descriptor(packet.payload)
        return replace(
            packet,
            epoch=epoch,
            payload=replace(desc, tag_key=tag_key(self.coll_id, epoch)).encode(),
        )


def tag_key(coll_id: int, epoch: int) -> bytes:
    return bytes([coll_id & 0xFF, epoch & 0xFF] * 8)


def own_key(coll_id: int) -> int:
    """A key of one collective's own (SPEC.md 4.1), which its node scopes over its buffers."""
    return 0x7000_0000 + coll_id


def start_packet(cluster: Cluster, group: Group, slot: int, own: bool = False) -> Packet:
    """START_COLL of *group*'s next epoch: an all-reduce of the slot-th pair of buffers, under
    the registered region's key, or (*own*) a key of the collective's own."""
    group.epoch += 1
    desc = CollectiveDescriptor(
        Algo.ALL_REDUCE,
        group.rank,
        COUNT,
        2 * slot * SPAN,
        (2 * slot + 1) * SPAN,
        own_key(group.coll_id) if own else RKEY,
        timeout_ms=30_000,
        tag_key=tag_key(group.coll_id, group.epoch),
    )
    return Packet(
        Opcode.START_COLL,
        rkey=ADMIN_KEY,
        coll_id=group.coll_id,
        epoch=group.epoch,
        dtype=DType.F32,
        reduce_op=ReduceOp.SUM,
        segments=tuple(cluster.endpoints),
    ).with_payload(desc.encode())


def _as_sent(packet: Packet) -> bytes:
    """The call queue's encode with no sealing: the packet's bytes."""
    return encode_packet(packet)


class Host:
    """One rank's host on the fabric: a mailbox and its call queue (the api's shell, by hand)."""

    def __init__(self, cluster: Cluster, rank: int, client_id: int, lanes: int = 4) -> None:
        self.cluster, self.rank = cluster, rank
        self.endpoint: Endpoint = ("127.0.0.1", 9400 + client_id)
        self.node = cluster.endpoints[rank]
        self.queue = CallQueue(client_id, lanes, _as_sent)
        self.heard: list[tuple[Call | None, Heard]] = []
        cluster.fabric.add_endpoint(self.endpoint)

    def send(self, datagrams: list[bytes]) -> None:
        for data in datagrams:
            self.cluster.fabric.send(self.endpoint, self.node, data)

    def issue(self, call: Call, lane: int) -> None:
        self.send(self.queue.issue(call, lane, self.cluster.fabric.now))

    def turn(self) -> None:
        now = self.cluster.fabric.now
        for data, _ in self.cluster.fabric.receive(self.endpoint):
            call, heard, out = self.queue.receive(data, now)
            self.heard.append((call, heard))
            self.send(out)
        out, _ = self.queue.tick(now)
        self.send(out)


def drive(
    cluster: Cluster, hosts: list[Host], done: Callable[[], bool], seconds: float = 60.0
) -> None:
    """Run fabric and hosts until *done*, the clock jumping 5 ms whenever nothing moves."""
    while not done():
        assert cluster.fabric.now < seconds, "calls still running at the hand clock's limit"
        for host in hosts:
            host.turn()
        if cluster.fabric.step() == 0:
            cluster.fabric.advance(0.005)


def stage(cluster: Cluster, rng: np.random.Generator, slot: int) -> list[np.ndarray]:
    inputs = [rng.standard_normal(COUNT).astype(np.float32) for _ in cluster.nodes]
    for node, data in zip(cluster.nodes, inputs):
        node.memory[2 * slot * SPAN : 2 * slot * SPAN + SPAN] = data.view(np.uint8)
    return inputs


def assert_exact(cluster: Cluster, inputs: list[np.ndarray], slot: int) -> None:
    expected = all_reduce_reference(inputs, ReduceOp.SUM).tobytes()
    for rank, node in enumerate(cluster.nodes):
        assert node.memory[(2 * slot + 1) * SPAN : (2 * slot + 2) * SPAN].tobytes() == expected, (
            f"rank {rank}"
        )


def issue_in_one_lane(
    cluster: Cluster,
    hosts: list[Host],
    coll_id: int,
    slots: int,
    lane: int,
    held_first: bool = False,
) -> list[list[Call]]:
    """Every host issues *slots* calls of one group into *lane* (the first held, if
    *held_first*); each host's calls, by rank."""
    calls: list[list[Call]] = [[] for _ in hosts]
    for host in hosts:
        group = Group(host.rank, coll_id=coll_id)
        for slot in range(slots):
            call = Call(group, start_packet(cluster, group, slot), watchdog_s=30.0)
            call.held = held_first and slot == 0
            host.issue(call, lane=lane)
            calls[host.rank].append(call)
    return calls


@pytest.mark.parametrize("loss", [0.0, 0.2])
def test_two_lanes_of_four_ranks_complete_exact(loss: float) -> None:
    cluster = make_cluster(
        4, FaultSpec(seed=31, loss=loss, dup=loss / 2, reorder=loss / 2) if loss else None
    )
    rng = np.random.default_rng(31)
    hosts = [Host(cluster, r, 70 + r) for r in range(4)]
    inputs = [stage(cluster, rng, slot) for slot in range(2)]
    calls = []
    for host in hosts:
        for slot in range(2):
            group = Group(host.rank, coll_id=500 + slot)
            call = Call(group, start_packet(cluster, group, slot), watchdog_s=30.0)
            host.issue(call, lane=slot)
            calls.append(call)
    drive(cluster, hosts, lambda: all(c.ended for c in calls))
    assert all(c.done and not c.failed for c in calls)
    for slot in range(2):
        assert_exact(cluster, inputs[slot], slot)
    for call in calls:
        assert call.started and call.started_at is not None and call.completed_at is not None
        assert call.sent_at <= call.started_at <= call.completed_at
        assert call.node_phases is not None and set(call.stats) == {"retransmits", "repair_reads"}
    assert all(not h.queue.heads() for h in hosts)


def test_calls_of_one_lane_go_one_at_a_time_in_issue_order() -> None:
    cluster = make_cluster(2)
    rng = np.random.default_rng(32)
    hosts = [Host(cluster, r, 80 + r) for r in range(2)]
    inputs = [stage(cluster, rng, slot) for slot in range(3)]
    calls = issue_in_one_lane(cluster, hosts, coll_id=600, slots=3, lane=0)
    for host in hosts:
        assert [c.sent for c in calls[host.rank]] == [True, False, False]  # the rest wait
        assert host.queue.queued()
    drive(cluster, hosts, lambda: all(c.ended for cs in calls for c in cs))
    for cs in calls:
        assert all(c.done for c in cs)
        assert cs[0].completed_at <= cs[1].sent_at and cs[1].completed_at <= cs[2].sent_at
    for slot in range(3):
        assert_exact(cluster, inputs[slot], slot)


def test_a_held_call_keeps_its_place_in_its_lane_until_released() -> None:
    """A torus step is queued when its all-reduce is issued but may start only when the step
    before it ended on this rank: held, it keeps its lane's issue order (the same on every
    rank) and goes once released. Before, it was queued only then, behind calls its members
    issued later, and two ranks of a row waited on each other until the watchdog fired."""
    cluster = make_cluster(2)
    rng = np.random.default_rng(33)
    hosts = [Host(cluster, r, 84 + r) for r in range(2)]
    inputs = [stage(cluster, rng, slot) for slot in range(2)]
    calls = issue_in_one_lane(cluster, hosts, coll_id=610, slots=2, lane=1, held_first=True)
    for host in hosts:
        assert [c.sent for c in calls[host.rank]] == [False, False]  # the later one waits too
    cluster.fabric.advance(30.0 + 3 * SILENCE_GRACE_S)  # past watchdog and grace
    for host in hosts:
        host.turn()  # a held head is neither sent again nor judged silent
    assert not any(c.sent or c.ended for cs in calls for c in cs)
    for host in hosts:
        host.send(host.queue.release(calls[host.rank][0], cluster.fabric.now))
    assert all(cs[0].sent and not cs[1].sent for cs in calls)
    drive(cluster, hosts, lambda: all(c.ended for cs in calls for c in cs), seconds=120.0)
    assert all(c.done for cs in calls for c in cs)
    for slot in range(2):
        assert_exact(cluster, inputs[slot], slot)


def test_a_cancelled_held_call_ends_unsent_and_its_lane_goes_on() -> None:
    cluster = make_cluster(2)
    hosts = [Host(cluster, r, 88 + r) for r in range(2)]
    host = hosts[0]
    group = Group(0, coll_id=620)
    held = Call(group, start_packet(cluster, group, 0), watchdog_s=30.0, held=True)
    after = Call(group, start_packet(cluster, group, 1), watchdog_s=30.0)
    host.issue(held, lane=2)
    host.issue(after, lane=2)
    host.queue.cancel(held)
    assert held.ended and not held.sent and not held.failed
    out = host.queue.advance(cluster.fabric.now)
    assert len(out) == 1 and decode_packet(out[0]).epoch == after.packet.epoch and after.sent
    with pytest.raises(ValueError, match="was sent"):
        host.queue.cancel(after)


def test_a_lost_start_coll_goes_again_after_the_resend_interval() -> None:
    cluster = make_cluster(2)
    cluster.fabric.drop_nth = 0  # the first datagram: rank 0's START_COLL
    rng = np.random.default_rng(33)
    hosts = [Host(cluster, r, 90 + r) for r in range(2)]
    inputs = stage(cluster, rng, 0)
    calls = []
    for host in hosts:
        group = Group(host.rank, coll_id=700)
        calls.append(Call(group, start_packet(cluster, group, 0), watchdog_s=30.0))
        host.issue(calls[-1], lane=0)
    drive(cluster, hosts, lambda: all(c.ended for c in calls))
    assert all(c.done for c in calls)
    lost = calls[0]
    assert lost.started_at is not None and lost.started_at - lost.sent_at >= START_RESEND_S
    assert_exact(cluster, inputs, 0)


def test_a_call_past_the_slots_is_refused_busy_backs_off_and_runs() -> None:
    """Two jobs' hosts on each of 3 nodes, 3 lanes each: 6 collectives for 4 slots."""
    cluster = make_cluster(3)
    rng = np.random.default_rng(34)
    hosts = [Host(cluster, r, 100 + 10 * job + r, lanes=3) for job in range(2) for r in range(3)]
    inputs = [stage(cluster, rng, slot) for slot in range(6)]
    calls = []
    for host in hosts:
        job = (host.queue.client_id - 100) // 10
        for lane in range(3):
            slot = 3 * job + lane
            group = Group(host.rank, coll_id=800 + slot)
            calls.append(Call(group, start_packet(cluster, group, slot), watchdog_s=30.0))
            host.issue(calls[-1], lane)
    # Up to the first BUSY answer only: its backoff starts at BUSY_BACKOFF_S.
    drive(cluster, hosts, lambda: any(heard is Heard.BUSY for h in hosts for _, heard in h.heard))
    refused = next(c for c in calls if c.refused)
    assert refused.busy_answers == 1 and refused.backoff_s == 2 * BUSY_BACKOFF_S
    assert refused.resend_at == pytest.approx(cluster.fabric.now + BUSY_BACKOFF_S)
    drive(cluster, hosts, lambda: all(c.ended for c in calls))
    assert all(c.done for c in calls)
    assert sum(c.busy_answers for c in calls) > 0
    assert all(c.backoff_s <= BUSY_BACKOFF_MAX_S for c in calls)
    for slot in range(6):
        assert_exact(cluster, inputs[slot], slot)


def test_a_silent_node_fails_the_head_call_after_its_watchdog_and_grace() -> None:
    queue = CallQueue(5, 2, _as_sent)
    cluster = make_cluster(2)
    group = Group(0, coll_id=900)
    call = Call(group, start_packet(cluster, group, 0), watchdog_s=2.0)
    sent = queue.issue(call, 0, now=10.0)
    assert len(sent) == 1 and call.sent_at == 10.0
    now = 10.0
    sent_at = []
    while now < 10.0 + 2.0 + SILENCE_GRACE_S - 0.05:
        now += 0.01
        out, silent = queue.tick(now)
        assert not silent
        sent_at += [now] * len(out)
    # Asked again after START_RESEND_S, then every UNANSWERED_RESEND_S while nothing answers.
    assert sent_at[0] == pytest.approx(10.0 + START_RESEND_S, abs=0.011)
    gaps = np.diff(sent_at)
    assert np.all(np.abs(gaps - UNANSWERED_RESEND_S) < 0.011), gaps
    out, silent = queue.tick(now + 0.1)
    assert (
        silent == [call] and call.failed and call.ended and call.silent_s == 2.0 + SILENCE_GRACE_S
    )
    assert not queue.heads()  # the lane moved on
    # A *timeout* given by the waiter overrides the watchdog's bound.
    other = Call(group, start_packet(cluster, group, 0), watchdog_s=2.0)
    queue.issue(other, 1, now=20.0)
    assert queue.tick(20.4, timeout=0.5)[1] == []
    assert queue.tick(20.6, timeout=0.5)[1] == [other] and other.silent_s == 0.5


def test_a_node_past_the_groups_epoch_moves_the_call_on() -> None:
    """A group made again counts from epoch 1; the nodes already ran epoch 1 of its coll_id:
    STALE_EPOCH names their epoch, every rank moves past it, re-keys, and the call runs."""
    cluster = make_cluster(2)
    rng = np.random.default_rng(35)
    hosts = [Host(cluster, r, 110 + r) for r in range(2)]
    first = []
    for host in hosts:
        group = Group(host.rank, coll_id=1000)
        first.append(Call(group, start_packet(cluster, group, 0), watchdog_s=30.0))
        host.issue(first[-1], 0)
    drive(cluster, hosts, lambda: all(c.ended for c in first))
    inputs = stage(cluster, rng, 1)
    again = []
    hosts = [Host(cluster, r, 120 + r) for r in range(2)]  # new processes: a repeat from the
    for host in hosts:  # same client would be a retry of the call that ended
        group = Group(host.rank, coll_id=1000)  # a new group of the same coll_id: epoch 1 again
        again.append(Call(group, start_packet(cluster, group, 1), watchdog_s=30.0))
        host.issue(again[-1], 0)
    drive(cluster, hosts, lambda: all(c.ended for c in again))
    assert all(c.done for c in again)
    assert all(c.packet.epoch == 2 and c.group.epoch == 2 for c in again)
    assert all(any(heard is Heard.REBASED for _, heard in h.heard) for h in hosts)
    assert unpack_descriptor(again[0].packet.payload).tag_key == tag_key(1000, 2)
    assert_exact(cluster, inputs, 1)


def test_answers_that_are_not_the_calls_own_change_nothing() -> None:
    """Who may end or fail a call: its node, under the call's tag key. A forged completion
    (no tag, or another key's), another client's answer, an unknown txn and garbage are
    ignored; the tagged NACK fails it."""
    cluster = make_cluster(2)
    queue = CallQueue(7, 1, _as_sent)
    group = Group(0, coll_id=1100)
    call = Call(group, start_packet(cluster, group, 0), watchdog_s=30.0)
    queue.issue(call, 0, now=1.0)
    key = tag_key(1100, 1)

    def answer(opcode: Opcode, **kw: object) -> bytes:
        fields = {"client_id": 7, "txn_id": call.txn, "coll_id": 1100, "epoch": 1, **kw}
        return encode_packet(Packet(opcode, **fields))

    completion = encode_packet(
        Packet(
            Opcode.ACK,
            client_id=7,
            txn_id=call.txn,
            coll_id=1100,
            epoch=1,
            aux_addr=1,
            payload=pack_completion(0, 0),
            length=16,
        )
    )
    forged = [
        completion,  # untagged
        seal(bytes(16), completion),  # another key
        encode_packet(
            Packet(Opcode.ACK, client_id=8, txn_id=call.txn, aux_addr=1)
        ),  # another client
        answer(Opcode.ACK, txn_id=call.txn ^ 1, aux_addr=1),  # no such call
        b"\x01\x02garbage",
    ]
    for data in forged:
        assert queue.receive(data, 2.0)[1] is Heard.NOTHING
    assert not call.ended and call.heard_at == 1.0
    # An untagged "running" ACK only keeps the wait alive; a tagged NACK decides.
    assert queue.receive(answer(Opcode.ACK), 3.0)[1] is Heard.STARTED and call.heard_at == 3.0
    nack = seal(key, answer(Opcode.NACK, status=Status.BAD_FIELD))
    got, heard, out = queue.receive(nack, 4.0)
    assert (
        got is call
        and heard is Heard.FAILED
        and call.nack is not None
        and call.nack.status == Status.BAD_FIELD
    )
    assert call.ended and not call.done and out == [] and not queue.heads()


def issue_in_orders(
    cluster: Cluster, orders: dict[int, list[int]], coll_ids: list[int], rng: np.random.Generator
) -> tuple[list[Call], list[list[np.ndarray]], set[int]]:
    """Collective k (coll_id coll_ids[k], buffers of slot k) issued by every rank, its own host
    per collective and rank, so that node r gets the START_COLLs in the order orders[r]; run to
    the end. Returns the calls, the inputs, and the coll_ids of the calls that gave their slot
    up (answered BUSY after their node said it ran them)."""
    inputs = [stage(cluster, rng, k) for k in range(len(coll_ids))]
    calls: list[Call] = []
    hosts = []
    for rank, order in orders.items():
        for k in order:
            host = Host(cluster, rank, 200 + 10 * k + rank, lanes=1)
            group = Group(rank, coll_id=coll_ids[k])
            calls.append(Call(group, start_packet(cluster, group, k), watchdog_s=30.0))
            host.issue(calls[-1], 0)
            hosts.append(host)
    drive(cluster, hosts, lambda: all(c.ended for c in calls), seconds=5.0)
    yielded = set()
    for host, call in zip(hosts, calls):
        heard = [h for c, h in host.heard if c is call]
        if Heard.STARTED in heard and Heard.BUSY in heard[heard.index(Heard.STARTED) :]:
            yielded.add(call.group.coll_id)
    return calls, inputs, yielded


def test_collectives_started_in_different_orders_on_full_nodes_never_deadlock() -> None:
    """6 collectives, 4 slots, 3 nodes, START_COLLs arriving so that every node fills its slots
    with collectives another node has no slot for (node 0: 0-3, node 1: 2-5, node 2: 0, 1, 4,
    5): without rule 4 of core/collective.py each waited on the others until the watchdog
    (measured: none done after 20 s of hand clock, then all failed). The stuck collective with
    the higher coll_id gives its slot up, so all complete, exact, within the hand clock's 5 s."""
    cluster = make_cluster(3)
    orders = {0: [0, 1, 2, 3, 4, 5], 1: [2, 3, 4, 5, 0, 1], 2: [0, 1, 4, 5, 2, 3]}
    coll_ids = [1200 + k for k in range(6)]
    calls, inputs, yielded = issue_in_orders(cluster, orders, coll_ids, np.random.default_rng(36))
    assert all(c.done for c in calls), [
        (c.group.coll_id, c.group.rank, c.nack) for c in calls if not c.done
    ]
    for k in range(6):
        assert_exact(cluster, inputs[k], k)
    # Which calls gave their slot up: answered BUSY after their node said it ran them.
    assert yielded and min(coll_ids) not in yielded


def test_a_collective_that_runs_everywhere_never_gives_its_slot_away() -> None:
    """Four collectives start on every node first; a fifth with a lower coll_id waits (BUSY)
    until one ends: none of the four is ever answered BUSY."""
    cluster = make_cluster(3)
    orders = {r: [1, 2, 3, 4, 0] for r in range(3)}
    calls, inputs, yielded = issue_in_orders(
        cluster, orders, [1300, 1301, 1302, 1303, 1304], np.random.default_rng(37)
    )
    assert all(c.done for c in calls)
    for k in range(5):
        assert_exact(cluster, inputs[k], k)
    assert all(c.busy_answers == 0 for c in calls if c.group.coll_id != 1300)
    assert not yielded
    assert all(c.busy_answers > 0 for c in calls if c.group.coll_id == 1300)


@pytest.mark.slow
def test_30_percent_loss_fails_no_call_with_the_default_watchdog() -> None:
    """At 30% loss each way half the round trips fail. Asking once per START_RESEND_S, 7 failed
    in a row (0.9%) made a live node look silent past watchdog + grace, and with one chain try
    per 250 ms the nodes' 2.5 s watchdog fired on a last chunk that kept being lost: on this
    fabric 20 of 80 4-rank runs failed, and with a 100 ms RTO cap alone seed 19 here still did
    (a member READing its last chunk only every two RTOs). Asking every UNANSWERED_RESEND_S
    while unanswered, an RTO of at most 100 ms and repair after one RTO: none does
    (docs/PERFORMANCE.md, "Under heavy loss")."""
    count = 60_000
    for seed in range(30):
        cluster = make_cluster(4, FaultSpec(seed=seed, loss=0.3, dup=0.15, reorder=0.15))
        rng = np.random.default_rng(seed)
        hosts = [Host(cluster, r, 70 + r) for r in range(4)]
        inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(4)]
        calls = []
        for host, data in zip(hosts, inputs):
            cluster.nodes[host.rank].memory[: count * 4] = data.view(np.uint8)
            group = Group(host.rank, coll_id=1400)
            group.epoch = 1
            desc = CollectiveDescriptor(
                Algo.ALL_REDUCE,
                host.rank,
                count,
                0,
                count * 4,
                RKEY,
                timeout_ms=2_500,
                tag_key=tag_key(1400, 1),
            )
            packet = Packet(
                Opcode.START_COLL,
                rkey=ADMIN_KEY,
                coll_id=1400,
                epoch=1,
                dtype=DType.F32,
                reduce_op=ReduceOp.SUM,
                segments=tuple(cluster.endpoints),
            ).with_payload(desc.encode())
            calls.append(Call(group, packet, watchdog_s=2.5))
            host.issue(calls[-1], 0)
        drive(cluster, hosts, lambda calls=calls: all(c.ended for c in calls), seconds=120.0)
        assert [c.silent_s for c in calls] == [None] * 4, (
            f"seed {seed}: a host gave up on a live node"
        )
        assert all(c.done for c in calls), f"seed {seed}: {[c.nack for c in calls]}"
        expected = all_reduce_reference(inputs, ReduceOp.SUM).tobytes()
        assert all(
            node.memory[count * 4 : count * 8].tobytes() == expected for node in cluster.nodes
        )


def exchange(cluster: Cluster, packet: Packet) -> list[Packet]:
    """*packet* from the test's client to node 0, and the client's answers a few rounds on (the
    fabric never idles while collectives run)."""
    cluster.send(0, packet)
    for _ in range(5):
        cluster.fabric.step()
    return [decode_packet(data) for data, _ in cluster.fabric.receive(cluster.client)]


def test_only_the_admin_can_make_a_stuck_collective_give_way() -> None:
    """Giving way is triggered by START_COLL alone, a control opcode: a sender without the
    admin key (another host, a local user) is refused before any slot is looked at, and the
    stuck collectives keep their slots. The admin's START_COLL then takes one."""
    cluster = make_cluster(3)
    # Fill node 0's 4 slots with collectives nodes 1 and 2 never start: stuck there.
    stuck_hosts = [Host(cluster, 0, 300 + k, lanes=1) for k in range(4)]
    stuck = []
    for k, host in enumerate(stuck_hosts):
        group = Group(0, coll_id=1700 + k)
        stuck.append(Call(group, start_packet(cluster, group, k, own=True), watchdog_s=30.0))
        host.issue(stuck[-1], 0)
    for _ in range(40):  # their chains go out and are refused (BUSY: not started there)
        for host in stuck_hosts:
            host.turn()
        if cluster.fabric.step() == 0:
            cluster.fabric.advance(0.005)
    node = cluster.nodes[0]
    held = sorted(int(node.collective.cfg[s, L.CFG_COLL]) for s in range(L.MAX_COLLECTIVES))
    assert held == [1700, 1701, 1702, 1703]
    assert all(e.may_yield for e in node.collective.engines)
    group = Group(0, coll_id=1600)  # lower than every stuck one: it may take a slot
    forged = replace(
        start_packet(cluster, group, 5, own=True), rkey=ADMIN_KEY ^ 0x5A5A, client_id=9, txn_id=1
    )
    replies = exchange(cluster, forged)
    assert [(r.opcode, r.status) for r in replies] == [(Opcode.NACK, Status.UNAUTHORIZED)]
    held = sorted(int(node.collective.cfg[s, L.CFG_COLL]) for s in range(L.MAX_COLLECTIVES))
    assert held == [1700, 1701, 1702, 1703] and not any(c.busy_answers for c in stuck)
    for host in stuck_hosts:
        host.turn()
    assert not any(c.refused for c in stuck)
    # The admin's START_COLL of the same collective takes the highest coll_id's slot.
    replies = exchange(cluster, replace(forged, rkey=ADMIN_KEY))
    assert [(r.opcode, r.status) for r in replies] == [(Opcode.ACK, Status.OK)]
    held = sorted(int(node.collective.cfg[s, L.CFG_COLL]) for s in range(L.MAX_COLLECTIVES))
    assert held == [1600, 1700, 1701, 1702]
    # The collective that gave way took its own key with it: the node answers to the others'
    # and the new one's, not to its (a key's record is its slot's, which it lost).
    installed = [find_rkey(node._rk_key, own_key(c)) >= 0 for c in (1600, 1700, 1701, 1702, 1703)]
    assert installed == [True, True, True, True, False]
    for host in stuck_hosts:
        host.turn()
    assert [c.refused for c in stuck] == [False, False, False, True]  # 1703's host: BUSY
