"""Where the tools' worker processes start from: the feeders, relays and sinks of `bench
datapath`, the generators of `bench pool`, the senders of `flood` and the clients of `soak`.

Each worker runs its hot loop in a kernel, so a worker started by "spawn" imported numba and
loaded its kernels before it could report ready: ~1.5-2 s of CPU each, four at once for `bench
datapath` (6.2 s of start-up on 2 cores). They start from a fork server instead, a clean
interpreter (nothing of the tool's process is inherited, as with spawn) that imports the
workers' modules, and with them numba and the kernels, once; each worker is a fork of it.
Where fork servers do not exist, workers are spawned as before.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkServerContext, SpawnContext

#: The modules whose functions the workers run. The fork server imports them all once: the
#: first tool a process runs starts it, and a later tool in the same process (the test suite)
#: finds its own module already loaded there.
WORKER_MODULES = (
    "netdam.tools.bench.datapath",
    "netdam.tools.bench.pool",
    "netdam.tools.flood",
    "netdam.tools.soak.client",
)


def worker_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context the tools start their workers from (the module's docstring)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_MODULES))
    return ctx
