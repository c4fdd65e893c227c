"""PyTorch DDP communication hook: gradient buckets all-reduced by the emulated NICs.

```python
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from netdam.clients.ddp import NetdamHookState, netdam_allreduce_hook

dist.init_process_group("gloo", rank=rank, world_size=world)   # still needed, see below
model = DDP(net)
state = NetdamHookState(cluster="cluster.toml", rank=rank, world_size=world)
model.register_comm_hook(state, netdam_allreduce_hook)
...                                    # train as usual; state.close() at the end
```

One DDP rank per netdam node: rank r of the torch process group drives node r of the cluster
file (the ranks must match, and so must the world sizes; checked). **The DDP process group
itself still needs Gloo**: DDP broadcasts the initial parameters (and buffers) and verifies the
model across ranks through it; only the gradient all-reduce goes through netdam.

For every bucket the rank copies the flattened gradient into a buffer that lives in its node's
memory (``ProcessGroup.empty``: the api all-reduces it where it lies, with no staging copy of
its own; the one copy in is the host store a real NetDAM host makes over CXL/PCIe), runs the
chained all-reduce in the NICs, and writes the result back into the bucket, divided by the world
size when ``average`` (DDP's default semantics). A bucket larger than the buffer goes in chunks
of ``chunk_bytes``, one collective each, in the same order on every rank.

The all-reduce runs on one worker thread per state, so backward keeps computing while the NICs
reduce, and buckets go out in the order DDP hands them over (the same order on every rank, as
the NICs require). The hook returns a ``torch.futures.Future`` that the worker completes with
the bucket, or with the exception (``netdam.api.CollectiveError`` for a failed collective);
after a failure every later bucket of that state fails at once, since the ranks are out of step.

Dtypes: float32 and float64 are reduced as they are; float16 and bfloat16 too, at 2 bytes an
element on the wire (the NICs add both natively, rounding at every hop as Gloo does; bf16 by
PyTorch's own rule, SPEC.md 2.4). Results are bitwise identical on every rank (one chain order),
but not bitwise Gloo's: Gloo sums in another order and DDP without a hook scales each gradient
by 1/world before the sum, this hook divides the sum.

CPU tensors only: the emulated NIC memory is host shared memory.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real
# dist.GradBucket and Future[Tensor] objects (DistributedDataParallel._check_comm_hook).
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "netdam.clients.ddp needs PyTorch: pip install torch==2.13.0 (the CPU build on the "
        "project's machines; from a netdam checkout pip install '.[torch]' pins it; elsewhere install PyTorch's CPU wheel first: an unpinned "
        "`pip install torch` on Linux pulls a CUDA build of several GB)"
    ) from exc

from netdam.api import CollectiveError, ProcessGroup, bfloat16
from netdam.api import all_reduce as _api_all_reduce
from netdam.cluster.clusterfile import ClusterFile, load_cluster

__all__ = ["DEFAULT_CHUNK_BYTES", "NetdamHookState", "netdam_allreduce_hook"]

#: Largest piece of a bucket in one collective (DDP's default bucket is 25 MiB).
DEFAULT_CHUNK_BYTES = 8 << 20

_NATIVE: dict[torch.dtype, np.dtype[Any]] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: bfloat16,
}


class NetdamHookState:
    """What ``netdam_allreduce_hook`` needs on one DDP rank: its netdam group, a chunk buffer in
    its node's memory, and the worker thread.

    Pass either ``cluster`` (a cluster file path or a ``ClusterFile``) and ``rank``, or an
    existing ``group`` (e.g. the one ``netdam.init`` returned: a rank must not drive its node
    through two ProcessGroups, their epochs would collide). ``world_size`` is checked against
    the cluster and, when torch.distributed is initialised, rank and world size against it.
    ``chunk_bytes`` must be the same on every rank. ``asynchronous=False`` runs the all-reduce
    inside the hook (on the autograd thread) and returns a completed future.

    ``epoch_base`` (the same on every rank) is where this group's collective epochs start. A
    node takes a START_COLL with the (coll_id, epoch) of the collective it ran last for a retry
    and answers the old completion without reducing, so a fresh group starting at epoch 1 on a
    node whose last collective was epoch 1 would silently get its own input back. When this
    state opens its own group and torch.distributed is initialised, rank 0 picks a base from
    the clock (milliseconds, so later programs start above earlier ones) and broadcasts it over
    Gloo; otherwise the group keeps its own numbering unless ``epoch_base`` is given.
    """

    def __init__(
        self,
        cluster: str | Path | ClusterFile | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        group: ProcessGroup | None = None,
        average: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
        asynchronous: bool = True,
        epoch_base: int | None = None,
    ) -> None:
        if group is None:
            if cluster is None or rank is None:
                raise ValueError("NetdamHookState needs cluster= and rank=, or group=")
            info = cluster if isinstance(cluster, ClusterFile) else load_cluster(cluster)
            group = ProcessGroup(info, rank, timeout_s=timeout)
            self._owns_group = True
        else:
            if rank is not None and rank != group.rank:
                raise ValueError(f"rank={rank} but the netdam group is rank {group.rank}")
            self._owns_group = False
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.average = average
        self.asynchronous = asynchronous
        try:
            if world_size is not None and world_size != self.world_size:
                raise ValueError(
                    f"world_size={world_size} but the netdam cluster has {self.world_size} nodes: "
                    "run one DDP rank per node"
                )
            if dist.is_available() and dist.is_initialized():
                t_rank, t_world = dist.get_rank(), dist.get_world_size()
                if (t_rank, t_world) != (self.rank, self.world_size):
                    raise ValueError(
                        f"torch.distributed rank {t_rank} of {t_world} must drive netdam node "
                        f"{t_rank} of {t_world}, got node {self.rank} of {self.world_size}"
                    )
            if (
                epoch_base is None
                and self._owns_group
                and dist.is_available()
                and dist.is_initialized()
            ):
                pick = [int(time.time() * 1000) % (1 << 31) if self.rank == 0 else 0]
                dist.broadcast_object_list(pick, src=0)
                epoch_base = int(pick[0])
            if epoch_base is not None:
                if not 0 <= epoch_base < 1 << 31:
                    raise ValueError(f"epoch_base must be in [0, 2**31), got {epoch_base}")
                group.epoch = epoch_base
            limit = max(
                64, group.arena_size // 4 // 64 * 64
            )  # half the arena's netdam.empty room: the rest is the user's
            self.chunk_bytes = min(int(chunk_bytes), limit) // 64 * 64
            if self.chunk_bytes < 64:
                raise ValueError(f"chunk_bytes must be at least 64, got {chunk_bytes}")
            #: The chunk buffer, in the node's memory: collectives on it need no staging copy.
            self._nic = group.empty(self.chunk_bytes, np.uint8)
        except BaseException:
            self.close()
            raise
        #: Counters: buckets reduced, collectives run (chunks), bytes reduced.
        self.buckets = 0
        self.collectives = 0
        self.bytes = 0
        self._failure: BaseException | None = None
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------------ the reduction

    def reduce_(self, flat: torch.Tensor, index: int = 0) -> torch.Tensor:
        """All-reduce the 1-D CPU tensor *flat* in place through the NICs (average if asked);
        returns it. Blocking; every rank must call it with the same sizes in the same order."""
        if self._failure is not None:
            raise CollectiveError(
                f"rank {self.rank}: not reducing bucket {index}: an earlier netdam "
                f"all-reduce failed ({self._failure}); the ranks are out of step"
            ) from self._failure
        if flat.device.type != "cpu":
            raise TypeError(
                f"netdam.clients.ddp reduces CPU tensors only (NIC memory is host shared "
                f"memory), got a bucket on {flat.device}"
            )
        if flat.dtype not in _NATIVE:
            raise TypeError(
                f"netdam.clients.ddp cannot reduce {flat.dtype} gradients: use float32, float64, "
                "float16 or bfloat16"
            )
        work = flat.view(-1) if flat.is_contiguous() else flat.contiguous().view(-1)
        np_dtype = _NATIVE[flat.dtype]
        per = self.chunk_bytes // np_dtype.itemsize
        nic_np = self._nic.view(np_dtype)
        # torch.from_numpy knows no bfloat16 (numpy has none): the same bytes as int16, viewed.
        nic = (
            torch.from_numpy(nic_np)
            if flat.dtype != torch.bfloat16
            else torch.from_numpy(self._nic.view(np.int16)).view(torch.bfloat16)
        )
        total = work.numel()
        chunks = -(-total // per)
        for k in range(chunks):
            lo, hi = k * per, min(total, (k + 1) * per)
            n = hi - lo
            nic[:n].copy_(work[lo:hi])  # host store into NIC memory
            try:
                _api_all_reduce(nic_np[:n], group=self.group)
            except BaseException as exc:
                self._failure = exc
                waiting = exc.waiting_for if isinstance(exc, CollectiveError) else None
                raise CollectiveError(
                    f"netdam all-reduce of DDP bucket {index} failed on rank {self.rank} "
                    f"(chunk {k + 1} of {chunks}, {n} x {flat.dtype}): {exc}",
                    waiting,
                ) from exc
            if self.average:
                torch.div(nic[:n], self.world_size, out=work[lo:hi])
            else:
                work[lo:hi].copy_(nic[:n])
            self.collectives += 1
        if work.data_ptr() != flat.data_ptr():
            flat.copy_(work.view_as(flat))
        self.buckets += 1
        self.bytes += total * np_dtype.itemsize
        return flat

    def submit(self, flat: torch.Tensor, index: int = 0) -> torch.futures.Future[torch.Tensor]:
        """Reduce *flat* (on the worker thread unless ``asynchronous=False``); the future holds
        *flat* afterwards, or the exception (``wait()`` raises it as it is, e.g. CollectiveError)."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def job() -> None:
            try:
                result = self.reduce_(flat, index)
            except BaseException as exc:  # the future must complete, or DDP waits forever
                error = (
                    exc
                    if isinstance(exc, Exception)
                    else RuntimeError(f"netdam all-reduce interrupted: {exc!r}")
                )
                fut.set_exception(error)  # type: ignore[arg-type]  # torch types it as T
            else:
                fut.set_result(result)

        if not self.asynchronous:
            job()
            return fut
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._serve, name=f"netdam-ddp-rank{self.rank}", daemon=True
            )
            self._worker.start()
        self._jobs.put(job)
        return fut

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Finish queued buckets, stop the worker, close the netdam group if this state opened it."""
        worker = getattr(self, "_worker", None)
        if worker is not None:
            self._jobs.put(None)
            worker.join()
            self._worker = None
        if getattr(self, "_owns_group", False):
            self.group.close()
            self._owns_group = False

    def __enter__(self) -> "NetdamHookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def netdam_allreduce_hook(
    state: NetdamHookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # defined only when dist.is_available()
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce *bucket* in the emulated NICs (sum, then divide by the
    world size when ``state.average``). Register with
    ``ddp_model.register_comm_hook(state, netdam_allreduce_hook)``.

    On failure the future holds a RuntimeError quoting the CollectiveError (DDP's reducer
    reads the value from C++, where only an error set by a callback reads as an error; a bare
    ``set_exception`` would surface as "Unable to cast ... to Tensor")."""
    return state.submit(bucket.buffer(), bucket.index()).then(_value)


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()  # raises the worker's exception inside the callback
