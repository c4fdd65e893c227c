"""Two process groups at once, then a node killed and the survivors going on without it.

    python examples/groups_and_shrink.py [--json]

Starts 4 NICs (a node process each) and drives all 4 ranks from this process, as 4 hosts
would (each rank's calls are started before any is waited on):

1. ``new_group`` makes the even ranks (0, 2) and the odd ranks (1, 3) into groups; each group
   all-reduces its own data while the other does, and both results are checked against numpy.
2. Node 3 is killed (SIGKILL) in the middle of an all-reduce of all 4 ranks (stopped with
   SIGSTOP before the call, so the call cannot end before the kill): every surviving rank's
   call raises within the watchdog (1 s here) naming rank 3 and its address.
3. Every survivor calls ``shrink()``: the group of the ranks whose nodes still answer. The next
   all-reduce on it is exact.

Exit 0 when every step held, 1 otherwise, 3 when the cluster did not start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from netdam import api
from netdam.cluster.launch import ClusterStartError, start_cluster

WORLD = 4
WATCHDOG_S = 1.0


def two_groups_at_once(ranks: list[api.ProcessGroup]) -> dict[str, Any]:
    """Step 1: evens and odds, each all-reducing while the other does."""
    made = {r: ranks[r].new_group([0, 2] if r % 2 == 0 else [1, 3]) for r in range(WORLD)}
    data = {r: np.arange(100_000, dtype=np.float32) * (r + 1) for r in range(WORLD)}
    works = [api.all_reduce(data[r], group=made[r], async_op=True) for r in range(WORLD)]  # type: ignore[arg-type]  # every rank of this process is a member: no NON_GROUP_MEMBER here
    for work in works:
        work.wait()  # type: ignore[union-attr]  # async_op=True: a Work, never None
    base = np.arange(100_000, dtype=np.float32)
    evens_ok = all(
        np.array_equal(data[r], base * 4) for r in (0, 2)
    )  # ranks 0 and 2 hold 1x and 3x
    odds_ok = all(np.array_equal(data[r], base * 6) for r in (1, 3))  # 2x and 4x
    return {"evens_exact": evens_ok, "odds_exact": odds_ok}


def kill_mid_collective(ranks: list[api.ProcessGroup], pid: int) -> dict[str, Any]:
    """Step 2: the last rank's node dies during an all-reduce; when each survivor hears, and what."""
    world = len(ranks)
    buffers = [np.full(2 << 20, r + 1, np.float32) for r in range(world)]  # 8 MiB
    # Stopped before the call, killed after it: the all-reduce is in flight at the kill however
    # late this thread runs (on a busy machine it once finished before a kill sent right after
    # the call, and there was nothing left to fail).
    os.kill(pid, signal.SIGSTOP)
    works = [api.all_reduce(b, group=g, async_op=True) for b, g in zip(buffers, ranks)]
    heard: dict[int, tuple[float, str]] = {}

    def survivor(rank: int) -> None:
        try:
            works[rank].wait()  # type: ignore[union-attr]  # async_op=True: a Work, never None
            heard[rank] = (time.monotonic(), "completed (the kill came too late)")
        except api.CollectiveError as exc:
            heard[rank] = (time.monotonic(), str(exc))

    threads = [threading.Thread(target=survivor, args=(r,)) for r in range(world - 1)]
    for thread in threads:
        thread.start()
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(30.0)
    return {
        rank: {"seconds": round(at - killed_at, 3), "error": text}
        for rank, (at, text) in sorted(heard.items())
    }


def shrink_and_go_on(ranks: list[api.ProcessGroup]) -> dict[str, Any]:
    """Step 3: the survivors' group, and an exact all-reduce on it."""
    survivors = len(ranks) - 1
    shrunk: list[api.ProcessGroup] = [ranks[0]] * survivors
    # Every survivor shrinks at once, as separate hosts would (each waits ~0.25 s on the dead).

    def shrink(rank: int) -> None:
        shrunk[rank] = ranks[rank].shrink()

    threads = [threading.Thread(target=shrink, args=(r,)) for r in range(survivors)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    data = [np.full(1000, r + 1, np.int64) for r in range(survivors)]
    works = [api.all_reduce(x, group=g, async_op=True) for x, g in zip(data, shrunk)]
    for work in works:
        work.wait()  # type: ignore[union-attr]  # async_op=True: a Work, never None
    total = survivors * (survivors + 1) // 2
    return {
        "members": list(shrunk[0].members),
        "exact": all(x.tolist() == [total] * 1000 for x in data),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"ok": False}
    try:
        cluster = start_cluster(WORLD, memory=64 << 20, nics_per_process=1)
    except ClusterStartError as exc:
        print(
            json.dumps({"ok": False, "error": str(exc)})
            if args.json
            else f"cluster did not start: {exc}"
        )
        return 3
    with cluster:
        ranks = [api.ProcessGroup(cluster.info, r, timeout_s=WATCHDOG_S) for r in range(WORLD)]
        try:
            result["groups"] = two_groups_at_once(ranks)
            dead = cluster.info.nodes[WORLD - 1]
            result["kill"] = kill_mid_collective(ranks, dead.pid)
            result["shrink"] = shrink_and_go_on(ranks)
        finally:
            for group in ranks:
                group.close()
    named = f"rank {WORLD - 1} ({dead.address}:{dead.port})"
    kill = result["kill"]
    result["ok"] = bool(
        result["groups"]["evens_exact"]
        and result["groups"]["odds_exact"]
        and sorted(kill) == list(range(WORLD - 1))
        and all(named in v["error"] for v in kill.values())
        and result["shrink"]["members"] == list(range(WORLD - 1))
        and result["shrink"]["exact"]
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"two groups at once: evens exact {result['groups']['evens_exact']}, odds exact {result['groups']['odds_exact']}"
        )
        for rank, v in kill.items():
            print(f"rank {rank} heard {v['seconds']:.2f} s after the kill: {v['error']}")
        print(
            f"shrunk to ranks {result['shrink']['members']}: next all-reduce exact {result['shrink']['exact']}"
        )
        print("OK" if result["ok"] else "FAILED")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
