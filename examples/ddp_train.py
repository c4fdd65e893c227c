"""Train a small MLP with PyTorch DDP twice on 2-4 CPU ranks: once with the gradient all-reduce
in the emulated NICs (the ``netdam.clients.ddp`` communication hook), once with plain Gloo, and
compare the loss curves.

    python examples/ddp_train.py --ranks 2 --steps 20 [--dtype bfloat16] [--json]

Starts a local netdam cluster (one node per rank), forks the ranks with
torch.multiprocessing; every rank joins a Gloo process group (DDP needs it for its initial
broadcast either way), then trains the same seeded model on the same seeded synthetic data,
first with the hook, then without. The curves agree within float tolerance, not bitwise: the
chain sums in another order than Gloo's ring, and DDP without a hook scales every gradient by
1/world before the sum where the hook divides the sum. ``--optimizer pool`` steps the netdam run's
optimizer in the NICs (``netdam.optim.PoolSGD``: the masters and momentum in each rank's NIC,
every step one UPDATE per chunk; ``pool-sharded``: each NIC its rank's block, the weights
all-gathered through the NICs after each step; ``pool-fused``: one fused reduce and update a
step, the chain's last hop stepping its block and the multicast carrying the new weights, with
no DDP all-reduce at all) where the Gloo run keeps ``torch.optim.SGD``: the same rule, so the
curves still agree within the tolerance. ``--dtype bfloat16`` trains a bf16 model:
its gradients cross the NICs as bf16 (2 bytes each), and every step's loss agrees within bf16's
precision (default rtol 2e-2). Exit 0 when every step's loss on every
rank agrees (|netdam - gloo| <= atol + rtol |gloo|) and the replicas stayed identical, 1
otherwise, 2 on a usage error, 3 when the run failed. Needs torch (``pip install
'netdam[torch]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import math
import os
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("netdam", "gloo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Default relative tolerance on a loss: float32's after a few roundings in another order, and
#: bf16's (8 significand bits: 2**-8 = 0.4% per rounding, over 20 steps of diverging order).
DEFAULT_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


def make_model(inputs: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


def make_data(seed: int, steps: int, batch: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded regression task: y = a fixed random teacher network of x, plus noise.
    Shape (steps, batch, ...): every step's global batch, split evenly over the ranks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, batch, inputs, generator=gen)
    w1 = torch.randn(inputs, 8, generator=gen)
    w2 = torch.randn(8, 1, generator=gen)
    y = torch.tanh(x @ w1) @ w2 + 0.1 * torch.randn(steps, batch, 1, generator=gen)
    return x, y


def run_rank(
    rank: int, world: int, cluster_path: str, options: dict[str, Any], outdir: str
) -> None:
    """One DDP rank: both trainings, results to outdir/rank{rank}.json.

    The ranks meet through a file in *outdir* (a TCP port picked beforehand may be taken by
    the time rank 0 binds it). Whatever happens, the process group is destroyed before the
    interpreter exits: a rank that exits with gloo's threads alive aborts in C++ ("terminate
    called without an active exception", SIGABRT), and torch.multiprocessing then reports the
    signal and drops the rank's traceback, which is printed here first."""
    faulthandler.enable()  # a C++ abort still shows every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=Path(outdir, "rendezvous").as_uri(),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        _train(rank, world, cluster_path, options, outdir)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        dist.destroy_process_group()
    # Done, and the results are written: leave without the interpreter's finalization. Twice in
    # CI (torch 2.13, CPU) a rank that had finished aborted there ("terminate called without an
    # active exception", then a crash in faulthandler's dump of a thread being torn down), and
    # torch's spawn reported a signal for a run whose work was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(rank: int, world: int, cluster_path: str, options: dict[str, Any], outdir: str) -> None:
    from netdam.clients.ddp import NetdamHookState, netdam_allreduce_hook

    steps, batch, inputs = options["steps"], options["batch"], options["inputs"]
    dtype = DTYPES[options["dtype"]]
    x, y = make_data(options["seed"], steps, batch * world, inputs)
    x, y = x.to(dtype), y.to(dtype)
    mine = slice(rank * batch, (rank + 1) * batch)
    out: dict[str, Any] = {"rank": rank}
    for mode in MODES:
        torch.manual_seed(options["seed"])
        model = DDP(
            make_model(inputs, options["hidden"]).to(dtype), bucket_cap_mb=options["bucket_cap_mb"]
        )
        state = None
        if mode == "netdam":
            state = NetdamHookState(cluster_path, rank, world, chunk_bytes=options["chunk_bytes"])
            model.register_comm_hook(state, netdam_allreduce_hook)
        opt: Any
        fused = mode == "netdam" and options["optimizer"] == "pool-fused"
        if mode == "netdam" and options["optimizer"] in ("pool", "pool-sharded", "pool-fused"):
            from netdam.optim import PoolSGD

            assert state is not None
            opt = PoolSGD(
                model.parameters(),
                lr=options["lr"],
                momentum=0.9,
                group=state.group,
                shard=options["optimizer"] == "pool-sharded",
                fused=fused,
                # A fused step's weights come back in the gradients' dtype: the model's.
                grad_dtype=options["dtype"] if fused else "float32",
            )
        else:
            opt = torch.optim.SGD(model.parameters(), lr=options["lr"], momentum=0.9)
        losses = []
        dist.barrier()
        start = time.perf_counter()
        first_step_end = start
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            # A fused step reduces the gradients itself, in the NICs: DDP must not (no_sync).
            with model.no_sync() if fused else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(x[step, mine]), y[step, mine])
                loss.backward()  # type: ignore[no-untyped-call]  # torch leaves backward untyped
            opt.step()
            losses.append(loss.item())
            if step == 0:
                first_step_end = time.perf_counter()
        end = time.perf_counter()
        seconds = end - start
        params = torch.cat(
            [p.detach().reshape(-1) for p in model.parameters()]
        ).float()  # bf16 widens exactly
        out[mode] = {
            "losses": losses,
            "seconds": seconds,
            # Steady state: the first step also builds DDP's buckets and settles the epochs.
            "steady_seconds": end - first_step_end,
            "params": params.tolist(),
            "params_crc": zlib.crc32(params.numpy().tobytes()),
        }
        if state is not None:
            out[mode].update(
                collectives=state.collectives, buckets=state.buckets, bytes=state.bytes
            )
            if fused:  # no DDP all-reduce ran: one fused NIC collective a step instead
                wire = sum(p.numel() * p.element_size() for p in model.parameters())
                out[mode].update(collectives=steps, bytes=steps * wire)
            if options["optimizer"] != "torch":
                opt.close()
            state.close()
        dist.barrier()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))


def compare(ranks: list[dict[str, Any]], rtol: float, atol: float) -> dict[str, Any]:
    """The verdict from every rank's results: losses per step and rank, final parameters,
    replicas identical within each mode."""
    max_abs = max_rel = 0.0
    agree = True
    for r in ranks:
        for a, b in zip(r["netdam"]["losses"], r["gloo"]["losses"], strict=True):
            diff = abs(a - b)
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / abs(b) if b else diff)
            agree &= math.isfinite(a) and diff <= atol + rtol * abs(b)
    params_diff = max(
        abs(a - b)
        for r in ranks
        for a, b in zip(r["netdam"]["params"], r["gloo"]["params"], strict=True)
    )
    identical = {mode: len({r[mode]["params_crc"] for r in ranks}) == 1 for mode in MODES}
    steps = len(ranks[0]["netdam"]["losses"])
    mean = {
        mode: [sum(r[mode]["losses"][s] for r in ranks) / len(ranks) for s in range(steps)]
        for mode in MODES
    }
    return {
        "ok": bool(agree and identical["netdam"] and identical["gloo"]),
        "loss_netdam": mean["netdam"],
        "loss_gloo": mean["gloo"],
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "params_max_abs_diff": params_diff,
        "netdam_replicas_identical": identical["netdam"],
        "gloo_replicas_identical": identical["gloo"],
        "bitwise_equal_losses": max_abs == 0.0,
    }


def steps_per_second(ranks: list[dict[str, Any]], steps: int) -> dict[str, float | None]:
    """Training steps per second of each mode after the first step, on the slowest rank (a
    step ends for the job when its last rank ends it), and hook over Gloo."""
    out: dict[str, float | None] = {}
    for mode in MODES:
        slowest = max(r[mode]["steady_seconds"] for r in ranks)
        out[f"steps_per_second_{mode}"] = (
            (steps - 1) / slowest if steps > 1 and slowest > 0 else None
        )
    a, b = out["steps_per_second_netdam"], out["steps_per_second_gloo"]
    out["steps_per_second_ratio"] = a / b if a and b else None
    return out


def hardware_estimate(params: int, args: argparse.Namespace) -> dict[str, float]:
    """The cycle model's steps/s for this model and rank count on 100G cards and on RoCE hosts
    with torch.optim (netdam model optimizer), beside the emulator's measured ones."""
    from netdam.fpga_model.collectives import default_params
    from netdam.fpga_model.optimizer import optimizer_step

    grad_bytes = 2 if args.dtype == "bfloat16" else 4
    card, host = optimizer_step(
        *default_params(100.0), args.ranks, params, "sgd-momentum", grad_bytes
    )
    return {
        "model_steps_per_second_100g_netdam": card.steps_per_second,
        "model_steps_per_second_100g_roce": host.steps_per_second,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=2, help="DDP ranks = netdam nodes, 2..4 (2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (20)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (32)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP (64)")
    parser.add_argument("--inputs", type=int, default=16, help="input features (16)")
    parser.add_argument(
        "--lr", type=float, default=0.02, help="SGD learning rate, momentum 0.9 (0.02)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.01,
        help="DDP bucket cap in MB; small so the MLP's gradients span several buckets (0.01)",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=8 << 20,
        help="largest piece of a bucket in one NIC all-reduce (8 MiB)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the model's and its gradients' dtype (float32)",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="relative tolerance on every loss (1e-5; 2e-2 for bfloat16)",
    )
    parser.add_argument(
        "--atol", type=float, default=1e-7, help="absolute tolerance on every loss (1e-7)"
    )
    parser.add_argument(
        "--optimizer",
        choices=("torch", "pool", "pool-sharded", "pool-fused"),
        default="torch",
        help="the netdam run's optimizer: torch.optim.SGD on the host, or netdam.optim.PoolSGD "
        "in the NICs, each holding all the state or (pool-sharded) its rank's block, or "
        "(pool-fused) its block stepped by the chain's last hop: one collective a step (torch)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL[args.dtype]
    if not 2 <= args.ranks <= 4:
        parser.error("--ranks must be 2..4")
    if args.steps < 1 or args.batch < 1 or args.hidden < 1 or args.inputs < 1:
        parser.error("--steps, --batch, --hidden and --inputs must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    from netdam.cluster.launch import start_cluster

    result: dict[str, Any] = {
        "ok": False,
        "ranks": args.ranks,
        "steps": args.steps,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "rtol": args.rtol,
        "atol": args.atol,
        "torch": torch.__version__,
    }
    options = {
        k: getattr(args, k)
        for k in (
            "steps",
            "batch",
            "hidden",
            "inputs",
            "lr",
            "seed",
            "bucket_cap_mb",
            "chunk_bytes",
            "dtype",
            "optimizer",
        )
    }
    t0 = time.perf_counter()
    try:
        with (
            start_cluster(args.ranks, memory=16 << 20) as cluster,
            tempfile.TemporaryDirectory(prefix="netdam-ddp-") as tmp,
        ):
            result["startup_seconds"] = round(time.perf_counter() - t0, 3)
            # fork, not spawn: the ranks inherit torch and netdam already imported, where each
            # spawned rank imported them again (~2.5 s of the example's ~11.6 s on 2 cores).
            # Safe here: this process runs no other thread and has not touched torch's thread
            # pools (each rank sets its own) or CUDA before it forks.
            mp.start_processes(
                run_rank,
                args=(args.ranks, str(cluster.path), options, tmp),
                nprocs=args.ranks,
                join=True,
                start_method="fork",
            )
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    except Exception as exc:  # a rank raised, or the cluster did not start
        result["error"] = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        )
        print(
            json.dumps(result) if args.json else f"ddp_train: run failed: {result['error']}",
            file=sys.stdout,
        )
        if not args.json:
            print(str(exc), file=sys.stderr)
        return 3
    result.update(compare(ranks, args.rtol, args.atol))
    hook = ranks[0]["netdam"]
    result.update(
        collectives=hook["collectives"],
        buckets=hook["buckets"],
        bytes_reduced=hook["bytes"],
        seconds_netdam=round(hook["seconds"], 3),
        seconds_gloo=round(ranks[0]["gloo"]["seconds"], 3),
    )
    result.update(steps_per_second(ranks, args.steps))
    if args.optimizer != "torch":
        result.update(hardware_estimate(len(ranks[0]["netdam"]["params"]), args))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"DDP on {args.ranks} CPU ranks, {args.steps} steps (mean loss over ranks):")
        print(f"{'step':>4}  {'netdam hook':>14}  {'gloo':>14}  {'abs diff':>10}")
        for step, (a, b) in enumerate(zip(result["loss_netdam"], result["loss_gloo"], strict=True)):
            print(f"{step:>4}  {a:>14.8f}  {b:>14.8f}  {abs(a - b):>10.3g}")
        print(
            f"max abs diff {result['max_abs_diff']:.3g}, max rel diff {result['max_rel_diff']:.3g} over every "
            f"rank and step (tolerance: atol {args.atol:g} + rtol {args.rtol:g}); final parameters differ by "
            f"at most {result['params_max_abs_diff']:.3g}"
        )
        traffic = (
            f"fused: {result['collectives']} NIC collectives (one a step, no DDP all-reduce)"
            if args.optimizer == "pool-fused"
            else f"hook: {result['buckets']} buckets in {result['collectives']} NIC all-reduces"
        )
        print(
            f"replicas identical: netdam {result['netdam_replicas_identical']}, gloo {result['gloo_replicas_identical']}; "
            f"{traffic}, {result['bytes_reduced']} bytes per rank"
        )
        print(
            f"training time: netdam {result['seconds_netdam']:.2f} s, gloo {result['seconds_gloo']:.2f} s; "
            f"cluster start {result['startup_seconds']:.2f} s"
        )
        if result["steps_per_second_netdam"] is not None:
            print(
                f"steps per second after the first (slowest rank): netdam "
                f"{'fused step' if args.optimizer == 'pool-fused' else 'hook'} "
                f"{result['steps_per_second_netdam']:.1f}, gloo {result['steps_per_second_gloo']:.1f} "
                f"(netdam / gloo {result['steps_per_second_ratio']:.2f})"
            )
        if "model_steps_per_second_100g_netdam" in result:
            print(
                f"the same step on 100G hardware (modelled): NetDAM cards "
                f"{result['model_steps_per_second_100g_netdam']:.0f} steps/s, RoCE hosts with "
                f"torch.optim {result['model_steps_per_second_100g_roce']:.0f} steps/s"
            )
        print(
            "OK: losses agree within tolerance"
            if result["ok"]
            else "FAILED: losses or replicas disagree"
        )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
