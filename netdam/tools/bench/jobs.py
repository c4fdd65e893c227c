"""``netdam bench allreduce --jobs J``: J jobs' all-reduces on the same NICs at once, against
each job alone, in the same run.

A private cluster of N node processes; each job is its own Python process (``python -m
netdam.tools.bench.jobs``) holding all N ranks of that job (netdam.api, ``job=`` names it: its
own keys, coll_ids and arena on every node), its buffers in NIC memory (``netdam.empty``: no
host staging, so the NICs' sharing is what is measured). A job loops int32 SUM all-reduces in
place for a fixed wall-clock window that starts at the same instant for every job; calls that
end inside the window count. Each call's result is checked exactly (in place, every rank holds
N times the last result, wrapping as int32 does: numpy computes the same; a few ms per 16 MiB
call, inside the window, alone and together alike), every rank bitwise at the end.

Rows:

- ``solo``: job 0 alone, same size, same window: its throughput (algbw, bytes per rank per second);
- ``together``: every job at once: each job's throughput, its share of the solo throughput
  (``fraction_of_solo``) and the sum over jobs against solo (``sum_vs_solo``);
- ``small_behind_large``: job 0 loops the large size while job 1 loops 4 KiB calls: job 1's
  median and p99 call time against its solo median and against job 0's median large call: a
  small call that waited behind the large one would take as long as it. ``nic_seconds_median``
  is the same calls' time in the NICs alone (first node's start to last node's end, from the
  completions), without the host's share of 2 busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from netdam.protocol.payloads import NO_PHASE_US

#: Seconds every job loops in a timed window (solo and together alike).
WINDOW_S = 4.0
#: Bytes per rank of the small job's calls (small_behind_large).
SMALL_BYTES = 4096
#: Seconds from the last worker's "ready" to the common start (the start reaches every worker).
START_DELAY_S = 0.2


def _worker(cluster: str, job: str, nbytes: int, window_s: float) -> dict[str, Any]:
    """One job: all ranks of the cluster in this process, looping all-reduces in the window.
    Says ``ready`` on stdout after its warm-up call, then reads the common start (time.time())
    from stdin."""
    # Here, not at the top: only the worker process loads the host API (and its kernels).
    from netdam import api
    from netdam.cluster.clusterfile import load_cluster

    info = load_cluster(cluster)
    world = len(info.nodes)
    arena = info.nodes[0].memory_bytes // 4  # every job's arena: a quarter of node memory
    groups = [api.ProcessGroup(info, r, job=job, arena_bytes=arena) for r in range(world)]
    try:
        count = nbytes // 4
        bufs = [g.empty(count, np.int32) for g in groups]
        rng = np.random.default_rng(int.from_bytes(job.encode(), "little") % (1 << 31))
        for buf in bufs:
            buf[...] = rng.integers(-1000, 1000, count, dtype=np.int32)
        expected = np.sum(np.stack(bufs), axis=0, dtype=np.int32)
        _all_reduce(api, groups, bufs)  # warm-up: every rank's node runs one of this job's calls
        exact = all(np.array_equal(b, expected) for b in bufs)
        print("ready", flush=True)
        start_at = float(sys.stdin.readline() or 0.0)
        time.sleep(max(0.0, start_at - time.time()))
        times: list[float] = []
        in_nics: list[float] = []
        t_end = time.monotonic() + window_s
        while True:
            t0 = time.monotonic()
            node_s = _all_reduce(api, groups, bufs)
            t1 = time.monotonic()
            if t1 > t_end:
                break
            times.append(t1 - t0)
            if node_s is not None:
                in_nics.append(node_s)
            expected *= np.int32(world)  # in place: every rank held the last result
            exact = exact and np.array_equal(bufs[0], expected)  # ~3 ms per 16 MiB, in the window
            if not exact:
                break
        identical = all(np.array_equal(b, bufs[0]) for b in bufs)
        return {"ok": exact and identical, "job": job, "bytes": nbytes, "calls": len(times),
                "window_s": window_s, "times": times, "nic_times": in_nics,
                "error": None if exact and identical else "a result differs from numpy's"}  # fmt: skip
    finally:
        for g in groups:
            g.close()


def _all_reduce(api: Any, groups: list[Any], bufs: list[np.ndarray]) -> float | None:
    """One call on every rank; the seconds it took in the NICs (from the first node's start to
    the last node's end, by their completions' phases: no host time), None if not reported."""
    works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs, strict=True)]
    for work in works:
        work.wait()
    phases = [w.node_phases for w in works]
    if any(p is None or p.done_us >= NO_PHASE_US for p in phases):
        return None
    return float(max(p.start_ns + 1000 * p.done_us for p in phases) - min(p.start_ns for p in phases)) / 1e9


def _run_jobs(cluster: Path, specs: list[tuple[str, int]], window_s: float, timeout_s: float) -> list[dict[str, Any]]:
    """Run the jobs *specs* ((name, bytes per rank)) at once, each in its own process: every
    one warms up, then all start their window at the same instant."""
    procs = [subprocess.Popen([sys.executable, "-m", "netdam.tools.bench.jobs", "--worker", str(cluster), job,
                               str(nbytes), repr(window_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for job, nbytes in specs]  # fmt: skip
    try:
        for proc in procs:
            assert proc.stdout is not None
            proc.stdout.readline()  # "ready", or "" when it failed (its error is read below)
        start_at = time.time() + START_DELAY_S
        for proc in procs:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(f"{start_at!r}\n")
                proc.stdin.flush()
        results = []
        for proc, (job, _) in zip(procs, specs, strict=True):
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = " | ".join(err.strip().splitlines()[-3:])
                results.append({"ok": False, "job": job, "error": f"job {job} exited {proc.returncode}: {tail}"})
            else:
                results.append(json.loads(lines[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    times = result.get("times") or []
    nbytes = result.get("bytes", 0)
    window = result.get("window_s", WINDOW_S)
    row = {k: result.get(k) for k in ("job", "ok", "error", "bytes", "calls")}
    row["algbw_gbps"] = 8 * nbytes * len(times) / window / 1e9 if times else None
    row["seconds_median"] = float(np.median(times)) if times else None
    row["seconds_p99"] = float(np.percentile(times, 99, method="nearest")) if times else None
    nic = result.get("nic_times") or []
    row["nic_seconds_median"] = float(np.median(nic)) if nic else None  # in the NICs alone
    return row


def run_jobs_bench(nodes: int, nbytes: int, jobs: int, window_s: float = WINDOW_S,
                   timeout_s: float = 600.0) -> tuple[dict[str, Any], int]:  # fmt: skip
    """The three rows (module docstring) on a private cluster of *nodes*; (result, exit code)."""
    # Here, not at the top: `netdam --help` imports this module and need not load the launcher.
    from netdam.cluster.launch import start_cluster

    names = [f"job{j}" for j in range(jobs)]
    # Each job's arena is a quarter of node memory: its resident buffer in the lower half.
    memory = max(64 << 20, 1 << int(np.ceil(np.log2(4 * 2 * nbytes + (1 << 20)))))
    result: dict[str, Any] = {"ok": False, "nodes": nodes, "bytes": nbytes, "jobs": jobs, "window_s": window_s,
                              "node_memory": memory, "dtype": "i32", "op": "sum"}  # fmt: skip
    with start_cluster(nodes, memory=memory) as cluster:
        path = Path(cluster.path)
        solo = _summary(_run_jobs(path, [(names[0], nbytes)], window_s, timeout_s)[0])
        together = [_summary(r) for r in _run_jobs(path, [(n, nbytes) for n in names], window_s, timeout_s)]
        small_solo = _summary(_run_jobs(path, [(names[1 % jobs], SMALL_BYTES)], window_s, timeout_s)[0])
        mixed = [_summary(r) for r in _run_jobs(path, [(names[0], nbytes), (names[1 % jobs], SMALL_BYTES)],
                                                  window_s, timeout_s)]  # fmt: skip
    base = solo["algbw_gbps"] or 0.0
    for row in together:
        row["fraction_of_solo"] = row["algbw_gbps"] / base if base and row["algbw_gbps"] else None
    total = sum(r["algbw_gbps"] or 0.0 for r in together)
    result.update(
        solo=solo, together=together, sum_vs_solo=total / base if base else None,
        small_behind_large={
            "large": mixed[0], "small": mixed[1], "small_solo": small_solo,
            "small_median_vs_solo": (mixed[1]["seconds_median"] / small_solo["seconds_median"]
                                     if mixed[1]["seconds_median"] and small_solo["seconds_median"] else None),
            "small_p99_vs_large_median": (mixed[1]["seconds_p99"] / mixed[0]["seconds_median"]
                                          if mixed[1]["seconds_p99"] and mixed[0]["seconds_median"] else None),
        },
    )  # fmt: skip
    rows = [solo, *together, small_solo, *mixed]
    result["ok"] = all(r["ok"] for r in rows)
    errors = [r["error"] for r in rows if r.get("error")]
    result["error"] = errors[0] if errors else None
    return result, 0 if result["ok"] else 1


def format_jobs_table(result: dict[str, Any]) -> str:
    """The rows as text: throughput per job, alone and together, and the small job's times."""

    def gbps(row: dict[str, Any]) -> str:
        return f"{row['algbw_gbps']:.2f}" if row.get("algbw_gbps") else "-"

    def ms(value: float | None) -> str:
        return f"{value * 1e3:.2f}" if value else "-"

    lines = [f"{result['jobs']} jobs x {result['nodes']} NICs, {result['bytes']} B per rank, "
             f"int32 SUM in place, {result['window_s']:.0f} s windows"]  # fmt: skip
    solo = result["solo"]
    lines.append(f"  solo      {solo['job']}: {gbps(solo)} Gb/s algbw, {solo['calls']} calls, median {ms(solo['seconds_median'])} ms")
    for row in result["together"]:
        share = f"{row['fraction_of_solo']:.0%}" if row.get("fraction_of_solo") else "-"
        lines.append(f"  together  {row['job']}: {gbps(row)} Gb/s ({share} of solo), {row['calls']} calls, "
                     f"median {ms(row['seconds_median'])} ms")  # fmt: skip
    if result.get("sum_vs_solo"):
        lines.append(f"  sum of jobs / solo: {result['sum_vs_solo']:.2f}")
    mix = result["small_behind_large"]
    lines.append(f"  {SMALL_BYTES} B calls beside the large job: median {ms(mix['small']['seconds_median'])} ms, "
                 f"p99 {ms(mix['small']['seconds_p99'])} ms (alone: median {ms(mix['small_solo']['seconds_median'])} ms); "
                 f"large median {ms(mix['large']['seconds_median'])} ms")  # fmt: skip
    lines.append(f"    in the NICs (first node's start to last node's end): small median "
                 f"{ms(mix['small']['nic_seconds_median'])} ms (alone {ms(mix['small_solo']['nic_seconds_median'])} ms), "
                 f"large median {ms(mix['large']['nic_seconds_median'])} ms")  # fmt: skip
    if result.get("error"):
        lines.append(f"  error: {result['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The worker's entry: ``--worker CLUSTER JOB BYTES WINDOW_S``; one JSON line out."""
    parser = argparse.ArgumentParser(prog="python -m netdam.tools.bench.jobs")
    parser.add_argument("--worker", nargs=4, metavar=("CLUSTER", "JOB", "BYTES", "WINDOW_S"), required=True)
    args = parser.parse_args(argv)
    cluster, job, nbytes, window_s = args.worker
    print(json.dumps(_worker(cluster, job, int(nbytes), float(window_s))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
