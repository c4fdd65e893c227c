"""``netdam bench pool --async``: K asyncio pool clients in one event loop, as an asyncio program
would use the pool (``netdam.clients.async_pool.AsyncPoolClient``, asyncio-dgram).

A pool (``nodes`` node processes and the switch, as ``netdam up --switch`` starts them) and one
interleaved region; ``clients`` AsyncPoolClients in this process's event loop, each with one
request in flight on its own slice of the region (so ``clients`` requests in flight in all).
First every client WRITEs a known pattern into each of its slots (not timed), then the phases
``write_64``, ``read_64``, ``write_4096``, ``read_4096`` run ``seconds`` each after
``warmup``; every READ is compared with the pattern of its slot (``mismatches``), and writes
rewrite the same pattern, so a READ that raced a WRITE still sees the right bytes. Per phase:
ops/s, p50/p99 latency (each request, from the coroutine's send to its reply), timeouts.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netdam.clients.pool import PoolError, PoolTimeout
from netdam.tools.bench.report import machine_info, phase_table

#: The phases, in order: (name, operation, bytes per request).
PHASES = (
    ("write_64", "write", 64),
    ("read_64", "read", 64),
    ("write_4096", "write", 4096),
    ("read_4096", "read", 4096),
)
MAX_CLIENTS = 256


@dataclass(frozen=True)
class AsyncPoolBenchConfig:
    clients: int = 8
    seconds: float = 2.0
    warmup: float = 0.5
    nodes: int = 2
    interleave: int = 8192
    #: Bytes of region per client (slots of 4096 bytes).
    slice_bytes: int = 64 << 10


def _pattern(client: int, slot: int, size: int) -> bytes:
    """What slot *slot* of client *client* holds (its first *size* bytes): distinct per slot."""
    seed = (client * 1_000_003 + slot * 7919) & 0xFFFFFFFF
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@dataclass
class _Tally:
    ops: int = 0
    timeouts: int = 0
    errors: int = 0
    mismatches: int = 0


async def _client_phase(
    pool: Any,
    client: int,
    base: int,
    slots: int,
    rkey: int,
    op: str,
    size: int,
    t_start: float,
    t_end: float,
    lat_us: list[float],
    tally: _Tally,
) -> None:
    """One client: requests back to back until *t_end*; counted and timed from *t_start* on."""
    slot = 0
    while True:
        now = time.monotonic()
        if now >= t_end:
            return
        addr = base + slot * 4096
        expected = _pattern(client, slot, size)
        try:
            if op == "write":
                await pool.write(addr, expected, rkey)
            else:
                got = await pool.read(addr, size, rkey)
                if got != expected:
                    tally.mismatches += 1
        except PoolTimeout:
            tally.timeouts += 1
            continue
        except PoolError:  # a NACK: counted, the run fails
            tally.errors += 1
            continue
        done = time.monotonic()
        if now >= t_start:
            tally.ops += 1
            lat_us.append((done - now) * 1e6)
        slot = (slot + 1) % slots


async def _run(
    cfg: AsyncPoolBenchConfig, vip: tuple[str, int], gaddr: int, rkey: int, tag_key: bytes
) -> dict[str, Any]:
    # Imported here: asyncio-dgram, loaded only by the asyncio benchmark.
    from netdam.clients.async_pool import AsyncPoolClient

    slots = cfg.slice_bytes // 4096
    pools = [
        await AsyncPoolClient.open(vip, window=1, tag_keys={rkey: tag_key})
        for _ in range(cfg.clients)
    ]
    try:
        # The patterns every READ is checked against, written once (not timed).
        await asyncio.gather(
            *(
                pools[c].write(gaddr + c * cfg.slice_bytes + s * 4096, _pattern(c, s, 4096), rkey)
                for c in range(cfg.clients)
                for s in range(slots)
            )
        )
        results: dict[str, Any] = {}
        for name, op, size in PHASES:
            t_start = time.monotonic() + cfg.warmup
            t_end = t_start + cfg.seconds
            lat: list[float] = []
            tally = _Tally()
            await asyncio.gather(
                *(
                    _client_phase(
                        pools[c],
                        c,
                        gaddr + c * cfg.slice_bytes,
                        slots,
                        rkey,
                        op,
                        size,
                        t_start,
                        t_end,
                        lat,
                        tally,
                    )
                    for c in range(cfg.clients)
                )
            )
            results[name] = {
                "ops": tally.ops / cfg.seconds,
                "p50_us": float(np.percentile(lat, 50)) if lat else None,
                "p99_us": float(np.percentile(lat, 99)) if lat else None,
                "timeouts": tally.timeouts,
                "errors": tally.errors,
                "mismatches": tally.mismatches,
            }
        return results
    finally:
        for pool in pools:
            await pool.close()


def run_async_pool_bench(cfg: AsyncPoolBenchConfig) -> tuple[dict[str, Any], int]:
    """Start the pool, run every phase; (result object, exit code: 0, 1 wrong data or error
    replies, 3 the run failed)."""
    if not 1 <= cfg.clients <= MAX_CLIENTS:
        raise ValueError(f"--clients {cfg.clients} must be 1..{MAX_CLIENTS}")
    if cfg.seconds <= 0 or cfg.warmup < 0:
        raise ValueError("--seconds must be positive and --warmup not negative")
    res: dict[str, Any] = {
        "ok": False,
        "mode": "async",
        "clients": cfg.clients,
        "in_flight": cfg.clients,
        "seconds": cfg.seconds,
        "warmup_seconds": cfg.warmup,
        "nodes": cfg.nodes,
        "interleave_bytes": cfg.interleave,
        "results": {},
        "netdam_ops": None,
        "startup_seconds": None,
        "machine": machine_info(),
    }
    t0 = time.monotonic()
    # Imported here: they load numba's compiled kernels, which `netdam --help` need not pay for.
    from netdam.cluster.launch import start_pool_cluster
    from netdam.switch.controller import PoolController

    with tempfile.TemporaryDirectory(prefix="netdam-bench-pool-async-") as tmp:
        pool = switch = None
        try:
            pool, switch = start_pool_cluster(
                cfg.nodes, memory=16 << 20, cluster_path=Path(tmp) / "c.toml"
            )
            region = PoolController(pool.path).alloc(
                cfg.clients * cfg.slice_bytes, interleave=cfg.interleave
            )
            res["startup_seconds"] = round(time.monotonic() - t0, 3)
            res["results"] = asyncio.run(
                _run(cfg, switch.vip, region.gaddr, region.rkey, region.tag_key)
            )
        except (OSError, RuntimeError, ValueError) as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            return res, 3
        finally:
            if switch is not None:
                switch.stop()
            if pool is not None:
                pool.stop()
    rows = res["results"]
    res["netdam_ops"] = rows["read_64"]["ops"]
    bad = sum(r["mismatches"] + r["errors"] for r in rows.values())
    res["ok"] = bad == 0 and all(r["ops"] > 0 for r in rows.values())
    if not res["ok"]:
        res["error"] = (
            f"{bad} wrong READs or error replies" if bad else "a phase completed no request"
        )
    return res, 0 if res["ok"] else 1


def format_async_text(res: dict[str, Any]) -> str:
    lines = [
        f"netdam bench pool --async: {res['clients']} asyncio clients in one event loop, "
        f"{res['seconds']} s per phase, {res['nodes']} nodes + switch"
    ]
    lines += phase_table(res["results"], wrong=True)
    if res.get("error"):
        lines.append(f"  error: {res['error']}")
    return "\n".join(lines)
