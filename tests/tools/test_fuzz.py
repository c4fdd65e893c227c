"""Fuzzing (netdam/tools/fuzz/generator.py, `netdam fuzz`).

In memory, driven by hypothesis: structured mutations of valid packets (bit flips, field-aware
changes, SR-list and sparse corruption, truncation, extension) and random bytes against the
codec (only its documented error, and a lossless round trip of whatever it accepts), NodeCore
and SwitchCore (no exception; every NACK status the one SPEC.md gives, as the oracle computes
it; no byte outside an authorized write changes; nothing reaches a third party; every counter
adds up). With real processes: short `netdam fuzz` runs against nodes and against the switch.
"""

from __future__ import annotations

import functools
import json
import struct
import tempfile
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from helpers import valid_packets
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam.cli import main as cli
from netdam.cluster.clusterfile import ClusterFile, NodeEntry
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels import switch_path as K
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    REPLY_OPCODES,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.switch.controller import PoolService, credential_digest
from netdam.switch.core import SwitchConfig, SwitchCore
from netdam.switch.state import PoolNode, PoolState, save_state
from netdam.tools.fuzz.generator import (
    EV_NACK,
    EV_OPEN,
    EV_WINDOW,
    MUTATIONS,
    DatagramGenerator,
    Layout,
    Shape,
    expected_statuses,
    header,
    node_region_plan,
    node_regions_of_pool,
    plan_pool,
    sparse_encode,
)
from netdam.tools.fuzz.oracle import (
    OPEN_STATUSES,
    WINDOW_STATUSES,
    Expectation,
    MemoryGuard,
    Oracle,
    ProcessTraffic,
    counter_checks,
    unreached,
)
from netdam.tools.fuzz.runner import FuzzConfig, run_fuzz

CLIENT: Endpoint = ("127.0.0.1", 9001)
THIRD: Endpoint = ("127.0.0.1", 9002)
VIP: Endpoint = ("127.0.0.1", 7744)
GROUP: Endpoint = ("239.77.0.9", 7000)
NODES: tuple[Endpoint, ...] = (("127.0.0.1", 7001), ("127.0.0.1", 7002))
MEMORY = 1 << 19  # the node plan needs 384 KiB; less to compare after every datagram
ADMIN = 0xAD15


class Net:
    """A synchronous network of cores, one datagram at a time (lighter than netdam.core.fabric):
    replies to the client are collected, anything else that leaves the cluster is misdirected."""

    def __init__(self, cores: dict[Endpoint, NodeCore | SwitchCore]) -> None:
        self.cores = cores
        self.misdirected: list[tuple[bytes, Endpoint]] = []

    def send(self, data: bytes, dst: Endpoint) -> list[tuple[bytes, Endpoint]]:
        queue = deque([(data, CLIENT, dst)])
        replies = []
        while queue:
            datagram, src, to = queue.popleft()
            core = self.cores.get(to)
            if core is None:
                if to == CLIENT:
                    replies.append((datagram, src))
                else:
                    self.misdirected.append((datagram, to))
                continue
            core.receive_datagram(datagram, src, 0.0)
            for out, nxt in core.datagrams_to_send(0.0):
                queue.append((out, to, nxt))
        return replies


@dataclass
class World:
    """Cores of one layout with the fuzzer's oracle, expectation and memory guard beside them."""

    layout: Layout
    cores: list[NodeCore | SwitchCore]  # process order: nodes, then the switch
    net: Net
    oracle: Oracle = field(init=False)
    guard: MemoryGuard = field(init=False)
    expect: Expectation = field(default_factory=Expectation)
    traffic: list[ProcessTraffic] = field(init=False)
    statuses: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.oracle = Oracle(self.layout)
        self.guard = MemoryGuard(self.memories)
        self.traffic = [ProcessTraffic() for _ in self.cores]

    @property
    def memories(self) -> list[np.ndarray]:
        return [core.memory for core in self.cores if isinstance(core, NodeCore)]

    def send(self, data: bytes, dst: int) -> None:
        """One datagram: replies as the oracle says, nothing changed outside authorized writes."""
        outcome = self.oracle.outcome(data, dst)
        self.expect.add(data, outcome)
        self.guard.authorize(outcome.writes)
        replies = self.net.send(data, self.layout.destinations[dst])
        got = []
        for reply, src in replies:
            packet = decode_packet(reply)  # every reply is a valid v1 reply (SPEC.md 3)
            assert packet.opcode in REPLY_OPCODES, (data.hex(), reply.hex())
            p = self.layout.processes.index(src)
            self.traffic[p].replies_received += 1
            if packet.opcode == Opcode.READ_RESP and p < len(self.layout.nodes):
                assert self.guard.read_matches(p, packet.addr, packet.payload) is not False, (
                    data.hex()
                )
            if packet.opcode == Opcode.NACK:
                self.traffic[p].nacks_received[int(packet.status)] += 1
                self.statuses[int(packet.status)] += 1
                got.append(int(packet.status))
        want = sorted(status for _, code, status in outcome.events if code == EV_NACK)
        if any(code == EV_OPEN for _, code, _ in outcome.events):
            # An UPDATE past its descriptor's rights: node memory decides (oracle.OPEN_STATUSES).
            assert got == [] or (len(got) == 1 and got[0] in (*WINDOW_STATUSES, *OPEN_STATUSES)), (
                data.hex(),
                got,
                outcome,
            )
        elif outcome.kind == "windowed":
            assert got == [] or (len(got) == 1 and got[0] in WINDOW_STATUSES), (data.hex(), got)
        else:
            assert sorted(got) == want, (data.hex(), got, want, outcome)
        assert self.guard.check(self.memories) == 0, (data.hex(), self.guard.ranges)
        assert self.net.misdirected == [], (data.hex(), self.net.misdirected)

    def failed_checks(self) -> list[str]:
        deltas = [core.counters.astype(np.int64) for core in self.cores]
        extras = [
            np.array([core.sw[K.SW_FORWARDED], core.sw[K.SW_REPLICATED]], np.int64)
            if isinstance(core, SwitchCore)
            else np.zeros(0, np.int64)
            for core in self.cores
        ]
        checks = counter_checks(self.layout, self.expect, deltas, extras, self.traffic, slack=0)
        assert len(checks) > 10
        return [
            f"{c.name}: counted {c.counted}, expected {c.low}..{c.high}" for c in checks if not c.ok
        ]

    def reached(self) -> dict[str, list[str]]:
        ops: Counter[int] = Counter()
        for core in self.cores:
            for op in Opcode:
                ops[int(op)] += int(core.counters[C.OPCODE_BASE + op])
        return unreached(self.layout.target, ops, self.statuses)


def _canary(memory: np.ndarray, seed: int) -> None:
    memory[:] = np.random.default_rng(seed).integers(0, 256, memory.shape[0], dtype=np.uint8)


def node_world() -> World:
    regions = node_region_plan(MEMORY, seed=5)
    cores: list[NodeCore | SwitchCore] = []
    for rank, ep in enumerate(NODES):
        core = NodeCore(
            NodeConfig(
                endpoint=ep,
                memory_bytes=MEMORY,
                admin_key=ADMIN,
                members=NODES,
                rank=rank,
                world_size=len(NODES),
            )
        )
        for region in regions:
            core.register_region(region.base, region.size, Rights(region.rights), rkey=region.rkey)
        _canary(core.memory, rank)
        cores.append(core)
    layout = Layout("node", NODES, (regions, regions), MEMORY, third_party=THIRD)
    return World(layout, cores, Net(dict(zip(NODES, cores, strict=True))))


class _NoAllocation:
    """The nodes as the allocator would reach them: the fuzzer holds neither the admin key nor a
    tenant credential, so no ALLOC of it may ever get as far as registering a backing."""

    def register(
        self, node: Endpoint, size: int, rights: int, rkey: int, tag_key: bytes = b""
    ) -> tuple[Status, int]:
        raise AssertionError(f"a fuzzed ALLOC passed the allocator's checks: REGISTER on {node}")

    def deregister(self, node: Endpoint, rkey: int) -> Status:
        raise AssertionError(f"a fuzzed FREE passed the allocator's checks: DEREGISTER on {node}")


@functools.cache
def _pool_state_file() -> Path:
    """One state file for every switch world: the fuzzer never changes it (no key, no tenant)."""
    return Path(tempfile.mkdtemp(prefix="netdam-fuzz-")) / "pool.json"


def _pool_service() -> PoolService:
    """The allocator the switch process attaches (ALLOC, FREE, QUERY; SPEC.md 11.9), on a state
    file with one tenant the fuzzer does not know."""
    path = _pool_state_file()
    pooled = [PoolNode(ip, port, MEMORY) for ip, port in NODES]
    save_state(path, PoolState(nodes=pooled, tenants={credential_digest(0x7E4A47): "tenant"}))
    entries = tuple(NodeEntry(rank=r, address=ip, port=port) for r, (ip, port) in enumerate(NODES))
    return PoolService(
        ClusterFile(name="fuzz", admin_key=ADMIN, mtu=9000, nodes=entries), path, _NoAllocation()
    )


def switch_world() -> World:
    pool = plan_pool(NODES, MEMORY, seed=6)
    per_node = node_regions_of_pool(pool, len(NODES))
    cores: list[NodeCore | SwitchCore] = []
    for rank, ep in enumerate(NODES):
        core = NodeCore(
            NodeConfig(
                endpoint=ep,
                memory_bytes=MEMORY,
                admin_key=ADMIN,
                members=NODES + (VIP,),
                rank=rank,
                world_size=len(NODES),
            )
        )
        for region in per_node[rank]:
            core.register_region(region.base, region.size, Rights(region.rights), rkey=region.rkey)
        _canary(core.memory, rank)
        cores.append(core)
    switch = SwitchCore(SwitchConfig(vip=VIP, nodes=NODES, admin_key=ADMIN), pool, generation=1)
    switch.pool = _pool_service()
    switch.set_groups({GROUP: list(NODES)})
    cores.append(switch)
    layout = Layout(
        "switch",
        NODES,
        per_node,
        MEMORY,
        vip=VIP,
        pool=pool,
        group=GROUP,
        group_members=(0, 1),
        third_party=THIRD,
    )
    return World(layout, cores, Net(dict(zip(NODES + (VIP,), cores, strict=True))))


# ---------------------------------------------------------------- the generator


def test_generator_replays_its_seed_and_mostly_mutates() -> None:
    layout = node_world().layout
    first = [d.data for d in DatagramGenerator(layout, 3).batch(600)]
    assert first == [d.data for d in DatagramGenerator(layout, 3).batch(600)]
    assert first != [d.data for d in DatagramGenerator(layout, 4).batch(600)]
    generator = DatagramGenerator(layout, 3)
    generator.batch(4000)
    assert generator.made["mutated"] >= 2000 and generator.made["random"] > 0
    with pytest.raises(ValueError, match="at least half"):
        DatagramGenerator(layout, 1, mix=(0.6, 0.3, 0.0, 0.1))


# ---------------------------------------------------------------- the codec


_PLAN = node_region_plan(MEMORY, seed=5)
_CODEC_LAYOUT = Layout("node", NODES, (_PLAN, _PLAN), MEMORY, third_party=THIRD)


@settings(max_examples=150, deadline=None)
@given(
    valid_packets(),
    st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_codec_under_structured_mutations(packet: Packet, names: list[str], seed: int) -> None:
    """Only RemoteProtocolError (with a status and a message) escapes; what decodes re-encodes
    to the same bytes."""
    generator = DatagramGenerator(_CODEC_LAYOUT, seed)
    shape = Shape(
        len(packet.segments),
        bool(packet.flags & Flags.SPARSE),
        packet.addr % 2**40,
        packet.addr % 2**40 + packet.length,
        ELEMENT_SIZE[packet.dtype],
    )
    data = generator.apply_mutations(encode_packet(packet), shape, names)
    try:
        decoded = decode_packet(data)
    except RemoteProtocolError as exc:
        assert exc.status != Status.OK and str(exc)
        return
    assert encode_packet(decoded) == data


# ---------------------------------------------------------------- the cores, hypothesis


_STEP = st.tuples(
    st.sampled_from(["valid", "mutated", "random"]),
    st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3),
)


def _drive(world: World, seed: int, steps: list[tuple[str, list[str]]]) -> None:
    generator = DatagramGenerator(world.layout, seed)
    for kind, names in steps:
        data, dst, shape = generator.valid()
        if kind == "mutated":
            data = generator.apply_mutations(data, shape, names)
        elif kind == "random":
            data = generator.random_bytes()
        world.send(data, dst)


_NODE_WORLD: list[World] = []
_SWITCH_WORLD: list[World] = []


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(_STEP, min_size=1, max_size=25))
def test_node_core_under_structured_mutations(
    seed: int, steps: list[tuple[str, list[str]]]
) -> None:
    if not _NODE_WORLD:  # one world for every example: state carries over, as in life
        _NODE_WORLD.append(node_world())
    world = _NODE_WORLD[0]
    _drive(world, seed, steps)
    assert world.failed_checks() == []


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(_STEP, min_size=1, max_size=25))
def test_switch_core_under_structured_mutations(
    seed: int, steps: list[tuple[str, list[str]]]
) -> None:
    if not _SWITCH_WORLD:
        _SWITCH_WORLD.append(switch_world())
    world = _SWITCH_WORLD[0]
    _drive(world, seed, steps)
    assert world.failed_checks() == []


# ---------------------------------------------------------------- the cores, seeded runs


@pytest.mark.parametrize("make", [node_world, switch_world], ids=["node", "switch"])
def test_seeded_run_reaches_every_opcode_and_status(make: object) -> None:
    world = make()
    for datagram in DatagramGenerator(world.layout, 11).batch(2000):
        world.send(datagram.data, datagram.dst)
    assert world.failed_checks() == []
    assert world.reached() == {"opcodes": [], "statuses": []}
    assert set(world.statuses) >= {int(s) for s in expected_statuses(world.layout.target)}


def test_checks_can_fail() -> None:
    """A stray write, a wrong READ_RESP, a miscount and a wrong status are each caught."""
    world = node_world()
    for datagram in DatagramGenerator(world.layout, 12).batch(300):
        world.send(datagram.data, datagram.dst)
    node = world.cores[0]
    assert isinstance(node, NodeCore)
    node.memory[0] ^= 0xFF  # registered nowhere: nothing may change it
    assert world.guard.check(world.memories) == 1 and world.guard.ranges == [(0, 0, 1)]
    assert world.guard.read_matches(0, 1, bytes(world.guard.snapshots[0][1:9])) is True
    assert world.guard.read_matches(0, 1, bytes(8)) is False  # a READ_RESP with the wrong bytes
    node.counters[C.NACK_BASE + Status.BAD_RKEY] += 1
    assert any("node0: NACK BAD_RKEY" in line for line in world.failed_checks())
    # A READ outside every region: the oracle says OUT_OF_BOUNDS, not ACK.
    region = world.layout.node_regions[0][0]
    read = header(
        Opcode.READ, rkey=region.rkey, addr=region.end - 4, length=8, dtype=int(DType.RAW)
    )
    assert world.oracle.outcome(read, 0).status == Status.OUT_OF_BOUNDS


def test_a_windowed_request_may_be_answered_busy() -> None:
    """The duplicate window answers BUSY when a client's set is held by other rkeys' clients,
    and whether an idle entry may be taken yet is the clock's to say (found by a node run of
    `netdam fuzz --seed 29` that counted 285 BUSY against 284 predicted, one run in six): up
    to one BUSY per windowed request passes the counter checks, as STALE does, and one more
    does not."""
    world = node_world()
    for datagram in DatagramGenerator(world.layout, 12).batch(300):
        world.send(datagram.data, datagram.dst)
    assert world.failed_checks() == []
    windowed = world.expect.count(0, EV_WINDOW)
    assert windowed > 0
    node = world.cores[0]
    for extra, fails in ((windowed, False), (1, True)):
        node.counters[C.NACK_BASE + Status.BUSY] += extra  # sent, and received by the fuzzer
        world.traffic[0].nacks_received[int(Status.BUSY)] += extra
        failed = [line for line in world.failed_checks() if "node0: NACK BUSY" in line]
        assert bool(failed) is fails, failed


# ---------------------------------------------------------------- bugs found by the fuzzer


def test_switch_refuses_sparse_payloads() -> None:
    """SPEC.md 11.3: a v1 switch answers sparse payloads NACK BAD_FIELD and relays nothing.
    (Found by the first `netdam fuzz --target switch` run: the switch forwarded a valid sparse
    WRITE to the node, which executed it.)"""
    world = switch_world()
    region = world.layout.pool[0]
    payload = sparse_encode(struct.pack("<4f", 1, 0, 0, 2), 4, [0, 3])
    data = (
        header(
            Opcode.WRITE,
            flags=int(Flags.SPARSE | Flags.ACK_REQ),
            rkey=region.rkey,
            addr=region.gaddr,
            length=16,
            dtype=int(DType.F32),
            client=5,
            txn=1,
        )
        + payload
    )
    replies = [decode_packet(d) for d, _ in world.net.send(data, VIP)]
    assert [(r.opcode, r.status) for r in replies] == [(Opcode.NACK, Status.BAD_FIELD)]


@pytest.mark.parametrize("opcode", [Opcode.READ, Opcode.FETCH_ADD, Opcode.PING])
def test_sparse_flag_refused_where_there_is_no_sparse_form(opcode: Opcode) -> None:
    """SPEC.md 2.5: "Sparse forms exist for CHAIN_ADD, ALL_WRITE and WRITE (any other opcode
    with SPARSE: BAD_FIELD)". (Found by the fuzzer: the codec and the datapath checked it only
    for ADD and READ_RESP, so READ, FETCH_ADD, CAS, PING and control opcodes took the flag.)
    The node, through the datapath, answers the same."""
    fields = {
        Opcode.READ: dict(length=8),
        Opcode.FETCH_ADD: dict(length=8, dtype=DType.U64, payload=bytes(8)),
    }
    data = bytearray(encode_packet(Packet(opcode, **fields.get(opcode, {}))))
    data[3] |= Flags.SPARSE
    with pytest.raises(RemoteProtocolError) as info:
        decode_packet(bytes(data))
    assert info.value.status == Status.BAD_FIELD
    world = node_world()
    replies = [decode_packet(d) for d, _ in world.net.send(bytes(data), NODES[0])]
    assert [(r.opcode, r.status) for r in replies] == [(Opcode.NACK, Status.BAD_FIELD)]


def test_relay_never_forwards_what_the_next_hop_refuses() -> None:
    """Found by `netdam fuzz --target node --seed 1` (datagram 38,691): a sparse CHAIN_ADD with
    length 0 and nnz 0 passed the codec and the datapath; the relay re-encoded the empty
    running value dense (2 * 0 < 0 is false) and forwarded a dense CHAIN_ADD of length 0, which
    the next hop NACKed BAD_LENGTH. Now a sparse payload of length 0 is BAD_LENGTH where it
    enters, as a dense one is."""
    world = node_world()
    region = world.layout.node_regions[0][0]
    data = header(
        Opcode.CHAIN_ADD,
        flags=int(Flags.SPARSE | Flags.ACK_REQ),
        rkey=region.rkey,
        addr=region.base,
        aux=region.base + 64,
        length=0,
        dtype=int(DType.F32),
        segments=[endpoint_to_u64(NODES[0]), endpoint_to_u64(NODES[1])],
        left=1,
    ) + sparse_encode(b"", 4, [])
    replies = [(decode_packet(d), src) for d, src in world.net.send(data, NODES[0])]
    assert [(r.opcode, r.status, src) for r, src in replies] == [
        (Opcode.NACK, Status.BAD_LENGTH, NODES[0])
    ]


# ---------------------------------------------------------------- real processes


@pytest.mark.slow
def test_fuzz_command_against_a_node_process(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "fuzz",
            "--target",
            "node",
            "--datagrams",
            "15000",
            "--seed",
            "1",
            "--nodes",
            "1",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    # Which counter, when one disagrees (an intermittent one did once in CI, not reproduced).
    assert code == 0, (result.get("error"), result.get("counter_checks_failed", [])[:5])
    assert result["ok"] and result["sent"] == 15000 and result["mix"]["mutated"] >= 7500
    assert (
        result["crashes"],
        result["memory_violations"],
        result["misdirected"],
        result["bad_replies"],
    ) == (0, 0, 0, 0)
    assert result["counters_add_up"] and result["counter_checks_failed"] == []
    assert result["unreached"] == {"opcodes": [], "statuses": []}
    assert result["accepted"] + result["nacks"] + result["drops"] == result["sent"]
    assert set(result["by_status"]) >= {s.name for s in expected_statuses("node")}
    assert all(row["reached"] > 0 for row in result["by_opcode"].values())


@pytest.mark.slow
def test_fuzz_against_the_switch_processes() -> None:
    result = run_fuzz(FuzzConfig(target="switch", datagrams=15000, seed=2, nodes=1, progress=False))
    assert result["ok"], (result.get("error"), result["counter_checks_failed"][:5])
    assert (result["crashes"], result["memory_violations"], result["misdirected"]) == (0, 0, 0)
    assert set(result["by_status"]) >= {s.name for s in expected_statuses("switch")}


def test_fuzz_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fuzz", "--target", "nic", "--json"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nic'" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fuzz", "--datagrams", "0"])
    assert exit_info.value.code == 2
    assert "0 is out of range: give 1..1000000000" in capsys.readouterr().err
