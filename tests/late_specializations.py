"""Run as a script by test_ready.py, in a fresh interpreter: warm the kernels as a launcher does,
then drive node and switch cores through every opcode and status (the fuzzer's seeded worlds)
and collectives of every dtype on the in-memory fabric, and print, as JSON, each kernel that
needed a new specialization after the warm-up. A node or switch process meeting such a kernel
compiles it while its peers wait (a first REGISTER from the switch timed out that way, issue 23).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

import numpy as np

import netdam.kernels
from netdam.cluster.launch import warm_node_kernels, warm_switch_kernels

#: Kernels the tests above call directly from Python (no process does): their specializations
#: for the tests' argument types are no sign of a late compile in a node.
CALLED_BY_TESTS = {"datapath._requester_key"}  # test_node's duplicate-window set test


def dispatchers() -> dict[str, object]:
    from numba.core.registry import CPUDispatcher

    found = {}
    for info in pkgutil.iter_modules(netdam.kernels.__path__):
        module = importlib.import_module(f"netdam.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def main() -> int:
    warm_node_kernels(force=True)  # into this process, as a launcher with a cold cache does
    warm_switch_kernels(force=True)
    kernels = dispatchers()
    before = {name: len(d.overloads) for name, d in kernels.items()}

    import inspect

    # The test modules it drives live in tests/core and tests/tools (this script runs with
    # tests/ as its working directory and first sys.path entry).
    here = Path(__file__).resolve().parent
    sys.path[1:1] = [str(here / "core"), str(here / "tools")]
    import helpers
    import test_collectives as tc
    import test_fuzz as tf
    import test_node

    from netdam.tools.fuzz.generator import DatagramGenerator

    for make in (tf.node_world, tf.switch_world):
        world = make()
        for datagram in DatagramGenerator(world.layout, 11).batch(2000):
            world.send(datagram.data, datagram.dst)
    # Every test of the node core that needs no more than a cluster: authorised control opcodes
    # (REGISTER, DEREGISTER, JOIN, COUNTERS) over the wire, which the fuzzer, holding no admin
    # key, never gets past the key check.
    for name, test in vars(test_node).items():
        if name.startswith("test_") and callable(test):
            params = list(inspect.signature(test).parameters)
            if params in ([], ["cluster"]):
                try:
                    test(*[helpers.make_cluster() for _ in params])
                except Exception as exc:  # noqa: BLE001 - only the kernels' types matter here
                    print(f"{name}: {exc!r}", file=sys.stderr)
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float16, np.float64, np.int32, np.int64):
        inputs = [(rng.standard_normal(3000) * 8).astype(dtype) for _ in range(3)]
        tc.run(3, inputs, multicast=True)
        tc.run(3, inputs)
    late = sorted(
        name
        for name, d in kernels.items()
        if len(d.overloads) > before[name] and name not in CALLED_BY_TESTS
    )
    print(json.dumps(late))
    return 0


if __name__ == "__main__":
    sys.exit(main())
