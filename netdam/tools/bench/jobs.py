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
import select
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


class _Job:
    """One job's ranks, all in the worker process, and its NIC-resident buffers by size."""

    def __init__(self, cluster: str, job: str) -> None:
        # Here, not at the top: only the worker process loads the host API (and its kernels).
        from netdam import api
        from netdam.cluster.clusterfile import load_cluster

        self.api, self.job = api, job
        info = load_cluster(cluster)
        self.world = len(info.nodes)
        arena = info.nodes[0].memory_bytes // 4  # every job's arena: a quarter of node memory
        self.groups = [
            api.ProcessGroup(info, r, job=job, arena_bytes=arena) for r in range(self.world)
        ]
        self.rng = np.random.default_rng(int.from_bytes(job.encode(), "little") % (1 << 31))
        #: bytes -> (each rank's buffer, what every rank holds after the last call)
        self.held: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}

    def prepare(self, nbytes: int) -> bool:
        """Buffers of *nbytes* per rank (made once) and one untimed call; exact?"""
        if nbytes not in self.held:
            bufs = [g.empty(nbytes // 4, np.int32) for g in self.groups]
            for buf in bufs:
                buf[...] = self.rng.integers(-1000, 1000, buf.size, dtype=np.int32)
            self.held[nbytes] = (bufs, np.asarray(np.sum(np.stack(bufs), axis=0, dtype=np.int32)))
        else:
            self.held[nbytes][1][...] *= np.int32(self.world)
        bufs, expected = self.held[nbytes]
        _all_reduce(self.api, self.groups, bufs)  # warm-up: every rank's node runs one call
        return all(np.array_equal(b, expected) for b in bufs)

    def loop(self, nbytes: int, window_s: float, exact: bool) -> dict[str, Any]:
        """Calls of *nbytes* back to back for *window_s* seconds, each checked."""
        bufs, expected = self.held[nbytes]
        times: list[float] = []
        in_nics: list[float] = []
        t_end = time.monotonic() + window_s
        while exact:
            t0 = time.monotonic()
            node_s = _all_reduce(self.api, self.groups, bufs)
            t1 = time.monotonic()
            expected *= np.int32(self.world)  # in place: every rank held the last result
            exact = np.array_equal(bufs[0], expected)  # ~3 ms per 16 MiB, in the window
            if t1 > t_end:
                break
            times.append(t1 - t0)
            if node_s is not None:
                in_nics.append(node_s)
        identical = all(np.array_equal(b, bufs[0]) for b in bufs)
        return {
            "ok": exact and identical,
            "job": self.job,
            "bytes": nbytes,
            "calls": len(times),
            "window_s": window_s,
            "times": times,
            "nic_times": in_nics,
            "error": None if exact and identical else "a result differs from numpy's",
        }

    def close(self) -> None:
        for g in self.groups:
            g.close()


def _serve_job(cluster: str, job: str) -> None:
    """The worker: per line ``BYTES WINDOW_S`` on stdin, prepare and say ``ready``, read the
    common start (time.time()), loop the window, print one JSON line; until stdin ends."""
    runner = _Job(cluster, job)
    print("up", flush=True)  # its arenas are placed: the next job may claim its own
    try:
        for line in sys.stdin:
            nbytes, window_s = int(line.split()[0]), float(line.split()[1])
            exact = runner.prepare(nbytes)
            print("ready", flush=True)
            start_at = float(sys.stdin.readline() or 0.0)
            time.sleep(max(0.0, start_at - time.time()))
            print(json.dumps(runner.loop(nbytes, window_s, exact)), flush=True)
    finally:
        runner.close()


def _all_reduce(api: Any, groups: list[Any], bufs: list[np.ndarray]) -> float | None:
    """One call on every rank; the seconds it took in the NICs (from the first node's start to
    the last node's end, by their completions' phases: no host time), None if not reported."""
    works = [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, bufs, strict=True)]
    for work in works:
        work.wait()
    phases = [w.node_phases for w in works]
    if any(p is None or p.done_us >= NO_PHASE_US for p in phases):
        return None
    return (
        float(max(p.start_ns + 1000 * p.done_us for p in phases) - min(p.start_ns for p in phases))
        / 1e9
    )


class _Workers:
    """One worker process per job, kept for every phase (each starts in ~2 s: Python, netdam,
    the kernels from the cache, the job's ranks)."""

    def __init__(self, cluster: Path, jobs: list[str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.procs: dict[str, subprocess.Popen[str]] = {}
        for job in jobs:
            self.procs[job] = subprocess.Popen(
                [sys.executable, "-m", "netdam.tools.bench.jobs", "--worker", str(cluster), job],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            # One job at a time claims its arenas: two claiming at once can land at different
            # addresses on different nodes (first fit in another order), and a chain's operand
            # address is the same at every hop (CI: 2 of 7 runs failed OUT_OF_BOUNDS).
            self._hear(job)  # "up"

    def phase(self, specs: list[tuple[str, int]], window_s: float) -> list[dict[str, Any]]:
        """Jobs *specs* ((name, bytes per rank)) at once: each prepares, then all start their
        window at the same instant."""
        for job, nbytes in specs:
            self._say(job, f"{nbytes} {window_s!r}")
        for job, _ in specs:
            self._hear(job)  # "ready"
        start_at = time.time() + START_DELAY_S
        for job, _ in specs:
            self._say(job, repr(start_at))
        results = []
        for job, _ in specs:
            line = self._hear(job)
            results.append(
                json.loads(line)
                if line.startswith("{")
                else {"ok": False, "job": job, "error": self._died(job)}
            )
        return results

    def _say(self, job: str, line: str) -> None:
        stdin = self.procs[job].stdin
        assert stdin is not None
        with contextlib.suppress(BrokenPipeError):
            stdin.write(line + "\n")
            stdin.flush()

    def _hear(self, job: str) -> str:
        stdout = self.procs[job].stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], self.timeout_s)
        return stdout.readline().strip() if ready else ""

    def _died(self, job: str) -> str:
        proc = self.procs[job]
        if proc.poll() is None:
            return f"job {job} did not answer within {self.timeout_s:g} s"
        err = proc.stderr.read() if proc.stderr is not None else ""
        return f"job {job} exited {proc.returncode}: " + " | ".join(err.strip().splitlines()[-3:])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
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


def run_jobs_bench(
    nodes: int, nbytes: int, jobs: int, window_s: float = WINDOW_S, timeout_s: float = 600.0
) -> tuple[dict[str, Any], int]:
    """The three rows (module docstring) on a private cluster of *nodes*; (result, exit code)."""
    # Here, not at the top: `netdam --help` imports this module and need not load the launcher.
    from netdam.cluster.launch import start_cluster

    names = [f"job{j}" for j in range(jobs)]
    # Each job's arena is a quarter of node memory: its resident buffer in the lower half.
    memory = max(64 << 20, 1 << int(np.ceil(np.log2(4 * 2 * nbytes + (1 << 20)))))
    result: dict[str, Any] = {
        "ok": False,
        "nodes": nodes,
        "bytes": nbytes,
        "jobs": jobs,
        "window_s": window_s,
        "node_memory": memory,
        "dtype": "i32",
        "op": "sum",
    }
    with start_cluster(nodes, memory=memory) as cluster:
        workers = _Workers(Path(cluster.path), names, timeout_s)
        try:
            solo = _summary(workers.phase([(names[0], nbytes)], window_s)[0])
            together = [_summary(r) for r in workers.phase([(n, nbytes) for n in names], window_s)]
            small_solo = _summary(workers.phase([(names[1], SMALL_BYTES)], window_s)[0])
            mixed = [
                _summary(r)
                for r in workers.phase([(names[0], nbytes), (names[1], SMALL_BYTES)], window_s)
            ]
        finally:
            workers.close()
    base = solo["algbw_gbps"] or 0.0
    for row in together:
        row["fraction_of_solo"] = row["algbw_gbps"] / base if base and row["algbw_gbps"] else None
    total = sum(r["algbw_gbps"] or 0.0 for r in together)
    result.update(
        solo=solo,
        together=together,
        sum_vs_solo=total / base if base else None,
        small_behind_large={
            "large": mixed[0],
            "small": mixed[1],
            "small_solo": small_solo,
            "small_median_vs_solo": (
                mixed[1]["seconds_median"] / small_solo["seconds_median"]
                if mixed[1]["seconds_median"] and small_solo["seconds_median"]
                else None
            ),
            "small_p99_vs_large_median": (
                mixed[1]["seconds_p99"] / mixed[0]["seconds_median"]
                if mixed[1]["seconds_p99"] and mixed[0]["seconds_median"]
                else None
            ),
        },
    )
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

    lines = [
        f"{result['jobs']} jobs x {result['nodes']} NICs, {result['bytes']} B per rank, "
        f"int32 SUM in place, {result['window_s']:.0f} s windows"
    ]
    solo = result["solo"]
    lines.append(
        f"  solo      {solo['job']}: {gbps(solo)} Gb/s algbw, {solo['calls']} calls, median {ms(solo['seconds_median'])} ms"
    )
    for row in result["together"]:
        share = f"{row['fraction_of_solo']:.0%}" if row.get("fraction_of_solo") else "-"
        lines.append(
            f"  together  {row['job']}: {gbps(row)} Gb/s ({share} of solo), {row['calls']} calls, "
            f"median {ms(row['seconds_median'])} ms"
        )
    if result.get("sum_vs_solo"):
        lines.append(f"  sum of jobs / solo: {result['sum_vs_solo']:.2f}")
    mix = result["small_behind_large"]
    lines.append(
        f"  {SMALL_BYTES} B calls beside the large job: median {ms(mix['small']['seconds_median'])} ms, "
        f"p99 {ms(mix['small']['seconds_p99'])} ms (alone: median {ms(mix['small_solo']['seconds_median'])} ms); "
        f"large median {ms(mix['large']['seconds_median'])} ms"
    )
    lines.append(
        f"    in the NICs (first node's start to last node's end): small median "
        f"{ms(mix['small']['nic_seconds_median'])} ms (alone {ms(mix['small_solo']['nic_seconds_median'])} ms), "
        f"large median {ms(mix['large']['nic_seconds_median'])} ms"
    )
    if result.get("error"):
        lines.append(f"  error: {result['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The worker's entry: ``--worker CLUSTER JOB``, then phases on stdin (_serve_job)."""
    parser = argparse.ArgumentParser(prog="python -m netdam.tools.bench.jobs")
    parser.add_argument("--worker", nargs=2, metavar=("CLUSTER", "JOB"), required=True)
    args = parser.parse_args(argv)
    _serve_job(*args.worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
