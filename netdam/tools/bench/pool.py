"""``netdam bench pool``: pool READ/WRITE through the switch against memcached, same generator.

One run, real processes everywhere: a pool (``nodes`` node processes and the switch, started
like ``netdam up --switch``), a null UDP echo server, memcached over UDP when it is on PATH, and
``generators`` load-generator processes whose hot loop is a numba kernel
(``netdam.kernels.pool_gen._gen_run``: recvmmsg/sendmmsg, a fixed window of requests in flight,
latency per request). Phases, each ``warmup`` + ``seconds``, all with the same generators:

- ``echo``: READ 64 B datagrams bounced by the echo server (``generator_ops``: what the
  generators can drive at all);
- ``read_64``, ``read_4096``, ``write_64``, ``write_4096``: pool requests to the VIP (global
  addresses of an interleaved region; READ answered with READ_RESP, WRITE with ACK, both
  straight from the node holding the data);
- ``memcached_get_64``: memcached's UDP protocol (8-byte frame header, ``get``) for a 64-byte
  value.

When ``generator_ops`` < 1.5 x the fastest server measured, the run doubles the generator
processes (the window is split among them) and measures again, up to ``max_generators``.
``ratio = netdam_ops / memcached_ops`` (READ 64 B vs GET 64 B).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from netdam.kernels import pool_gen as G
from netdam.kernels import udp_io as U
from netdam.kernels.state import GenPlan, RxBatch, TimeWindow
from netdam.outcome import ExitCode
from netdam.protocol.constants import TAG_SIZE, DType, Flags, Opcode
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import (
    Packet,
    decode_packet,
    encode_packet,
    endpoint_to_u64,
    u64_to_endpoint,
)
from netdam.shell.startup import StartStalled, wait_while_working
from netdam.shell.udp import open_udp_socket
from netdam.tools import plot as plotting
from netdam.tools.bench.report import machine_info, phase_table
from netdam.tools.workers import worker_context
from netdam.units import format_size

LOOPBACK = "127.0.0.1"
TEMPLATES = 64
RECV_MAX = 1024
RECV_BYTES = 16 << 16
CHILD_IDLE_S = 300.0
PHASE_GRACE_S = 20.0
MEMCACHED_KEY = b"netdam-bench"


@dataclass
class PoolBenchConfig:
    seconds: float = 2.0
    warmup: float = 0.5
    #: Requests in flight in all (split among the generator processes; a power of two).
    window: int = 32
    nodes: int = 2
    interleave: int = 8192
    generators: int = 1
    max_generators: int = 4
    timeout_ms: float = 50.0
    memcached: str | None = None  # path; None: look on PATH
    #: A region of SPEC v1 before tags (its rkey alone opens it): what tags cost, by difference.
    untagged: bool = False


class _Failure(NetdamError):
    pass


# ---------------------------------------------------------------- child processes


def _worker(role: str, conn: Connection) -> None:
    # Who started this worker: the bench, or the fork server that forked it for the bench
    # (netdam.tools.workers); either goes away with the bench, and the worker then exits.
    parent = os.getppid()
    try:
        sock = open_udp_socket((LOOPBACK, 0), rcvbuf=8 << 20)
        fd = sock.fileno()
        state = U.new_state()
        scratch = U.new_send_scratch()
        buf = np.zeros(RECV_BYTES, np.uint8)
        offs = np.zeros(RECV_MAX, np.int64)
        lens = np.zeros(RECV_MAX, np.int32)
        srcs = np.zeros(RECV_MAX, np.uint64)
        counts = np.zeros(G.G_COUNTS, np.int64)
        hist = np.zeros(G.HIST_BINS, np.int64)
        templates = np.zeros((1, 128), np.uint8)
        if role == "gen":
            G.gen_run(
                fd,
                GenPlan(
                    templates,
                    np.array([64], np.int64),
                    1,
                    1,
                    np.uint64(0),
                    12,
                    4,
                    -1,
                    0,
                    1,
                    np.zeros(2, np.uint64),
                ),
                TimeWindow(0, 0, 0),
                RxBatch(buf, offs, lens, srcs),
                RECV_MAX,
                scratch,
                state,
                counts,
                hist,
            )
        else:
            G.echo_run(fd, buf, offs, lens, srcs, RECV_MAX, scratch, state, 0, counts)
        conn.send(("ready", {"port": sock.getsockname()[1]}))
        while True:
            if not conn.poll(CHILD_IDLE_S) or os.getppid() != parent:
                return
            tag, cmd = conn.recv()
            if tag == "exit":
                return
            counts[:] = 0
            hist[:] = 0
            if role == "gen":
                rows = cmd["templates"]
                if cmd.get("token_from"):
                    rows = _with_token(rows, _validation_token(sock, int(cmd["token_from"])))
                tag = np.frombuffer(
                    bytes.fromhex(cmd.get("tag_key", "")) or bytes(16), "<u8"
                ).copy()
                # Room for the tag only when sealing: slots as long as their datagrams lie back to
                # back, which lets a batch to one destination leave as one GSO send.
                width = max(len(r) for r in rows) + (TAG_SIZE if tag.any() else 0)
                templates = np.zeros((len(rows), width), np.uint8)
                t_len = np.zeros(len(rows), np.int64)
                for k, r in enumerate(rows):
                    templates[k, : len(r)] = np.frombuffer(r, np.uint8)
                    t_len[k] = len(r)
                plan = GenPlan(
                    templates,
                    t_len,
                    len(rows),
                    cmd["window"],
                    np.uint64(cmd["dst"]),
                    cmd["id_off"],
                    cmd["id_bytes"],
                    cmd["ok_off"],
                    cmd["ok_byte"],
                    int(cmd["timeout_ns"]),
                    tag,
                )
                G.gen_run(
                    fd,
                    plan,
                    TimeWindow(cmd["t_start"], cmd["t_end"], cmd["t_stop"]),
                    RxBatch(buf, offs, lens, srcs),
                    RECV_MAX,
                    scratch,
                    state,
                    counts,
                    hist,
                )
                nz = np.nonzero(hist)[0]
                conn.send(
                    (
                        "done",
                        {
                            "counts": counts.tolist(),
                            "hist": dict(zip(nz.tolist(), hist[nz].tolist())),
                        },
                    )
                )
            else:
                G.echo_run(
                    fd, buf, offs, lens, srcs, RECV_MAX, scratch, state, cmd["t_stop"], counts
                )
                conn.send(("done", {"counts": counts.tolist()}))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))


def _validation_token(sock: socket.socket, dst: int) -> int:
    """PING *dst* from *sock* and return the address-validation token its INFO carries: READs
    answered with more than 3 times their size need it (SPEC.md 12.4)."""
    ping = encode_packet(Packet(Opcode.PING, client_id=0x70C, txn_id=0x70C))
    for _ in range(10):
        sock.sendto(ping, u64_to_endpoint(dst))
        deadline = time.monotonic() + 0.2
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break
            try:
                reply = decode_packet(sock.recv(65536))
            except (BlockingIOError, RemoteProtocolError):
                continue  # a late answer of the last phase, or not ours
            if reply.opcode == Opcode.INFO and reply.txn_id == 0x70C:
                return int(reply.aux_addr)
    raise _Failure(
        f"no INFO from {u64_to_endpoint(dst)} in 2 s: cannot validate the generator's address"
    )


def _with_token(rows: list[bytes], token: int) -> list[bytes]:
    """*rows* with *token* in every READ's aux_addr."""
    out = []
    for row in rows:
        data = bytearray(row)
        if HEADER.read(data, "opcode") == Opcode.READ:
            HEADER.write(data, "aux_addr", token)
        out.append(bytes(data))
    return out


class _Child:
    def __init__(self, ctx: Any, role: str) -> None:
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(role, child), daemon=True, name=f"netdam-bench-pool-{role}"
        )
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        """The child's ready message, waited for as long as the child works (a first run
        compiles its kernels; netdam.shell.startup)."""
        try:
            wait_while_working(self.proc.pid, self.conn.poll, f"{self.role} process")
        except StartStalled as exc:
            raise _Failure(str(exc)) from None
        return self.expect("ready", 0)

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise _Failure(f"{self.role} process did not answer within {timeout:.0f} s")
        try:
            tag, body = self.conn.recv()
        except (EOFError, OSError):
            raise _Failure(f"{self.role} process died (exit code {self.proc.exitcode})") from None
        if tag != kind:
            raise _Failure(str(body))
        result: dict[str, Any] = body
        return result

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("exit", {}))
        self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)


# ---------------------------------------------------------------- workloads


def _netdam_templates(
    opcode: Opcode, size: int, gaddr: int, rkey: int, region_size: int, client_id: int
) -> list[bytes]:
    rows = []
    step = max(size, 4096)
    for k in range(TEMPLATES):
        addr = gaddr + (k * step) % (region_size - size + 1)  # spread over stripes and nodes
        if opcode == Opcode.READ:
            p = Packet(Opcode.READ, client_id=client_id, rkey=rkey, addr=addr, length=size)
        else:
            p = Packet(
                Opcode.WRITE,
                flags=Flags.ACK_REQ,
                client_id=client_id,
                rkey=rkey,
                addr=addr,
                length=size,
                dtype=DType.RAW,
                payload=bytes([k & 0xFF]) * size,
            )
        rows.append(encode_packet(p))
    return rows


def _memcached_get() -> list[bytes]:
    return [b"\x00\x00\x00\x00\x00\x01\x00\x00get " + MEMCACHED_KEY + b"\r\n"]


def _percentiles(hists: list[dict[int, int]]) -> tuple[float | None, float | None]:
    merged: dict[int, int] = {}
    for h in hists:
        for k, v in h.items():
            merged[int(k)] = merged.get(int(k), 0) + int(v)
    total = sum(merged.values())
    if not total:
        return None, None
    out = []
    for q in (0.5, 0.99):
        need, seen = q * total, 0
        for us in sorted(merged):
            seen += merged[us]
            if seen >= need:
                out.append(float(us))
                break
    return out[0], out[1]


def _start_memcached(path: str) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((LOOPBACK, 0))
        port = int(probe.getsockname()[1])
    cmd = [path, "-U", str(port), "-p", "0", "-l", LOOPBACK, "-m", "64", "-t", "4"]
    if os.geteuid() == 0:
        cmd += ["-u", "root"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Store the 64-byte value over UDP and wait for STORED.
    value = bytes(range(64))
    request = (
        b"\x00\x01\x00\x00\x00\x01\x00\x00set " + MEMCACHED_KEY + b" 0 0 64\r\n" + value + b"\r\n"
    )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise _Failure(f"memcached exited at start-up: {err.strip()[-300:]}")
            s.sendto(request, (LOOPBACK, port))
            try:
                data = s.recv(2048)
            except TimeoutError:
                continue
            if b"STORED" in data:
                return proc, port
    proc.kill()
    raise _Failure("memcached did not answer a UDP set within 10 s")


# ---------------------------------------------------------------- the run


def run_pool_bench(cfg: PoolBenchConfig) -> tuple[dict[str, Any], int]:
    """Run every phase; (result object, exit code). A failed run carries ``error``, exit 3."""

    if cfg.window < 1 or cfg.window & (cfg.window - 1) or cfg.window > 1024:
        raise ValueError(f"--window {cfg.window} must be a power of two, 1..1024")
    if cfg.generators < 1 or cfg.max_generators < cfg.generators:
        raise ValueError("--generators must be >= 1 and <= --max-generators")
    res: dict[str, Any] = {
        "ok": False,
        "netdam_ops": None,
        "memcached_ops": None,
        "ratio": None,
        "generator_ops": None,
        "generators": None,
        "window": cfg.window,
        "seconds": cfg.seconds,
        "warmup_seconds": cfg.warmup,
        "nodes": cfg.nodes,
        "interleave_bytes": cfg.interleave,
        "valid": False,
        "results": {},
        "tagged": not cfg.untagged,
        "startup_seconds": None,
        "machine": machine_info(),
    }
    memcached = cfg.memcached or shutil.which("memcached")
    if memcached is None:
        res["memcached_skipped"] = "memcached not on PATH (apt-get install memcached)"
    code = ExitCode.OK
    t0 = time.monotonic()
    ctx = worker_context()
    children: list[_Child] = []
    mc_proc = None
    pool = switch = None
    with tempfile.TemporaryDirectory(prefix="netdam-bench-pool-") as tmp:
        try:
            # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
            from netdam.cluster.launch import start_pool_cluster

            # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
            from netdam.switch.controller import PoolController

            pool, switch = start_pool_cluster(
                cfg.nodes, memory=16 << 20, cluster_path=Path(tmp) / "c.toml"
            )
            region = PoolController(pool.path).alloc(
                4 << 20, interleave=cfg.interleave, tagged=not cfg.untagged
            )
            key = region.tag_key
            echo = _Child(ctx, "echo")
            children.append(echo)
            gens = [_Child(ctx, "gen") for _ in range(cfg.max_generators)]
            children += gens
            for child in children:
                child.info = child.wait_ready()
            mc_port = None
            if memcached is not None:
                mc_proc, mc_port = _start_memcached(memcached)
            res["startup_seconds"] = round(time.monotonic() - t0, 3)
            vip = endpoint_to_u64(switch.vip)
            echo_ep = endpoint_to_u64((LOOPBACK, echo.info["port"]))

            def phase(
                name: str,
                n_gens: int,
                rows_for: Any,
                dst: int,
                id_off: int,
                id_bytes: int,
                ok_off: int,
                ok_byte: int,
                validate: bool = False,
                tag_key: bytes = b"",
            ) -> dict[str, Any]:
                now = time.monotonic_ns()
                t_start = now + int(0.1e9) + int(cfg.warmup * 1e9)
                t_end = t_start + int(cfg.seconds * 1e9)
                t_stop = t_end + int(0.05e9)
                if name == "echo":
                    echo.conn.send(("run", {"t_stop": t_stop + int(0.2e9)}))
                per = max(1, cfg.window // n_gens)
                for g in range(n_gens):
                    gens[g].conn.send(
                        (
                            "run",
                            {
                                "templates": rows_for(g),
                                "window": per,
                                "dst": dst,
                                "id_off": id_off,
                                "id_bytes": id_bytes,
                                "ok_off": ok_off,
                                "ok_byte": ok_byte,
                                "t_start": t_start,
                                "t_end": t_end,
                                "t_stop": t_stop,
                                "timeout_ns": cfg.timeout_ms * 1e6,
                                "token_from": dst if validate else 0,
                                "tag_key": tag_key.hex(),
                            },
                        )
                    )
                budget = (t_stop - now) / 1e9 + PHASE_GRACE_S
                reports = [gens[g].expect("done", budget) for g in range(n_gens)]
                if name == "echo":
                    echo.expect("done", budget)

                ops = sum(r["counts"][G.G_OPS_IN_WINDOW] for r in reports) / cfg.seconds
                p50, p99 = _percentiles([r["hist"] for r in reports])
                return {
                    "ops": ops,
                    "p50_us": p50,
                    "p99_us": p99,
                    "timeouts": sum(r["counts"][G.G_TIMEOUTS] for r in reports),
                    "errors": sum(r["counts"][G.G_ERRORS] for r in reports),
                }

            n_gens = cfg.generators
            attempt = 0
            while True:
                results: dict[str, Any] = {}

                attempt += 1

                def nd(op: Opcode, size: int, phase_no: int, attempt: int = attempt) -> Any:
                    # A fresh client id per phase, attempt and generator: each
                    # phase's transaction ids start again at 0, which a node's window calls STALE.
                    base = 0x7E570000 + (attempt << 12) + (phase_no << 4)
                    return lambda g: _netdam_templates(
                        op, size, region.gaddr, region.rkey, region.size, base + g
                    )

                results["echo"] = phase(
                    "echo", n_gens, nd(Opcode.READ, 64, 1), echo_ep, 12, 4, -1, 0, tag_key=key
                )
                # The pool phases: name, opcode, bytes, phase number, the reply that counts as
                # success, whether the bytes read are checked.
                for name, op, size, phase_no, ok, validate in (
                    ("read_64", Opcode.READ, 64, 2, Opcode.READ_RESP, True),
                    ("read_4096", Opcode.READ, 4096, 3, Opcode.READ_RESP, True),
                    ("write_64", Opcode.WRITE, 64, 4, Opcode.ACK, False),
                    ("write_4096", Opcode.WRITE, 4096, 5, Opcode.ACK, False),
                ):
                    results[name] = phase(
                        name,
                        n_gens,
                        nd(op, size, phase_no),
                        vip,
                        12,
                        4,
                        1,
                        int(ok),
                        validate=validate,
                        tag_key=key,
                    )
                if mc_port is not None:
                    results["memcached_get_64"] = phase(
                        "memcached",
                        n_gens,
                        lambda g: _memcached_get(),
                        endpoint_to_u64((LOOPBACK, mc_port)),
                        0,
                        2,
                        8,
                        ord("V"),
                    )
                served = [results["read_64"]["ops"]]
                if "memcached_get_64" in results:
                    served.append(results["memcached_get_64"]["ops"])
                gen_ops = results["echo"]["ops"]
                if gen_ops >= 1.5 * max(served) or n_gens * 2 > cfg.max_generators:
                    break
                n_gens *= 2
            res["results"] = results
            res["generators"] = n_gens
            res["generator_ops"] = gen_ops
            res["netdam_ops"] = results["read_64"]["ops"]
            if "memcached_get_64" in results:
                res["memcached_ops"] = results["memcached_get_64"]["ops"]
                if res["memcached_ops"]:
                    res["ratio"] = res["netdam_ops"] / res["memcached_ops"]
            res["valid"] = bool(gen_ops >= 1.5 * max(served))
            if not res["valid"]:
                res["invalid_reason"] = (
                    f"the generators drove {gen_ops:,.0f} ops/s at the echo server, "
                    f"less than 1.5 x {max(served):,.0f}: more generator processes "
                    f"(--max-generators) or more cores are needed"
                )
            res["free"] = _time_alloc_free(PoolController(pool.path), cfg.interleave)
            errors = sum(r["errors"] for r in results.values())
            silent = [name for name, r in results.items() if r["ops"] == 0]
            if silent:
                res["error"] = (
                    f"no request of phase {', '.join(silent)} was answered "
                    f"({sum(results[n]['timeouts'] for n in silent)} timeouts): its figures time nothing"
                )
                code = ExitCode.CHECK_FAILED
            elif errors:
                res["error"] = (
                    f"{errors} requests were answered with an error (NACK or memcached error)"
                )
                code = ExitCode.CHECK_FAILED
        except (_Failure, OSError, ValueError) as exc:
            res["error"] = str(exc)
            code = ExitCode.RUN_FAILED
        except Exception as exc:  # a failed start-up (ClusterStartError, PoolError)
            res["error"] = f"{type(exc).__name__}: {exc}"
            code = ExitCode.RUN_FAILED
        finally:
            for child in children:
                child.stop()
            if mc_proc is not None:
                mc_proc.terminate()
                with contextlib.suppress(Exception):
                    mc_proc.wait(5)
            if switch is not None:
                switch.stop()
            if pool is not None:
                pool.stop()
    if res["memcached_ops"] is None:
        res.setdefault("memcached_skipped", "memcached was not measured")
    res["ok"] = code == ExitCode.OK
    return res, int(code)


#: Region sizes whose ALLOC and FREE the bench times: a page and 8 MiB. FREE deregisters every
#: way and each node zeroes the way's bytes before it answers (SPEC.md 6.1), so the difference
#: between the two is what wiping freed memory costs.
FREE_SIZES = (4096, 8 << 20)
FREE_REPEAT = 5


def _time_alloc_free(controller: Any, interleave: int) -> dict[str, Any]:
    """Median seconds of ALLOC and of FREE (which zeroes the backing) per size in FREE_SIZES."""
    rows = {}
    for size in FREE_SIZES:
        allocs, frees = [], []
        for _ in range(FREE_REPEAT):
            start = time.perf_counter()
            region = controller.alloc(size, interleave=interleave)
            allocs.append(time.perf_counter() - start)
            start = time.perf_counter()
            controller.free(region.gaddr)
            frees.append(time.perf_counter() - start)
        rows[str(size)] = {
            "alloc_seconds": float(np.median(allocs)),
            "free_seconds": float(np.median(frees)),
        }
    return {"repeat": FREE_REPEAT, "sizes": rows}


def format_text(res: dict[str, Any]) -> str:
    lines = [
        f"netdam bench pool: {res['seconds']} s per phase, window {res['window']}, "
        f"{res['generators']} generator process(es), {res['nodes']} nodes + switch, "
        f"{'tagged' if res['tagged'] else 'untagged'} region"
    ]
    lines += phase_table(res["results"])
    ratio = "-" if res["ratio"] is None else f"{res['ratio']:.3f}"
    lines.append(
        f"  ratio netdam READ 64 / memcached GET 64: {ratio}; valid {'yes' if res['valid'] else 'NO'}"
    )
    if res.get("free"):
        sizes = res["free"]["sizes"]
        shown = ", ".join(
            f"{format_size(int(k))} {v['alloc_seconds'] * 1e3:.1f} / {v['free_seconds'] * 1e3:.1f} ms"
            for k, v in sizes.items()
        )
        lines.append(
            f"  ALLOC / FREE (FREE zeroes the backing), median of {res['free']['repeat']}: {shown}"
        )
    for key in ("memcached_skipped", "invalid_reason", "error"):
        if res.get(key):
            lines.append(f"  {key}: {res[key]}")
    return "\n".join(lines)


def _peer(phase: str) -> str:
    """Whose server a phase measures: netdam's pool, memcached, or the null echo server."""
    return "echo" if phase == "echo" else "memcached" if phase.startswith("memcached") else "netdam"


def plot_pool(plt: Any, res: dict[str, Any], path: str) -> None:
    """Ops/s per phase (the echo server is the generators' ceiling) and p50/p99 latency in us,
    bars coloured by the server measured."""

    names = list(res["results"])
    colors = [plotting.color(_peer(n)) for n in names]
    fig, (ax_ops, ax_lat) = plotting.figure(plt, 1, 2, width=5.6)
    ops = ax_ops.bar(names, [res["results"][n]["ops"] for n in names], color=colors)
    ax_ops.bar_label(
        ops,
        labels=[f"{res['results'][n]['ops'] / 1e3:,.0f}k" for n in names],
        fontsize=8,
        padding=2,
    )
    ax_ops.margins(y=0.12)  # room for the labels above the tallest bar
    ax_ops.set(ylabel="ops/s", title=f"throughput, window {res['window']}")
    # p50 and p99 side by side per phase: bars, not a line, since phases are categories.
    xs = range(len(names))
    for offset, key, hatch in ((-0.2, "p50_us", None), (0.2, "p99_us", "//")):
        values = [res["results"][n][key] for n in names]
        ax_lat.bar(
            [x + offset for x in xs],
            [0 if v is None else v for v in values],
            width=0.4,
            color=colors,
            hatch=hatch,
            edgecolor="white" if hatch else None,
        )
    ax_lat.set(ylabel="latency (us)", title="latency per request")
    for ax in (ax_ops, ax_lat):  # rotated, each name ends under its bars
        ax.set_xticks(list(xs), names, rotation=30, ha="right", rotation_mode="anchor")
    peers = [p for p in ("netdam", "memcached", "echo") if p in map(_peer, names)]
    legend = (
        plotting.Key()
        .colors(peers)
        .patch("p50")
        .patch("p99", hatch="//", facecolor="0.6", edgecolor="white")
    )
    ratio = "-" if res["ratio"] is None else f"{res['ratio']:.2f}"
    plotting.finish(
        fig,
        path,
        f"netdam bench pool: {res['nodes']} nodes + switch vs memcached "
        f"(READ 64 B / GET 64 B = {ratio})",
        legend,
    )
