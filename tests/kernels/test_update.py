"""UPDATE (SPEC.md 6.8): the NIC applies an optimizer step to a region's float32 masters where the
gradient lands. Held bit for bit to protocol/optim.py (itself held to torch.optim in
tests/protocol/test_optim.py) for SGD (momentum, dampening, weight decay, Nesterov), Adam and
AdamW, with f32, f16 and bf16 gradients; a new learning rate between steps; each step applied
exactly once per chunk on 2, 4 and 8 NICs under loss, duplication and reordering; and refused,
changing nothing, to whoever lacks the region's rights or sends a malformed step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from helpers import RKEY, Cluster, make_cluster

from netdam.core.faults import FaultSpec
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Opcode, Rights, Status
from netdam.protocol.elements import bf16_round
from netdam.protocol.layout import H_DTYPE, OPT_LR, OPTIMIZER_BYTES
from netdam.protocol.optim import (
    AdamRule,
    SgdRule,
    adam_step,
    descriptor_for,
    gradient_values,
    sgd_step,
)
from netdam.protocol.packet import Packet, decode_packet, encode_packet

F32 = np.float32
BASE = 0x1000  # where each test's descriptor sits in node memory
PARAMS = 128  # the masters, then moment 1, moment 2 and the step table, as offsets from BASE

RULES: dict[str, SgdRule | AdamRule] = {
    "sgd": SgdRule(lr=0.1),
    "sgd-momentum": SgdRule(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "sgd-nesterov": SgdRule(lr=0.05, momentum=0.8, weight_decay=1e-2, nesterov=True),
    "adam": AdamRule(lr=1e-3),
    "adam-wd": AdamRule(lr=2e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05),
    "adamw": AdamRule(lr=1e-3, weight_decay=0.1, decoupled=True),
}


@dataclass
class Shard:
    """One NIC's part of a model: its masters and optimizer state there, and the reference's."""

    node: int
    rule: SgdRule | AdamRule
    masters: np.ndarray
    chunk: int
    ref_p: np.ndarray = field(init=False)
    ref_m: np.ndarray = field(init=False)
    ref_v: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ref_p = self.masters.copy()
        self.ref_m = np.zeros_like(self.masters)
        self.ref_v = np.zeros_like(self.masters)

    @property
    def count(self) -> int:
        return int(self.masters.size)

    def install(self, cluster: Cluster) -> None:
        memory = cluster.nodes[self.node].memory
        block = descriptor_for(self.rule, self.count, self.chunk, PARAMS).encode()
        memory[BASE : BASE + OPTIMIZER_BYTES] = np.frombuffer(block, np.uint8)
        memory[BASE + PARAMS : BASE + PARAMS + 4 * self.count] = self.masters.view(np.uint8)
        state = BASE + PARAMS + 4 * self.count
        memory[state : state + 12 * self.count] = 0  # both moments, then the step table

    def on_node(self, cluster: Cluster, offset: int) -> np.ndarray:
        at = BASE + offset
        return cluster.nodes[self.node].memory[at : at + 4 * self.count].view(F32).copy()

    def reference_step(self, grad: np.ndarray, dtype: DType, step: int) -> None:
        g = gradient_values(grad, dtype)
        if isinstance(self.rule, SgdRule):
            sgd_step(self.ref_p, g, self.ref_m, step, self.rule)
        else:
            adam_step(self.ref_p, g, self.ref_m, self.ref_v, step, self.rule)

    def assert_equal(self, cluster: Cluster) -> None:
        assert self.on_node(cluster, PARAMS).tobytes() == self.ref_p.tobytes()
        keeps_m = isinstance(self.rule, AdamRule) or self.rule.momentum
        if keeps_m:
            assert self.on_node(cluster, PARAMS + 4 * self.count).tobytes() == self.ref_m.tobytes()
        if isinstance(self.rule, AdamRule):
            assert self.on_node(cluster, PARAMS + 8 * self.count).tobytes() == self.ref_v.tobytes()

    def updates(self, grad: np.ndarray, dtype: DType, step: int, txn: int) -> list[Packet]:
        """The UPDATEs of one step: a chunk each."""
        wire = grad_bytes(grad, dtype)
        size = 2 if dtype != DType.F32 else 4
        return [
            Packet(
                Opcode.UPDATE,
                client_id=40 + self.node,
                txn_id=txn + k,
                epoch=step,
                rkey=RKEY,
                addr=BASE,
                aux_addr=first,
                dtype=dtype,
            ).with_payload(wire[first * size : (first + self.chunk) * size])
            for k, first in enumerate(range(0, self.count, self.chunk))
        ]


def grad_bytes(grad: np.ndarray, dtype: DType) -> bytes:
    if dtype == DType.F32:
        return grad.astype(F32).tobytes()
    if dtype == DType.F16:
        return grad.astype(np.float16).tobytes()
    return bf16_round(grad.astype(F32)).tobytes()


def wire_grad(grad: np.ndarray, dtype: DType) -> np.ndarray:
    """The gradient as the reference takes it (the wire's elements)."""
    data = grad_bytes(grad, dtype)
    return np.frombuffer(data, {DType.F32: F32, DType.F16: np.float16}.get(dtype, np.uint16))


def run_steps(
    cluster: Cluster, shards: list[Shard], steps: int, dtype: DType, seed: int, lossy: bool = False
) -> None:
    """*steps* optimizer steps on every shard: each chunk's UPDATE sent until it is ACKed (under
    loss some are sent again, under the same txn_id or, every other time, a new one)."""
    rng = np.random.default_rng(seed)
    txn = 1000  # every shard's txn_ids increase (the duplicate window's rule, SPEC.md 7)
    for step in range(1, steps + 1):
        pending: list[tuple[Shard, Packet]] = []
        for shard in shards:
            grad = rng.standard_normal(shard.count).astype(F32) * F32(0.5)
            shard.reference_step(wire_grad(grad, dtype), dtype, step)
            updates = shard.updates(grad, dtype, step, txn)
            pending += [(shard, u) for u in updates]
            txn += len(updates)
        tries = 0
        while pending:
            tries += 1
            assert tries < 200, f"step {step}: {len(pending)} UPDATEs never ACKed"
            for shard, update in pending:
                cluster.send(shard.node, update)
            cluster.fabric.run_until_idle()
            acked = set()
            for data, _ in cluster.fabric.receive(cluster.client):
                reply = decode_packet(data)
                assert reply.opcode == Opcode.ACK, reply  # never OUT_OF_STEP: once per step
                acked.add((reply.client_id, reply.txn_id))
            left = [(s, u) for s, u in pending if (u.client_id, u.txn_id) not in acked]
            if lossy and tries % 2 == 0:
                # Every other round the ones still unanswered go again under new txn_ids: past
                # the duplicate window, only the step table keeps them from applying twice.
                left = [(s, replace(u, txn_id=txn + k)) for k, (s, u) in enumerate(left)]
                txn += len(left)
            pending = left
    for shard in shards:
        shard.assert_equal(cluster)


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(RULES))
def test_steps_equal_the_reference_bit_for_bit(name: str, dtype: DType) -> None:
    cluster = make_cluster(1)
    rng = np.random.default_rng(3)
    shard = Shard(0, RULES[name], rng.standard_normal(2_500).astype(F32), chunk=1_024)
    shard.install(cluster)
    run_steps(cluster, [shard], steps=5, dtype=dtype, seed=11)
    assert cluster.nodes[0].counters[C.OPCODE_BASE + Opcode.UPDATE] == 5 * 3


def test_a_new_learning_rate_between_steps_is_a_write() -> None:
    cluster = make_cluster(1)
    shard = Shard(0, RULES["adam"], np.linspace(-1, 1, 3_000, dtype=F32), chunk=2_048)
    shard.install(cluster)
    run_steps(cluster, [shard], steps=2, dtype=DType.F32, seed=5)
    shard.rule = replace(shard.rule, lr=5e-4)
    write = Packet(
        Opcode.WRITE, client_id=9, txn_id=1, rkey=RKEY, addr=BASE + OPT_LR, dtype=DType.RAW
    ).with_payload(np.float64(5e-4).tobytes())
    cluster.request(0, write)
    rng = np.random.default_rng(6)
    for step in (3, 4):
        grad = rng.standard_normal(shard.count).astype(F32)
        shard.reference_step(grad, DType.F32, step)
        for update in shard.updates(grad, DType.F32, step, 7_000 + 10 * step):
            [reply] = cluster.request(0, update)
            assert reply.opcode == Opcode.ACK
    shard.assert_equal(cluster)


@pytest.mark.parametrize("nics", [2, 4, 8])
def test_each_step_applies_once_under_loss_duplication_and_reordering(nics: int) -> None:
    """A model sharded over the NICs, 30% of datagrams lost, 20% duplicated, 20% reordered: every
    chunk's UPDATE is sent until ACKed, some again under a new txn_id (past the duplicate
    window: only the step table stops those), and every shard equals the reference."""
    cluster = make_cluster(nics, FaultSpec(loss=0.3, dup=0.2, reorder=0.2, seed=nics))
    rng = np.random.default_rng(nics)
    shards = [
        Shard(
            k,
            RULES["adam-wd" if k % 2 else "sgd-momentum"],
            rng.standard_normal(1_500).astype(F32),
            512,
        )
        for k in range(nics)
    ]
    for shard in shards:
        shard.install(cluster)
    run_steps(cluster, shards, steps=4, dtype=DType.BF16, seed=nics, lossy=True)
    resent = sum(int(node.counters[C.DUP_REPLAYS]) for node in cluster.nodes)
    assert resent > 0  # duplicates reached the NICs and were answered, not applied


def _request(cluster: Cluster, update: Packet) -> Packet:
    [reply] = cluster.request(0, update)
    return reply


def _setup(rule: str = "sgd-momentum") -> tuple[Cluster, Shard, bytes]:
    cluster = make_cluster(1)
    shard = Shard(0, RULES[rule], np.arange(64, dtype=F32), chunk=32)
    shard.install(cluster)
    return cluster, shard, cluster.nodes[0].memory.tobytes()


def test_a_gradient_of_another_dtype_is_refused() -> None:
    """The codec refuses to send it; on the wire it is BAD_DTYPE, and nothing changes."""
    cluster, shard, before = _setup()
    [update, _] = shard.updates(np.ones(64, F32), DType.F32, 1, 80)
    data = bytearray(encode_packet(update))
    data[H_DTYPE] = DType.I32
    cluster.fabric.send(cluster.client, cluster.endpoints[0], bytes(data))
    cluster.fabric.run_until_idle()
    [(reply, _)] = cluster.fabric.receive(cluster.client)
    assert decode_packet(reply).status == Status.BAD_DTYPE
    assert cluster.nodes[0].memory.tobytes() == before


def test_whoever_lacks_the_rights_changes_nothing() -> None:
    cluster, shard, before = _setup()
    grad = np.ones(64, F32)
    [update, _] = shard.updates(grad, DType.F32, 1, 50)
    node = cluster.nodes[0]
    # A wrong key: BAD_RKEY, counted against the sender.
    reply = _request(cluster, replace(update, rkey=RKEY ^ 0x5555))
    assert (reply.opcode, reply.status) == (Opcode.NACK, Status.BAD_RKEY)
    assert node.counters[C.NACK_BASE + Status.BAD_RKEY] == 1
    # A key that only reads (a region of its own, the descriptor copied into it): NO_RIGHTS.
    ro_base, ro_key = 1 << 19, 0x0BAD_F00D
    node.deregister_region(RKEY)
    node.register_region(0, ro_base, int(Rights.READ | Rights.WRITE), rkey=RKEY)
    node.register_region(ro_base, 1 << 16, int(Rights.READ), rkey=ro_key)
    shard.install(cluster)  # a region given back is wiped (SPEC.md 6.2)
    memory = node.memory
    memory[ro_base : ro_base + 4096] = memory[BASE : BASE + 4096]
    before = memory.tobytes()
    reply = _request(cluster, replace(update, rkey=ro_key, addr=ro_base))
    assert (reply.opcode, reply.status) == (Opcode.NACK, Status.NO_RIGHTS)
    assert memory[: 1 << 19].tobytes() == before[: 1 << 19]
    assert memory[ro_base : ro_base + 4096].tobytes() == before[BASE : BASE + 4096]
    # The owner's key: applied.
    assert _request(cluster, update).opcode == Opcode.ACK
    shard.reference_step(grad, DType.F32, 1)
    assert shard.on_node(cluster, PARAMS)[:32].tobytes() == shard.ref_p[:32].tobytes()


MALFORMED: list[tuple[str, dict[str, Any], Status]] = [
    ("a step skipped", {"epoch": 2}, Status.OUT_OF_STEP),
    ("step 0", {"epoch": 0}, Status.BAD_FIELD),
    ("a chunk that is not one", {"aux_addr": 16}, Status.BAD_FIELD),
    ("past the parameters", {"aux_addr": 64}, Status.BAD_FIELD),
    ("half a chunk", {"payload": bytes(64)}, Status.BAD_LENGTH),
    ("a descriptor out of the region", {"addr": (1 << 20) - 64}, Status.OUT_OF_BOUNDS),
    ("a misaligned descriptor", {"addr": BASE + 4}, Status.MISALIGNED),
]


@pytest.mark.parametrize(("label", "change", "status"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_update_changes_nothing(
    label: str, change: dict[str, Any], status: Status
) -> None:
    cluster, shard, before = _setup()
    [update, _] = shard.updates(np.ones(64, F32), DType.F32, 1, 60)
    if "payload" in change:
        update = update.with_payload(change.pop("payload"))
    reply = _request(cluster, replace(update, **change))
    assert (reply.opcode, reply.status) == (Opcode.NACK, status), label
    assert cluster.nodes[0].memory.tobytes() == before


BAD_DESCRIPTORS: list[tuple[str, int, bytes]] = [
    ("an unknown rule", 0, b"\x09"),
    ("an undefined flag", 1, b"\x02"),
    ("reserved bytes", 88, b"\x01"),
    ("a chunk of 0", 4, bytes(4)),
    ("a step table past 2^48", 40, (1 << 50).to_bytes(8, "little")),
    ("moments past the region", 24, (1 << 30).to_bytes(8, "little")),
    ("Nesterov with dampening", 1, b"\x01"),
]


@pytest.mark.parametrize(
    ("label", "at", "value"), BAD_DESCRIPTORS, ids=[b[0] for b in BAD_DESCRIPTORS]
)
def test_a_malformed_descriptor_changes_nothing(label: str, at: int, value: bytes) -> None:
    cluster, shard, _ = _setup()
    memory = cluster.nodes[0].memory
    memory[BASE + at : BASE + at + len(value)] = np.frombuffer(value, np.uint8)
    before = memory.tobytes()
    [update, _] = shard.updates(np.ones(64, F32), DType.F32, 1, 70)
    reply = _request(cluster, update)
    want = Status.OUT_OF_BOUNDS if label == "moments past the region" else Status.BAD_FIELD
    assert (reply.opcode, reply.status) == (Opcode.NACK, want), label
    assert memory.tobytes() == before
