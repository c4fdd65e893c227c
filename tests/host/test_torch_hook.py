"""The PyTorch DDP communication hook (netdam.clients.ddp) and examples/ddp_train.py. Skipped
without torch (an optional extra)."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import load_example

from netdam.api import CollectiveError
from netdam.cluster.launch import LocalCluster, start_cluster

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed (pip install torch)", allow_module_level=True)


class _OnFirstUse:
    """A module imported when a test first uses it, not when the file is collected: every
    pytest process collects every file, and importing torch took ~3 s of each collection."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # what collection asks of every module global (__test__, ...)
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


torch: Any = _OnFirstUse("torch")
ddp: Any = _OnFirstUse("netdam.clients.ddp")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_train.py"


class FakeBucket:
    """What the hook uses of dist.GradBucket (which has no Python constructor)."""

    def __init__(self, tensor: Any, index: int = 0) -> None:
        self._tensor, self._index = tensor, index

    def buffer(self) -> Any:
        return self._tensor

    def index(self) -> int:
        return self._index


#: Each test's states start their epochs apart: the nodes outlive the groups (module fixture),
#: and a fresh group starting at the node's last epoch would get a replayed completion.
_EPOCHS = itertools.count(1000, 1000)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[LocalCluster]:
    with start_cluster(2, memory=1 << 20) as cluster:
        yield cluster


def test_netdam_torch_is_the_real_torch() -> None:
    import torch as real_torch

    import netdam.clients.ddp as hook_module

    assert vars(hook_module)["torch"] is real_torch and hasattr(real_torch, "nn")


def test_without_torch_the_import_error_says_how_to_install() -> None:
    code = "import sys; sys.modules['torch'] = None\ntry:\n import netdam.clients.ddp\nexcept ImportError as e:\n print(e)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert "pip install torch==2.13.0" in out and "'netdam[torch]'" not in out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hook_chunks_a_bucket_larger_than_one_chunk(two_nodes: LocalCluster, dtype: str) -> None:
    dt = getattr(torch, dtype)
    base = next(_EPOCHS)
    states = [
        ddp.NetdamHookState(two_nodes.info, rank, 2, chunk_bytes=4096, epoch_base=base)
        for rank in range(2)
    ]
    try:
        assert states[0].chunk_bytes == 4096
        n = 10_001  # not a multiple of the chunk
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(n, generator=gen).to(dt) for _ in range(2)]
        buckets = [x.clone() for x in inputs]
        # Both ranks' hooks return at once: the worker threads run the collectives together.
        futures = [ddp.netdam_allreduce_hook(s, FakeBucket(b, 5)) for s, b in zip(states, buckets)]
        outs = [f.wait() for f in futures]
        per_chunk = 4096 // (
            2 if dt in (torch.float16, torch.bfloat16) else 4
        )  # bf16 too is 2 bytes on the wire
        assert states[0].collectives == states[1].collectives == -(-n // per_chunk) > 1
        assert outs[0].data_ptr() == buckets[0].data_ptr()  # in place, in the bucket
        assert torch.equal(outs[0], outs[1])  # replicas stay identical
        if dt == torch.float32:
            # Two ranks: the sum is one rounding, the halving exact: bitwise Gloo's answer.
            assert torch.equal(outs[0], (inputs[0] + inputs[1]) / 2)
        elif dt == torch.float16:
            assert torch.equal(outs[0], (inputs[0] + inputs[1]) / 2)  # f16 adds in the NICs
        else:
            # bf16 adds in the NICs as torch adds bf16 (one rounding), then torch halves it.
            assert torch.equal(outs[0], (inputs[0] + inputs[1]) / 2)
        assert states[0].bytes == n * dt.itemsize
    finally:
        for state in states:
            state.close()


def test_sum_without_average_and_float64(two_nodes: LocalCluster) -> None:
    base = next(_EPOCHS)
    states = [
        ddp.NetdamHookState(
            two_nodes.info,
            rank,
            2,
            average=False,
            asynchronous=False,
            chunk_bytes=1024,
            epoch_base=base,
        )
        for rank in range(2)
    ]
    try:
        # Synchronous: run rank 0 on a thread so both ranks are in the collective at once.
        import threading

        data = [torch.arange(300, dtype=torch.float64) * (rank + 1) for rank in range(2)]
        thread = threading.Thread(target=states[0].reduce_, args=(data[0],))
        thread.start()
        states[1].reduce_(data[1])
        thread.join()
        expect = torch.arange(300, dtype=torch.float64) * 3
        assert torch.equal(data[0], expect) and torch.equal(data[1], expect)
        assert states[0].collectives == 3  # 128 f64 per 1 KiB chunk
    finally:
        for state in states:
            state.close()


def test_rank_and_world_size_are_checked(two_nodes: LocalCluster) -> None:
    with pytest.raises(ValueError, match="cluster has 2 nodes"):
        ddp.NetdamHookState(two_nodes.info, 0, world_size=3)
    with pytest.raises(ValueError, match="cluster= and rank="):
        ddp.NetdamHookState()


def test_unsupported_dtype_is_refused(two_nodes: LocalCluster) -> None:
    with ddp.NetdamHookState(two_nodes.info, 0, 2) as state:
        with pytest.raises(TypeError, match="cannot reduce torch.int32"):
            state.submit(torch.ones(4, dtype=torch.int32)).wait()
        with pytest.raises(
            RuntimeError, match="TypeError: netdam.clients.ddp cannot reduce torch.int32"
        ):
            ddp.netdam_allreduce_hook(state, FakeBucket(torch.ones(4, dtype=torch.int32))).wait()
        assert state.collectives == 0


@pytest.mark.slow
def test_failed_allreduce_surfaces_through_the_future_and_ddp(tmp_path: Path) -> None:
    """A dead node: the hook's future raises, DDP's backward raises with the same message, and
    later buckets fail at once (the ranks are out of step)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with start_cluster(1, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
            model = DDP(torch.nn.Linear(4, 1))
            with ddp.NetdamHookState(cluster.path, 0, 1, timeout=0.5) as state:
                model.register_comm_hook(state, ddp.netdam_allreduce_hook)
                model(torch.ones(2, 4)).sum().backward()  # works while the node lives
                assert state.collectives == 1
                assert state.group.epoch != 1  # the base came from rank 0's clock, over Gloo
                os.kill(cluster.info.nodes[0].pid, signal.SIGKILL)
                cluster.processes[0].wait(timeout=10)
                with pytest.raises(
                    RuntimeError, match="netdam all-reduce of DDP bucket 0 failed on rank 0"
                ) as info:
                    model(torch.ones(2, 4)).sum().backward()
                assert "not answering: rank 0" in str(info.value)
                # The state's own future raises the CollectiveError itself, at once.
                with pytest.raises(CollectiveError, match="an earlier netdam all-reduce failed"):
                    state.submit(torch.ones(3)).wait()
                with pytest.raises(RuntimeError, match="earlier netdam all-reduce failed"):
                    ddp.netdam_allreduce_hook(state, FakeBucket(torch.ones(3))).wait()
    finally:
        dist.destroy_process_group()


def _example() -> ModuleType:
    module: ModuleType = load_example("ddp_train")
    return module


def test_example_comparison_fails_on_a_wrong_loss() -> None:
    """The example's verdict is not vacuous: a loss off by more than the tolerance, or replicas
    that drifted apart, fail it."""
    compare = _example().compare

    def rank(losses: list[float], crc: int = 1) -> dict[str, Any]:
        return {"losses": losses, "params": [0.0], "params_crc": crc}

    good = [{"netdam": rank([1.0, 0.5]), "gloo": rank([1.0, 0.5])}]
    assert compare(good, 1e-5, 1e-7)["ok"] is True
    off = [{"netdam": rank([1.0, 0.5001]), "gloo": rank([1.0, 0.5])}]
    verdict = compare(off, 1e-5, 1e-7)
    assert verdict["ok"] is False and verdict["max_abs_diff"] == pytest.approx(1e-4)
    drift = [
        {"netdam": rank([1.0], 1), "gloo": rank([1.0])},
        {"netdam": rank([1.0], 2), "gloo": rank([1.0])},
    ]
    assert compare(drift, 1e-5, 1e-7)["ok"] is False
    nan = [{"netdam": rank([float("nan")]), "gloo": rank([1.0])}]
    assert compare(nan, 1e-5, 1e-7)["ok"] is False


@pytest.mark.slow
def test_ddp_example_two_ranks_losses_agree_with_gloo() -> None:
    argv = [
        sys.executable,
        str(EXAMPLE),
        "--ranks",
        "2",
        "--steps",
        "4",
        "--hidden",
        "32",
        "--chunk-bytes",
        "4096",
        "--json",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout)
    assert r["ok"] is True and r["ranks"] == 2 and len(r["loss_netdam"]) == len(r["loss_gloo"]) == 4
    assert r["max_abs_diff"] <= 1e-7 + 1e-5 * max(r["loss_gloo"])
    assert r["netdam_replicas_identical"] is True and r["gloo_replicas_identical"] is True
    # The gradients really went through the NICs, in several buckets and chunks each.
    assert r["buckets"] >= 4 and r["collectives"] > r["buckets"]
    assert r["bytes_reduced"] == 4 * 4 * (16 * 32 + 32 + 32 * 32 + 32 + 32 + 1)
    assert r["loss_netdam"][-1] < r["loss_netdam"][0]
    # Steps per second after the first step, both modes (measured, not compared here).
    assert r["steps_per_second_netdam"] > 0 and r["steps_per_second_gloo"] > 0
    assert r["steps_per_second_ratio"] == pytest.approx(
        r["steps_per_second_netdam"] / r["steps_per_second_gloo"]
    )


#: The example's optimizers in the NICs, run by one process (below).
POOL_OPTIMIZERS = ("pool", "pool-sharded", "pool-fused")
#: One process calling the example's main() once per optimizer, as a script that imports it
#: would: torch and the kernels load once, and each run's nodes are forked from it (as the
#: suite's are), not started as processes that load the kernels again.
_EACH_OPTIMIZER = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import ddp_train
from netdam.cluster.launch import fork_node_processes
fork_node_processes()
for optimizer in sys.argv[2:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ddp_train.main(["--ranks", "2", "--steps", "6", "--optimizer", optimizer, "--json"])
    print(json.dumps({"code": code, "result": json.loads(out.getvalue())}))
"""


@pytest.mark.slow
def test_ddp_example_with_the_optimizer_in_the_nics_agrees_with_gloo_and_torch_optim() -> None:
    """`--optimizer pool`: the netdam run's SGD steps in the NICs (netdam.optim.PoolSGD; with
    pool-sharded each NIC its rank's block, the weights all-gathered; with pool-fused one fused
    reduce and update a step, DDP's own all-reduce off), the Gloo run's in torch.optim.SGD: the
    same rule, so the losses agree as before. Each optimizer is a run of its own cluster."""
    proc = subprocess.run(
        [sys.executable, "-c", _EACH_OPTIMIZER, str(EXAMPLE.parent), *POOL_OPTIMIZERS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(runs) == len(POOL_OPTIMIZERS), proc.stdout + proc.stderr
    for optimizer, run in zip(POOL_OPTIMIZERS, runs, strict=True):
        r = run["result"]
        assert run["code"] == 0 and r["ok"] is True and r["optimizer"] == optimizer, r
        assert r["max_abs_diff"] <= 1e-7 + 1e-5 * max(r["loss_gloo"])
        assert r["netdam_replicas_identical"] is True
        assert r["loss_netdam"][-1] < r["loss_netdam"][0]
        if optimizer == "pool-fused":
            assert (r["collectives"], r["buckets"]) == (6, 0)  # one collective a step, no hook


def test_example_steps_per_second_take_the_slowest_rank() -> None:
    rate = _example().steps_per_second
    ranks = [
        {"netdam": {"steady_seconds": 1.0}, "gloo": {"steady_seconds": 2.0}},
        {"netdam": {"steady_seconds": 0.5}, "gloo": {"steady_seconds": 4.0}},
    ]
    out = rate(ranks, 11)
    assert out == {
        "steps_per_second_netdam": 10.0,
        "steps_per_second_gloo": 2.5,
        "steps_per_second_ratio": 4.0,
    }
    assert rate(ranks, 1)["steps_per_second_netdam"] is None


def test_example_takes_a_bf16_model_with_bf16s_tolerance() -> None:
    """``--dtype bfloat16`` trains in bf16 (its gradients cross the NICs as bf16) and compares
    losses within bf16's precision unless told otherwise; float32 keeps its 1e-5."""
    parse = _example().parse_args
    assert (parse(["--dtype", "bfloat16"]).rtol, parse([]).rtol, parse([]).dtype) == (
        2e-2,
        1e-5,
        "float32",
    )
    assert parse(["--dtype", "bfloat16", "--rtol", "0.1"]).rtol == 0.1
