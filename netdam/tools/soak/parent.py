"""``netdam soak``: a correctness soak of the memory pool through the switch, under seeded faults.

N client *processes* (real sockets, concurrent) each own one pool region (random size; some
range-mapped, some interleaved over 2..M nodes with a 4, 8 or 16 KiB stride) cut into blocks of
1..8192 bytes that never cross a stripe, so every block is exactly one request. Each client runs
a seeded random mix of pipelined batches (``pipeline`` operations on distinct blocks per
``PoolClient.execute``):

- WRITE of fresh random bytes; the client remembers the block's checksum (BLAKE2b-128) once the
  write is ACKed, and keeps the checksums of the block's earlier versions;
- READ, checked against the last acknowledged version: an earlier acknowledged version is a
  **lost write** (counted once per lost version), anything else a **corrupt read**;
- FETCH_ADD +1 on one shared counter; the client keeps the old value of every ACKed increment.

Exactly-once accounting. The pool client retries with the same transaction id and the node's
duplicate window answers a retry of an executed request from its cache (SPEC.md section 7), so
an increment whose reply was lost is applied once and its retry gets the same old value. An
operation with no answer after every retry (or NACKed) is *not* acknowledged: it is counted in
``errors``, a WRITE then becomes an "unconfirmed" version of its block (a later read may find
either it or the last acknowledged one), a FETCH_ADD an ``unconfirmed_increment`` (it may or may
not have been applied). After a failed batch the client waits ``quiesce`` seconds so that nothing
it abandoned is still in flight when it goes on. Then, with ``delta = final - initial``:

- ``counter_error = delta - acknowledged`` when that is below 0 (increments lost) and
  ``delta - acknowledged - unconfirmed`` when that is above 0 (increments applied twice); 0 when
  ``acknowledged <= delta <= acknowledged + unconfirmed``. With no unconfirmed increments it is
  exactly ``final - initial - acknowledged``;
- ``counter_old_value_errors``: acknowledged increments whose old values repeat or fall outside
  ``[initial, final)`` (each applied increment returns a distinct old value).

After the timed phase every client stops and reports its book; the parent reads every block of
every region back with its own client id and checks it the same way, then reads the counter.

Faults (``--loss/--dup/--reorder`` probabilities, ``--delay`` milliseconds on a ``--delay-prob``
fraction) are seeded and decided by ``hash(seed, source, destination, packet id, attempt)`` on
every hop a request and its reply take: the switch's ``client:rx`` link (client -> switch), its
``node<R>:tx`` links (switch -> node) (or, with ``fault_site="nodes"``, the nodes' receive side
instead of both), and the clients' own receive side (node -> client: the replies, which bypass
the switch; ``ProbeSocket`` in netdam/tools/soak/client.py). With ``--cluster`` the switch and nodes keep the faults they were
started with and only the clients' receive side is injected here. The workload is a function of
the seed; which packets exist depends on timing (retries), so a run is not bit-for-bit replayable.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from netdam.clients.pool import PoolClient, PoolError, tag_keys_of
from netdam.cluster.clusterfile import load_cluster, require_switch
from netdam.cluster.control import ControlClient, ControlError
from netdam.core.faults import FaultSpec
from netdam.protocol import counters as C
from netdam.protocol.constants import Opcode, Status
from netdam.protocol.packet import Endpoint, Packet
from netdam.shell.shm import attach
from netdam.shell.startup import CpuWatch, stall_reason
from netdam.tools.soak.client import ClientReport, client_main
from netdam.tools.soak.plan import (
    COUNTER_REGION,
    DONE_GRACE_S,
    ERROR_SAMPLES,
    KINDS,
    NODE_MEMORY,
    OK,
    SNAPSHOT_KEYS,
    VERIFY_BATCH,
    BlockBook,
    ClientPlan,
    ClientSettings,
    KiB,
    SoakConfig,
    SoakFailure,
    SoakLayout,
    check_counter,
    client_ids,
    draw_region,
    latency_summary,
    layout_blocks,
    seeded,
)
from netdam.tools.workers import worker_context

if TYPE_CHECKING:
    from netdam.cluster.clusterfile import ClusterFile
    from netdam.switch.addrmap import Region
    from netdam.switch.controller import PoolController


@dataclass
class _Pool:
    path: Path
    info: ClusterFile
    vip: Endpoint
    control: Endpoint
    own: bool
    startup_seconds: float
    fault_links: list[str]


def switch_fault_text(config: SoakConfig, nodes: int) -> str:
    """``netdam switch --faults`` text: the soak's faults on client:rx and every node<R>:tx."""
    values = [("loss", config.loss), ("dup", config.dup), ("reorder", config.reorder)]
    if config.delay_ms:
        values += [("delay", config.delay_prob), ("delay_ms", config.delay_ms)]
    spec = ",".join(f"{name}={value:g}" for name, value in values if value)
    if not spec:
        return ""
    links = ["client:rx"] + [f"node{rank}:tx" for rank in range(nodes)]
    return ";".join(f"{link}:{spec}" for link in links)


def fault_links(config: SoakConfig, nodes: int, own: bool) -> list[str]:
    """Where the soak injects its faults: switch links (own cluster only) and the clients' receive side."""
    if not config.reply_faults().active:
        return []
    if not own:
        return ["client:recv"]
    if config.fault_site == "nodes":
        return [f"node{rank}:recv" for rank in range(nodes)] + ["client:recv"]
    return ["client:rx"] + [f"node{rank}:tx" for rank in range(nodes)] + ["client:recv"]


def _check_cluster_file(path: Path) -> tuple[ClusterFile, Endpoint, Endpoint]:
    """(cluster, VIP, switch management endpoint) of a running cluster's file."""

    try:
        info = load_cluster(path)
        entry = require_switch(path)
    except (ValueError, OSError) as exc:
        raise SoakFailure(f"--cluster {path}: {exc}") from None
    return info, entry.vip, entry.control_endpoint


@contextlib.contextmanager
def _pool_cluster(config: SoakConfig) -> Iterator[_Pool]:
    """The soak's pool: a private cluster with a switch, or the running one of --cluster."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import ClusterStartError, start_cluster

    if config.cluster is not None:
        info, vip, control = _check_cluster_file(config.cluster)
        yield _Pool(
            config.cluster,
            info,
            vip,
            control,
            False,
            0.0,
            fault_links(config, len(info.nodes), own=False),
        )
        return
    on_switch = config.fault_site == "switch"
    text = switch_fault_text(config, config.nodes) if on_switch else ""
    node_faults = FaultSpec() if on_switch else config.reply_faults()
    try:
        cluster = start_cluster(
            config.nodes,
            memory=NODE_MEMORY,
            switch=True,
            switch_faults=text,
            switch_seed=config.seed,
            faults=node_faults,
        )
    except (ClusterStartError, ValueError, OSError) as exc:
        raise SoakFailure(f"could not start the soak's cluster: {exc}") from None
    try:
        entry = cluster.switch.entry
        yield _Pool(
            cluster.path,
            cluster.info,
            entry.vip,
            entry.control_endpoint,
            True,
            cluster.startup_seconds,
            fault_links(config, config.nodes, own=True),
        )
    finally:
        cluster.stop()


def _allocate(
    controller: PoolController, config: SoakConfig, nodes: int, allocated: list[Region]
) -> SoakLayout:
    """One region per client and the counter's region (every region lands in *allocated*)."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError as AllocError

    rng = seeded(config.seed, 0xA110C)
    ids = client_ids(config.seed, config.clients + 1)
    try:
        counter = controller.alloc(
            COUNTER_REGION, 8 * KiB if nodes > 1 else None, tenant="soak-counter"
        )
        allocated.append(counter)
        regions = []
        for k in range(config.clients):
            size, stride, ways = draw_region(rng, nodes)
            region = controller.alloc(
                size, stride or None, ways=ways if stride else None, tenant=f"soak-{k}"
            )
            allocated.append(region)
            regions.append(region)
    except AllocError as exc:
        raise SoakFailure(f"could not allocate the soak's regions: {exc}") from None
    counter_addr = counter.gaddr + 8 * int(rng.integers(0, COUNTER_REGION // 8))
    counter_node = counter.locate(counter_addr - counter.gaddr)[0]
    plans = [
        ClientPlan(
            k,
            ids[k],
            config.seed,
            r.gaddr,
            r.rkey,
            r.size,
            r.stride,
            len(r.ways),
            tuple(layout_blocks(r.size, r.stride, rng)),
            counter_addr,
            counter.rkey,
            tuple(w.node for w in r.ways),
            counter_node,
            r.tag_key,
            counter.tag_key,
        )
        for k, r in enumerate(regions)
    ]
    return SoakLayout(plans, regions, counter, counter_addr)


class _Children:
    """The client processes and their pipes."""

    def __init__(self, count: int) -> None:
        ctx = worker_context()
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for index in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=client_main, args=(child,), daemon=True, name=f"netdam-soak-client-{index}"
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def expect(self, index: int, tag: str, timeout: float | None) -> Any:
        """Client *index*'s next message, which must be *tag*: within *timeout* seconds, or with
        None (start-up) for as long as the client keeps working (netdam.shell.startup)."""
        conn, proc = self.conns[index], self.procs[index]
        watch = CpuWatch(proc.pid or 0)
        started = time.monotonic()
        while not conn.poll(0.2):
            if not proc.is_alive() and not conn.poll(0):
                raise SoakFailure(
                    f"client {index} (pid {proc.pid}) exited with code {proc.exitcode} "
                    f"before reporting {tag!r}"
                )
            now = time.monotonic()
            reason = stall_reason(watch, started, now) if timeout is None else None
            if reason is not None or (timeout is not None and now - started > timeout):
                why = reason or f"did not report it within {timeout:.0f} s"
                raise SoakFailure(
                    f"client {index} (pid {proc.pid}) {why} before reporting {tag!r}: the "
                    "machine may be overloaded; try fewer --clients"
                )
        try:
            got, body = conn.recv()
        except EOFError:
            raise SoakFailure(
                f"client {index} (pid {proc.pid}) closed its pipe before reporting {tag!r}"
            ) from None
        if got == "error":
            raise SoakFailure(str(body))
        return body

    def send(self, index: int, message: tuple[str, Any]) -> None:
        try:
            self.conns[index].send(message)
        except OSError as exc:
            raise SoakFailure(
                f"client {index} (pid {self.procs[index].pid}) is gone: {exc}"
            ) from None

    def stop(self) -> None:
        """Close the pipes (a client waiting on one exits) and reap the processes."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def _run_clients(
    children: _Children,
    layout: SoakLayout,
    settings: ClientSettings,
    seconds: float,
    phases: dict[str, float],
) -> list[ClientReport]:
    """Hand every client its plan, wait until each filled its region, run them, collect reports."""
    for plan in layout.plans:
        children.send(plan.index, ("plan", (plan, settings)))
    for plan in layout.plans:
        children.expect(plan.index, "ready", None)
    phases["go"] = time.monotonic()
    for plan in layout.plans:
        children.send(plan.index, ("go", phases["go"] + seconds))
    return [children.expect(p.index, "done", seconds + DONE_GRACE_S) for p in layout.plans]


@dataclass
class FinalCheck:
    """The read-back after the clients stopped."""

    counter: int = 0
    blocks: int = 0
    bytes: int = 0
    failed_reads: int = 0
    messages: list[str] = field(default_factory=list)


def _verify(
    pool: _Pool,
    layout: SoakLayout,
    reports: list[ClientReport],
    settings: ClientSettings,
    verifier_id: int,
) -> FinalCheck:
    """Read every block back (checked into each client's book), then the counter."""
    check = FinalCheck()
    with PoolClient(
        pool.vip,
        client_id=verifier_id,
        timeout=settings.timeout_s,
        retries=settings.retries,
        window=32,
        tag_keys=tag_keys_of(*layout.regions, layout.counter_region),
    ) as client:
        for plan, report in zip(layout.plans, reports, strict=True):
            _verify_region(client, plan, report.book, check)
        try:
            check.counter = int.from_bytes(
                client.read(layout.counter_addr, 8, layout.counter_region.rkey), "little"
            )
        except PoolError as exc:
            raise SoakFailure(f"could not read the shared counter back: {exc}") from None
    return check


def _verify_region(
    client: PoolClient, plan: ClientPlan, book: BlockBook, check: FinalCheck
) -> None:
    requests = [(plan.gaddr + off, length, plan.rkey) for off, length in plan.blocks]
    for start in range(0, len(requests), VERIFY_BATCH):
        chunk = requests[start : start + VERIFY_BATCH]
        try:
            datas = client.read_many(chunk)
        except PoolError as exc:
            check.failed_reads += len(chunk)
            check.messages.append(
                f"final check of client {plan.index}'s blocks {start}..{start + len(chunk) - 1} failed: {exc}"
            )
            continue
        for k, data in enumerate(datas):
            verdict = book.check(start + k, data)
            if verdict != OK:
                check.messages.append(
                    f"final check: client {plan.index} block {start + k} at 0x{chunk[k][0]:x} "
                    f"({chunk[k][1]} bytes) holds {verdict} data"
                )
        check.blocks += len(chunk)
        check.bytes += sum(length for _, length, _ in chunk)


def _counter_snapshot(pool: _Pool) -> dict[str, int]:
    """Fault, drop and duplicate-window counters of the switch and the nodes (nodes summed)."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.core import counters_from_payload

    out = dict.fromkeys(SNAPSHOT_KEYS, 0)
    with ControlClient.for_cluster(pool.info) as admin:
        try:
            reply = admin.request(pool.control, Packet(Opcode.COUNTERS, rkey=pool.info.admin_key))
            switch = counters_from_payload(reply.payload)
            for port in switch["ports"]:
                out["switch_fault_drops"] += port["fault_drops_rx"] + port["fault_drops_tx"]
                out["switch_fault_dups"] += port["fault_dups"]
                out["switch_fault_held"] += port["fault_held"]
            out["switch_kernel_drops"] = int(switch["kernel_drops"])
            out["switch_other_drops"] = (
                int(switch["drops"]) - int(switch["drop_fault"]) - out["switch_kernel_drops"]
            )
            for node in pool.info.nodes:
                values = admin.counters(node.endpoint)
                named = C.counters_to_dict(values)
                out["node_dup_replays"] += int(values[C.DUP_REPLAYS])
                out["node_dup_silent"] += int(values[C.DUP_SILENT])
                out["node_stale_nacks"] += int(values[C.NACK_BASE + int(Status.STALE)])
                out["node_fault_drops"] += int(values[C.DROP_FAULT])
                out["node_kernel_drops"] += int(values[C.KERNEL_DROPS])
                out["node_other_drops"] += (
                    int(named["drops"]) - int(values[C.DROP_FAULT]) - int(values[C.KERNEL_DROPS])
                )
        except ControlError as exc:
            raise SoakFailure(f"could not read the switch's and nodes' counters: {exc}") from None
    return out


def _settings(config: SoakConfig, vip: Endpoint) -> ClientSettings:
    return ClientSettings(
        vip,
        config.pipeline,
        config.timeout_ms / 1000.0,
        config.retries,
        config.mix,
        config.reply_faults(),
        config.quiesce_s,
    )


def _reset_counter(
    pool: _Pool, layout: SoakLayout, settings: ClientSettings, verifier_id: int
) -> int:
    with PoolClient(
        pool.vip,
        client_id=verifier_id,
        timeout=settings.timeout_s,
        retries=settings.retries,
        tag_keys=tag_keys_of(layout.counter_region),
    ) as client:
        try:
            client.write(layout.counter_addr, bytes(8), layout.counter_region.rkey)
            return int.from_bytes(
                client.read(layout.counter_addr, 8, layout.counter_region.rkey), "little"
            )
        except PoolError as exc:
            raise SoakFailure(
                f"could not reset the shared counter at 0x{layout.counter_addr:x}: {exc}"
            ) from None


def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Run the soak; the result's ``ok`` is False when any error count is non-zero, and
    ``error`` is set when the run itself failed (then the counts are null)."""
    try:
        return _run(config)
    except SoakFailure as exc:
        return {**_empty_result(config), "ok": False, "error": str(exc), "run_failed": True}


def _run(config: SoakConfig) -> dict[str, Any]:
    if config.cluster is not None:
        _check_cluster_file(config.cluster)
    children = _Children(config.clients)  # their imports overlap the cluster's start-up
    try:
        with _pool_cluster(config) as pool:
            return _run_on(config, pool, children)
    finally:
        children.stop()


def _run_on(config: SoakConfig, pool: _Pool, children: _Children) -> dict[str, Any]:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import PoolController

    controller = PoolController(pool.path)
    allocated: list[Region] = []
    phases = {"setup": time.monotonic()}
    try:
        layout = _allocate(controller, config, len(pool.info.nodes), allocated)
        settings = _settings(config, pool.vip)
        verifier = client_ids(config.seed, config.clients + 1)[-1]
        initial = _reset_counter(pool, layout, settings, verifier)
        before = _counter_snapshot(pool)
        reports = _run_clients(children, layout, settings, config.seconds, phases)
        after = _counter_snapshot(pool)
        if config.tamper is not None:
            config.tamper(layout, pool.info)
        phases["check"] = time.monotonic()
        final = _verify(pool, layout, reports, settings, verifier)
        phases["end"] = time.monotonic()
    finally:
        if not pool.own:
            _free(controller, allocated)
    observed = {k: after[k] - before[k] for k in after}
    result = _summarize(config, pool, layout, reports, initial, final, observed)
    result["setup_seconds"] = round(phases["go"] - phases["setup"], 3)
    result["check_seconds"] = round(phases["end"] - phases["check"], 3)
    return result


def _free(controller: PoolController, regions: list[Region]) -> None:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError as AllocError

    for region in regions:
        with contextlib.suppress(AllocError):
            controller.free(region.gaddr)


def _empty_result(config: SoakConfig) -> dict[str, Any]:
    keys = (
        "ops",
        "ops_per_second",
        "lost_writes",
        "corrupt_reads",
        "counter_error",
        "errors",
        "counter_old_value_errors",
        "unconfirmed_writes",
        "unconfirmed_increments",
    )
    return {
        "ok": False,
        **dict.fromkeys(keys),
        "clients": config.clients,
        "seconds": config.seconds,
    }


def _summarize(
    config: SoakConfig,
    pool: _Pool,
    layout: SoakLayout,
    reports: list[ClientReport],
    initial: int,
    final: FinalCheck,
    observed: dict[str, int],
) -> dict[str, Any]:
    counts = {k: sum(r.counts[k] for r in reports) for k in reports[0].counts}
    olds = np.concatenate([r.olds for r in reports]) if reports else np.zeros(0, np.uint64)
    counter = check_counter(initial, final.counter, olds, counts["unconfirmed_increments"])
    ops = counts["reads"] + counts["writes"] + counts["fetch_adds"]
    seconds = max((r.seconds for r in reports), default=0.0)
    lost = sum(r.book.lost_writes for r in reports)
    corrupt = sum(r.book.corrupt_reads for r in reports)
    errors = counts["failed_ops"] + final.failed_reads
    ok = (
        lost == 0
        and corrupt == 0
        and errors == 0
        and counter["counter_error"] == 0
        and counter["counter_old_value_errors"] == 0
    )
    injected = {k: sum(r.injected[k] for r in reports) for k in reports[0].injected}
    return {
        "ok": ok,
        "ops": ops,
        "ops_per_second": round(ops / seconds, 1) if seconds else None,
        "lost_writes": lost,
        "corrupt_reads": corrupt,
        "counter_error": counter.pop("counter_error"),
        "errors": errors,
        "counter_old_value_errors": counter.pop("counter_old_value_errors"),
        "unconfirmed_writes": counts["unconfirmed_writes"],
        "unconfirmed_increments": counts["unconfirmed_increments"],
        "counter": counter,
        "reads": counts["reads"],
        "writes": counts["writes"],
        "fetch_adds": counts["fetch_adds"],
        "verified_blocks": final.blocks,
        "verified_bytes": final.bytes,
        "latency_us": {
            op.name.lower(): latency_summary(
                np.concatenate([r.latency_us[int(op)] for r in reports])
            )
            for op in KINDS
        },
        "retransmits": sum(r.retransmits for r in reports),
        "clients": config.clients,
        "seconds": round(seconds, 3),
        "nodes": len(pool.info.nodes),
        "pipeline": config.pipeline,
        "seed": config.seed,
        "faults": {
            "loss": config.loss,
            "dup": config.dup,
            "reorder": config.reorder,
            "delay_ms": config.delay_ms,
            "delay_prob": config.delay_prob if config.delay_ms else 0.0,
            "links": pool.fault_links,
        },
        "injected": {
            "client_recv": injected,
            **{k: v for k, v in observed.items() if k.startswith("switch_fault")},
        },
        "switch_counters": {
            k[7:]: v for k, v in observed.items() if k.startswith("switch_") and "fault" not in k
        },
        "node_counters": {k[5:]: v for k, v in observed.items() if k.startswith("node_")},
        "regions": [
            {
                "client": p.index,
                "gaddr": p.gaddr,
                "size": p.size,
                "stride": p.stride,
                "ways": p.ways,
                "blocks": len(p.blocks),
            }
            for p in layout.plans
        ],
        "counter_addr": layout.counter_addr,
        "startup_seconds": round(pool.startup_seconds, 3),
        "cluster": str(pool.path) if not pool.own else None,
        "error_samples": ([s for r in reports for s in r.error_samples] + final.messages)[
            :ERROR_SAMPLES
        ],
    }


# ---------------------------------------------------------------- tampering (self-tests)


def _node_memory(info: ClusterFile, rank: int) -> np.ndarray:

    return attach(info.nodes[rank].memory_file)


def flip_block_byte(layout: SoakLayout, info: ClusterFile, client: int, block: int) -> None:
    """Corrupt one byte of a client's block in node memory, out of band (host store)."""
    offset, _ = layout.plans[client].blocks[block]
    rank, local = layout.regions[client].locate(offset)
    memory = _node_memory(info, rank)
    memory[local] ^= 0xFF
    memory.flush()  # type: ignore[attr-defined]  # an np.memmap, typed as the ndarray it views


def bump_counter(layout: SoakLayout, info: ClusterFile, amount: int) -> None:
    """Add *amount* to the shared counter out of band (a phantom increment)."""
    rank, local = layout.counter_region.locate(layout.counter_addr - layout.counter_region.gaddr)
    memory = _node_memory(info, rank)
    value = int.from_bytes(memory[local : local + 8].tobytes(), "little") + amount
    memory[local : local + 8] = np.frombuffer((value % (1 << 64)).to_bytes(8, "little"), np.uint8)
    memory.flush()  # type: ignore[attr-defined]  # an np.memmap, typed as the ndarray it views
