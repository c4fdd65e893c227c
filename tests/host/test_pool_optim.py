"""netdam.optim on real NICs: PoolSGD and PoolAdam keep the masters and moments in the rank's NIC
and step them there with UPDATEs: bitwise the numpy reference of the same rule (netdam.protocol
.optim), a new learning rate between steps, bf16 gradients; and a torch model trained with
PoolAdam follows torch.optim.Adam's losses within float32 rounding."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from netdam import api
from netdam.cluster.launch import LocalCluster, start_cluster
from netdam.optim import OptimizerError, PoolAdam, PoolAdamW, PoolSGD
from netdam.protocol.constants import DType, Status
from netdam.protocol.elements import bf16_round
from netdam.protocol.optim import AdamRule, SgdRule, adam_step, gradient_values, sgd_step


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with start_cluster(2, memory=8 << 20) as running:
        yield running


def test_pool_adam_and_sgd_equal_the_reference(cluster: LocalCluster) -> None:
    group = api.ProcessGroup(cluster.info, 0)
    try:
        rng = np.random.default_rng(4)
        shapes = [(64, 33), (33,), (5000,)]
        params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        flat = np.concatenate([p.ravel() for p in params])
        ref_p, ref_m, ref_v = flat.copy(), np.zeros_like(flat), np.zeros_like(flat)
        adam = AdamRule(lr=1e-2, weight_decay=0.01)
        with PoolAdam(params, lr=1e-2, weight_decay=0.01, group=group) as opt:
            for step in range(1, 4):
                grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
                opt.step(grads)
                adam_step(
                    ref_p, np.concatenate([g.ravel() for g in grads]), ref_m, ref_v, step, adam
                )
                assert np.concatenate([p.ravel() for p in params]).tobytes() == ref_p.tobytes()
            opt.lr = 5e-3  # between steps: the descriptor's lr in NIC memory
            grads = [np.ones(s, np.float32) for s in shapes]
            opt.step(grads)
            adam_step(
                ref_p, np.ones_like(ref_p), ref_m, ref_v, 4, AdamRule(lr=5e-3, weight_decay=0.01)
            )
            assert np.concatenate([p.ravel() for p in params]).tobytes() == ref_p.tobytes()
        # SGD with Nesterov momentum and bf16 gradients.
        w = rng.standard_normal(9000).astype(np.float32)
        ref, buf = w.copy(), np.zeros_like(w)
        rule = SgdRule(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
        with PoolSGD(
            [w],
            lr=0.1,
            momentum=0.9,
            weight_decay=1e-3,
            nesterov=True,
            group=group,
            grad_dtype="bfloat16",
        ) as opt:
            for step in range(1, 4):
                g = rng.standard_normal(9000).astype(np.float32)
                opt.step([g])
                sgd_step(ref, gradient_values(bf16_round(g), DType.BF16), buf, step, rule)
                assert w.tobytes() == ref.tobytes()
    finally:
        group.close()


def test_a_refused_step_raises_with_the_status(cluster: LocalCluster) -> None:
    group = api.ProcessGroup(cluster.info, 1)
    try:
        w = np.zeros(100, np.float32)
        with PoolAdamW([w], group=group) as opt:
            opt.step([np.ones(100, np.float32)])
            opt.steps = 2  # as if a step had been lost on the host: the NIC knows better
            with pytest.raises(OptimizerError, match="OUT_OF_STEP") as info:
                opt.step([np.ones(100, np.float32)])
            assert info.value.status == Status.OUT_OF_STEP
    finally:
        group.close()


def test_a_torch_model_trains_like_torch_optim(cluster: LocalCluster) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    data = torch.randn(256, 16)
    target = data @ torch.randn(16, 1) + 0.1 * torch.randn(256, 1)

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def train(net: torch.nn.Module, opt: object) -> list[float]:
        losses = []
        for _ in range(30):
            opt.zero_grad()  # type: ignore[attr-defined]
            loss = torch.nn.functional.mse_loss(net(data), target)
            loss.backward()
            opt.step()  # type: ignore[attr-defined]
            losses.append(loss.item())
        return losses

    ours = model()
    group = api.ProcessGroup(cluster.info, 0)
    try:
        with PoolAdam(ours.parameters(), lr=1e-2, group=group) as pool:
            pooled = train(ours, pool)
    finally:
        group.close()
    theirs = model()
    reference = train(theirs, torch.optim.Adam(theirs.parameters(), lr=1e-2, foreach=False))
    assert pooled[-1] < 0.5 * pooled[0]  # it learned
    np.testing.assert_allclose(pooled, reference, rtol=1e-4)


def test_sharded_state_steps_a_block_per_nic_and_gathers_the_weights(cluster: LocalCluster) -> None:
    """shard=True: each rank's NIC keeps and steps only its block; after each step the group
    all-gathers the weights, and both ranks hold the reference's, bit for bit."""
    shapes = [(301, 7), (9,)]
    rng = np.random.default_rng(8)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    steps = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    flat = np.concatenate([p.ravel() for p in initial])
    ref_p, ref_m, ref_v = flat.copy(), np.zeros_like(flat), np.zeros_like(flat)
    rule = AdamRule(lr=1e-2, weight_decay=0.1, decoupled=True)
    for k, grads in enumerate(steps, start=1):
        adam_step(ref_p, np.concatenate([g.ravel() for g in grads]), ref_m, ref_v, k, rule)
    results: dict[int, np.ndarray] = {}
    local: dict[int, int] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        group = api.ProcessGroup(cluster.info, r)
        try:
            params = [p.copy() for p in initial]
            with PoolAdamW(params, lr=1e-2, weight_decay=0.1, group=group, shard=True) as opt:
                local[r] = opt.hi - opt.lo
                for grads in steps:
                    opt.step(grads)
            results[r] = np.concatenate([p.ravel() for p in params])
        except BaseException as exc:  # noqa: BLE001  # re-raised below, in the test's thread
            errors.append(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(local.values()) == flat.size and local[0] < flat.size  # each NIC a block
    for r in range(2):
        assert results[r].tobytes() == ref_p.tobytes(), r
