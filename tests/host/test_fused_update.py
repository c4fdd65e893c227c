"""Fused reduce and update (SPEC.md 4.1): one collective per step. The chain sums each block of
the ranks' gradients, the block's last hop (the NIC holding that block of the optimizer) steps
the optimizer there instead of storing the sum, and the multicast all-gather carries the new
weights. Every rank ends with the reference's weights bit for bit: the chain-order sum of the
wire-rounded gradients, then the rule of netdam.protocol.optim, then the wire's rounding; under
loss, duplication and reordering too (each chunk stepped once); and a START_COLL whose step
does not follow the NIC's, or whose descriptor is not the node's block, starts nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from netdam import api
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.core.faults import FaultSpec
from netdam.optim import OptimizerError, PoolAdamW, PoolOptimizer, PoolSGD
from netdam.protocol.constants import DType, Status
from netdam.protocol.elements import bf16_combine, bf16_round
from netdam.protocol.optim import AdamRule, SgdRule, adam_step, gradient_values, sgd_step

_WIRE = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16}


def _to_wire(values: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype == DType.F32:
        return values.astype(np.float32)
    if dtype == DType.F16:
        return values.astype(np.float16)
    return bf16_round(values)


def _chain_sum(wires: Sequence[np.ndarray], dtype: DType) -> np.ndarray:
    """The all-reduce's sum, block j folded over ranks j+1, ..., j in the wire's dtype."""
    n, count = len(wires), wires[0].size
    out = np.empty_like(wires[0])
    for j in range(n):
        lo, hi = j * count // n, (j + 1) * count // n
        acc = wires[(j + 1) % n][lo:hi].copy()
        for k in range(2, n + 1):
            x = wires[(j + k) % n][lo:hi]
            acc = bf16_combine(acc, x, 0) if dtype == DType.BF16 else acc + x
        out[lo:hi] = acc
    return out


class _Reference:
    """The fused step's result in plain numpy: masters and moments of the whole model (the
    rules are element-wise, so one array stands for every NIC's block)."""

    def __init__(self, initial: np.ndarray, rule: SgdRule | AdamRule, dtype: DType) -> None:
        self.p, self.m, self.v = initial.copy(), np.zeros_like(initial), np.zeros_like(initial)
        self.rule, self.dtype, self.steps = rule, dtype, 0

    def step(self, grads: Sequence[np.ndarray]) -> np.ndarray:
        world = len(grads)
        wires = [_to_wire(g / np.float32(world), self.dtype) for g in grads]
        g = gradient_values(_chain_sum(wires, self.dtype), self.dtype)
        self.steps += 1
        if isinstance(self.rule, SgdRule):
            sgd_step(self.p, g, self.m, self.steps, self.rule)
        else:
            adam_step(self.p, g, self.m, self.v, self.steps, self.rule)
        return gradient_values(_to_wire(self.p, self.dtype), self.dtype)


def _ranks(
    cluster: LocalCluster, world: int, body: Callable[[api.ProcessGroup, int], None]
) -> None:
    """Run *body* on every rank at once, one thread and ProcessGroup each; re-raise the first
    error in the test's thread."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        group = api.ProcessGroup(cluster.info, r)
        try:
            body(group, r)
        except BaseException as exc:  # noqa: BLE001  # re-raised below, in the test's thread
            errors.append(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def _train(
    cluster: LocalCluster,
    world: int,
    make: Callable[[list[np.ndarray], api.ProcessGroup], PoolOptimizer],
    rule: SgdRule | AdamRule,
    grad_dtype: str,
    steps: int,
    seed: int,
    shapes: Sequence[tuple[int, ...]] = ((517, 9), (33,)),
) -> int:
    """*steps* fused steps on every rank, each checked against the reference on every rank;
    returns the chains re-sent and repair reads the ranks' nodes needed."""
    rng = np.random.default_rng(seed)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [
        [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(world)]
        for _ in range(steps)
    ]
    reference = _Reference(np.concatenate([p.ravel() for p in initial]), rule, _WIRE[grad_dtype])
    expected = [
        reference.step([np.concatenate([g.ravel() for g in rank]) for rank in step])
        for step in grads
    ]
    got: dict[tuple[int, int], bytes] = {}
    recovered: list[int] = []

    def rank(group: api.ProcessGroup, r: int) -> None:
        params = [p.copy() for p in initial]
        with make(params, group) as opt:
            for k in range(steps):
                opt.step(grads[k][r])
                got[r, k] = np.concatenate([p.ravel() for p in params]).tobytes()
                recovered.append(opt.last_stats["retransmits"] + opt.last_stats["repair_reads"])

    _ranks(cluster, world, rank)
    for k in range(steps):
        for r in range(world):
            assert got[r, k] == expected[k].tobytes(), (r, k)
    return sum(recovered)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fused_sgd_equals_the_reference_on_every_rank(world: int) -> None:
    rule = SgdRule(lr=0.05, momentum=0.9, weight_decay=1e-3)
    with start_cluster(world, memory=4 << 20) as cluster:
        _train(
            cluster,
            world,
            lambda params, group: PoolSGD(
                params, lr=0.05, momentum=0.9, weight_decay=1e-3, group=group, fused=True
            ),
            rule,
            "float32",
            steps=3,
            seed=world,
        )


#: The faulted runs' model: 46,563 parameters, so each block of the chain and of the all-gather
#: spans several datagrams even at 2 ranks (bf16, 9000-byte MTU). With 4,686 parameters (one
#: datagram a block) a 2-rank run of 3 steps received 28-71 datagrams a node, and the draws,
#: which hash the nodes' ports too, could spare every chain and gather: 25 runs beside two CPU
#: hogs re-sent 1 to 16 times, and one CI run 0 times, testing no re-send. This model: 120-268
#: datagrams a node and 46-70 re-sends in 5 runs.
_FAULTED_MODEL = ((517, 90), (33,))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "loss"), [(2, 0.3), (4, 0.2), (8, 0.1)])
def test_fused_adam_with_bf16_gradients_steps_each_chunk_once_under_faults(
    world: int, loss: float
) -> None:
    """Loss, duplicates and reordering on every node: re-sent chains and gathers never step a
    chunk twice (the collective's guard), and the weights stay the reference's bit for bit."""
    faults = FaultSpec(loss=loss, dup=0.1, reorder=0.1, seed=40 + world)
    rule = AdamRule(lr=1e-2, weight_decay=0.01, decoupled=True)
    with start_cluster(world, memory=4 << 20, faults=faults) as cluster:
        recovered = _train(
            cluster,
            world,
            lambda params, group: PoolAdamW(
                params, lr=1e-2, weight_decay=0.01, group=group, fused=True, grad_dtype="bfloat16"
            ),
            rule,
            "bfloat16",
            steps=3,
            seed=world + 100,
            shapes=_FAULTED_MODEL,
        )
    assert recovered > 0  # the faults were felt, and recovered from


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalCluster]:
    with start_cluster(2, memory=4 << 20) as running:
        yield running


def test_fused_f16_and_a_new_learning_rate_between_steps(pair: LocalCluster) -> None:
    rng = np.random.default_rng(3)
    initial = rng.standard_normal(3001).astype(np.float32)
    grads = [[rng.standard_normal(3001).astype(np.float32) for _ in range(2)] for _ in range(3)]
    reference = _Reference(initial, SgdRule(lr=0.1), DType.F16)
    expected = [reference.step(grads[0]), reference.step(grads[1])]
    reference.rule = SgdRule(lr=0.01)
    expected.append(reference.step(grads[2]))
    got: dict[tuple[int, int], bytes] = {}

    def rank(group: api.ProcessGroup, r: int) -> None:
        w = initial.copy()
        with PoolSGD([w], lr=0.1, group=group, fused=True, grad_dtype="float16") as opt:
            for k in range(3):
                if k == 2:
                    opt.lr = 0.01
                opt.step([grads[k][r]])
                got[r, k] = w.tobytes()

    _ranks(pair, 2, rank)
    for k in range(3):
        assert got[0, k] == got[1, k] == expected[k].tobytes(), k


def test_a_plain_all_reduce_after_fused_steps_is_a_plain_sum(pair: LocalCluster) -> None:
    """The group's next all-reduce runs in the slot its fused steps used: it stores the sum
    and leaves the optimizer alone (a slot keeps nothing of a fused call)."""
    initial = np.arange(600, dtype=np.float32)
    sums: dict[int, np.ndarray] = {}
    masters: dict[int, tuple[bytes, bytes]] = {}

    def rank(group: api.ProcessGroup, r: int) -> None:
        with PoolSGD([initial.copy()], lr=0.5, momentum=0.9, group=group, fused=True) as opt:
            opt.step([np.full(600, r + 1.0, np.float32)])
            before = opt.masters.tobytes()
            buf = np.full(600, 10.0 * (r + 1), np.float32)
            api.all_reduce(buf, group=group)
            sums[r] = buf
            masters[r] = (before, opt.masters.tobytes())

    _ranks(pair, 2, rank)
    for r in range(2):
        np.testing.assert_array_equal(sums[r], np.full(600, 30.0, np.float32))
        assert masters[r][0] == masters[r][1]


def test_a_step_out_of_turn_starts_nothing(pair: LocalCluster) -> None:
    """A host that names the wrong step is refused OUT_OF_STEP at START_COLL, before any chain
    runs, and the weights it already had stay as they were on every NIC."""
    initial = np.arange(400, dtype=np.float32)
    outcome: dict[int, object] = {}

    def rank(group: api.ProcessGroup, r: int) -> None:
        w = initial.copy()
        with PoolSGD([w], lr=0.5, group=group, fused=True) as opt:
            opt.step([np.ones(400, np.float32)])
            after_one = w.copy()
            opt.steps = 5  # the host lost count: the NICs are at step 1
            try:
                opt.step([np.ones(400, np.float32)])
            except OptimizerError as e:
                outcome[r] = e.status
            np.testing.assert_array_equal(w, after_one)
            np.testing.assert_array_equal(opt.masters, after_one[opt.lo : opt.hi])

    _ranks(pair, 2, rank)
    assert Status.OUT_OF_STEP in outcome.values(), outcome
