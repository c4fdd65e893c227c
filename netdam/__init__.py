"""netdam: an emulator of a NetDAM-style SmartNIC.

The host API follows torch.distributed: ``netdam.init(cluster=FILE, rank=R)``, then
``netdam.all_reduce(buf)``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``barrier`` and
``netdam.empty(...)`` arrays that live in NIC memory. Imported lazily so that ``import
netdam.protocol`` stays light.
"""

from __future__ import annotations

import os
from typing import Any

# In a source checkout protocol/, switch/ and fpga_model/ sit beside netdam/ (pyproject maps them
# in as netdam.protocol, netdam.switch and netdam.fpga_model only at install). Code run from the
# checkout, where `python -m` and `python -c` put the checkout first on sys.path, must still see
# the whole package, so the checkout's root joins this package's path. An installed copy has no
# protocol/SPEC.md beside it and is left as it is.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_CHECKOUT, "protocol", "SPEC.md")) and os.path.isfile(
    os.path.join(_CHECKOUT, "pyproject.toml")
):
    __path__.append(_CHECKOUT)

__version__ = "0.1.0"

_API = {
    "init",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "barrier",
    "empty",
    "get_rank",
    "get_world_size",
    "get_default_group",
    "destroy_process_group",
    "ReduceOp",
    "Work",
    "ProcessGroup",
    "init_process_group",
    "is_initialized",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "bfloat16",
    "new_group",
    "NON_GROUP_MEMBER",
    "CollectiveError",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        from netdam import api

        return getattr(api, name)
    raise AttributeError(f"module 'netdam' has no attribute {name!r}")
