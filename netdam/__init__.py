"""netdam: an emulator of a NetDAM-style SmartNIC.

The host API follows torch.distributed: ``netdam.init(cluster=FILE, rank=R)``, then
``netdam.all_reduce(buf)``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``barrier`` and
``netdam.empty(...)`` arrays that live in NIC memory. Imported lazily so that ``import
netdam.protocol`` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {
    "init", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "empty",
    "get_rank", "get_world_size", "get_default_group", "destroy_process_group", "ReduceOp", "Work",
    "ProcessGroup",
    "CollectiveError",
}  # fmt: skip
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        from netdam import api

        return getattr(api, name)
    raise AttributeError(f"module 'netdam' has no attribute {name!r}")
