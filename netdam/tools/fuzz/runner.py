"""The fuzz engine behind ``netdam fuzz`` (SPEC.md 5 and 12): start a private cluster, send the
datagrams ``generator.DatagramGenerator`` makes in rounds behind PING barriers, check memory,
counters and liveness against ``oracle.Oracle``, and return the result object. The CLI
(``netdam/cli/fuzz.py``) only parses arguments and prints it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import ClusterStartError, LocalCluster, start_cluster
from netdam.kernels import udp_io
from netdam.outcome import CommandError, ExitCode
from netdam.protocol import counters as C
from netdam.protocol.constants import REPLY_OPCODES, Opcode, Rights, Status
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import Endpoint, Packet, decode_packet, endpoint_to_u64
from netdam.shell.shm import attach
from netdam.shell.udp import open_udp_socket
from netdam.tools.fuzz.generator import (
    NODE_PLAN_BYTES,
    POOL_PLAN,
    TARGETS,
    DatagramGenerator,
    Layout,
    header,
    node_region_plan,
    node_regions_of_pool,
)
from netdam.tools.fuzz.oracle import (
    CounterCheck,
    Expectation,
    MemoryGuard,
    Oracle,
    ProcessTraffic,
    counter_checks,
    uncertain_nacks,
    unreached,
)

#: Node memory of a fuzz cluster: small, so a snapshot comparison per round costs ~1 ms.
FUZZ_MEMORY = 1 << 20
#: Bytes of a bad reply quoted in the report: its header and the start of its payload.
_QUOTED = 96
#: How long a barrier waits for every process's INFO before re-sending the PING, and how many
#: times it re-sends before declaring a process unresponsive.
BARRIER_TIMEOUT_S = 1.0
BARRIER_RETRIES = 4
#: Receive buffer of the fuzzer's socket: 32 GRO runs of 64 KiB per call.
RECV_RUNS = 32
PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class FuzzConfig:
    target: str = "node"
    datagrams: int = 100_000
    seed: int = 1
    nodes: int = 2
    round_size: int = 512
    mtu: int = 9000
    memory: int = FUZZ_MEMORY
    #: Where round files go when a crash or memory violation needs reproducing.
    artifacts: Path | None = None
    progress: bool = True


def run_fuzz(config: FuzzConfig) -> dict[str, Any]:
    """Start a cluster, fuzz it, check it, stop it; the result object (``ok`` and friends)."""
    if config.target not in TARGETS:
        raise CommandError(f"unknown target {config.target!r}: give node or switch", ExitCode.USAGE)
    if config.memory < NODE_PLAN_BYTES:
        raise CommandError(
            f"node memory {config.memory} is too small: give at least {NODE_PLAN_BYTES}",
            ExitCode.USAGE,
        )
    try:
        # --no-guard: the fuzzer sends wrong keys and unvalidated READs on purpose (SPEC.md 12).
        cluster = start_cluster(
            config.nodes,
            memory=config.memory,
            mtu=config.mtu,
            switch=config.target == "switch",
            guard=False,
        )
    except (ClusterStartError, ValueError) as exc:
        raise CommandError(
            f"could not start the fuzz cluster: {exc}", ExitCode.RUN_FAILED
        ) from None
    with cluster:
        runner = FuzzRunner(config, cluster)
        try:
            return runner.run()
        finally:
            runner.close()


# ---------------------------------------------------------------- the runner


@dataclass
class _Round:
    """A round's datagrams, kept to write a reproducer."""

    index: int
    datagrams: list[tuple[bytes, int, str]] = field(default_factory=list)


class FuzzRunner:
    """The I/O shell of one fuzz run on a started cluster."""

    def __init__(self, config: FuzzConfig, cluster: LocalCluster) -> None:
        self.config = config
        self.cluster = cluster
        self.admin = ControlClient.for_cluster(cluster.info)
        self.sock = open_udp_socket(("127.0.0.1", 0))
        self.third = open_udp_socket(("127.0.0.1", 0), gro=False)
        self.third.setblocking(False)
        self.io_state = udp_io.new_state()
        self.scratch = udp_io.new_send_scratch()
        self.rbuf = np.zeros(RECV_RUNS * udp_io.RUN_BYTES, np.uint8)
        self.roffs = np.zeros(RECV_RUNS * 64, np.int64)
        self.rlens = np.zeros(RECV_RUNS * 64, np.int32)
        self.rsrcs = np.zeros(RECV_RUNS * 64, np.uint64)
        self.sync_client = int(np.random.default_rng([config.seed, 7]).integers(1, 1 << 32)) | 1
        self.bad_replies: list[str] = []
        self.foreign = 0
        self.read_mismatches = 0
        self.crashed: list[str] = []
        self.repro_file: str | None = None
        self._barrier_seen: set[int] = set()

    def close(self) -> None:
        self.admin.close()
        self.sock.close()
        self.third.close()

    # ------------------------------------------------------------ setup

    def setup(self) -> Layout:
        """Regions with known rkeys, the multicast group (switch), then the Layout."""
        nodes = tuple(self.cluster.endpoints)
        third = self.third.getsockname()
        third_ep: Endpoint = (third[0], third[1])
        try:
            if self.config.target == "node":
                plan = node_region_plan(self.config.memory, self.config.seed)
                for node in nodes:
                    for region in plan:
                        self.admin.register(
                            node, region.base, region.size, Rights(region.rights), rkey=region.rkey
                        )
                return Layout(
                    "node",
                    nodes,
                    tuple(plan for _ in nodes),
                    self.config.memory,
                    self.config.mtu,
                    third_party=third_ep,
                    admin_tagged=True,
                )
            return self._setup_pool(nodes, third_ep)
        except ControlError as exc:
            raise CommandError(f"fuzz setup refused: {exc}", ExitCode.RUN_FAILED) from None

    def _setup_pool(self, nodes: tuple[Endpoint, ...], third: Endpoint) -> Layout:
        # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
        from netdam.switch.controller import ControllerError, PoolController

        assert self.cluster.switch is not None
        controller = PoolController(self.cluster.path)
        rng = np.random.default_rng([self.config.seed, 11])
        group: Endpoint = (
            f"239.77.{int(rng.integers(1, 255))}.{int(rng.integers(1, 255))}",
            int(rng.integers(1024, 65535)),
        )
        try:
            # Untagged (SPEC v1): the oracle predicts region access by rkey; tagged regions are
            # checked in tests/core/test_region_tags.py and the isolation campaign.
            pool = tuple(
                controller.alloc(
                    size, interleave=stride or None, rights=rights, tenant="fuzz", tagged=False
                )
                for size, stride, rights in POOL_PLAN
            )
            for node in nodes:
                controller.join(group, node)
        except ControllerError as exc:
            raise CommandError(f"fuzz setup refused: {exc}", ExitCode.RUN_FAILED) from None
        return Layout(
            "switch",
            nodes,
            node_regions_of_pool(pool, len(nodes)),
            self.config.memory,
            self.config.mtu,
            vip=self.cluster.switch.vip,
            pool=pool,
            group=group,
            group_members=tuple(range(len(nodes))),
            third_party=third,
            admin_tagged=True,
        )

    # ------------------------------------------------------------ counters

    def read_counters(self, layout: Layout) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per process: the node-layout counters, and (switch) forwarded, replicated."""
        values: list[np.ndarray] = []
        extra: list[np.ndarray] = []
        for entry in self.cluster.info.nodes:
            values.append(self.admin.counters(entry.control_endpoint).astype(np.int64))
            extra.append(np.zeros(0, np.int64))
        if layout.vip is not None:
            # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
            from netdam.switch.core import S_SW_BASE

            assert self.cluster.switch is not None
            reply = self.admin.request(
                self.cluster.switch.entry.control_endpoint,
                Packet(Opcode.COUNTERS, rkey=self.cluster.info.admin_key),
            )
            words = np.frombuffer(reply.payload, "<u8").astype(np.int64)
            values.append(words[: C.NUM_COUNTERS].copy())
            extra.append(words[S_SW_BASE : S_SW_BASE + 2].copy())
        return values, extra

    # ------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        layout = self.setup()
        self.layout = layout
        self.processes = layout.processes
        self.index_of = {endpoint_to_u64(ep): k for k, ep in enumerate(self.processes)}
        self.traffic = [ProcessTraffic() for _ in self.processes]
        self.reply_ops: Counter[int] = Counter()
        self.nack_statuses: Counter[int] = Counter()
        memories = [attach(n.memory_file) for n in self.cluster.info.nodes]
        rng = np.random.default_rng([self.config.seed, 3])
        for memory in memories:
            memory[:] = rng.integers(0, 256, memory.shape[0], dtype=np.uint8)
        self.guard = MemoryGuard(memories)
        before, before_extra = self._calibrate(layout)
        generator = DatagramGenerator(layout, self.config.seed)
        expect = Expectation()
        start = time.monotonic()
        sent, error = self._rounds(generator, Oracle(layout), expect, memories)
        seconds = time.monotonic() - start
        after, after_extra = before, before_extra
        if not error:
            try:
                after, after_extra = self.read_counters(layout)
            except ControlError as exc:
                error = f"counters after the run: {exc}"
        self._check_alive()
        self.guard.check(memories)
        misdirected = self._drain_third()
        deltas = [a - b for a, b in zip(after, before, strict=True)]
        extras = [a - b for a, b in zip(after_extra, before_extra, strict=True)]
        return self._result(
            layout, generator, expect, self.guard, deltas, extras, sent, seconds, misdirected, error
        )

    def _calibrate(self, layout: Layout) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The "before" counters, read twice: the difference is what one reading adds (its
        request on the management port, its reply if that leaves through the data socket),
        expected in the deltas too."""
        try:
            first, _ = self.read_counters(layout)
            before, before_extra = self.read_counters(layout)
        except ControlError as exc:
            raise CommandError(f"counters before the run: {exc}", ExitCode.RUN_FAILED) from None
        for t, a, b in zip(self.traffic, first, before, strict=True):
            t.overhead = b - a
        return before, before_extra

    def _rounds(
        self,
        generator: DatagramGenerator,
        oracle: Oracle,
        expect: Expectation,
        memories: list[np.ndarray],
    ) -> tuple[int, str]:
        """Send every round; (datagrams sent, why the run stopped early or '')."""
        config = self.config
        dst_u64 = [endpoint_to_u64(ep) for ep in self.layout.destinations]
        start = last_progress = time.monotonic()
        sent, rounds, error = 0, 0, ""
        pending: tuple[_Round, list[tuple[int, int, int]]] | None = self._make_round(
            0, min(config.round_size, config.datagrams), generator, oracle, expect
        )
        while pending is not None and not error:
            # Send round k, make round k+1 while the processes work, then wait for round k.
            current, writes = pending
            self.guard.authorize(writes)
            self._send([(data, dst_u64[dst]) for data, dst, _ in current.datagrams])
            sent += len(current.datagrams)
            left = config.datagrams - sent
            pending = (
                self._make_round(
                    rounds + 1, min(config.round_size, left), generator, oracle, expect
                )
                if left
                else None
            )
            error = self._barrier(rounds)
            if self.guard.check(memories) and self.repro_file is None:
                self.repro_file = self._save_round(current, "memory violation")
            if error and self.repro_file is None:
                self.repro_file = self._save_round(current, error)
            rounds += 1
            now = time.monotonic()
            if config.progress and now - last_progress >= PROGRESS_EVERY_S:
                last_progress = now
                print(
                    f"netdam fuzz: {sent}/{config.datagrams} datagrams ({sent / (now - start):,.0f}/s)",
                    file=sys.stderr,
                    flush=True,
                )
        if not error:
            # Twice, apart: a chain hop forwarded just before the first barrier lands by the second.
            error = self._barrier(rounds)
            time.sleep(0.02)
            error = error or self._barrier(rounds + 1)
        return sent, error

    def _make_round(
        self, index: int, n: int, generator: DatagramGenerator, oracle: Oracle, expect: Expectation
    ) -> tuple[_Round, list[tuple[int, int, int]]]:
        """Generate a round and its expectation; the writes it may make (authorized when sent)."""
        current = _Round(index)
        writes: list[tuple[int, int, int]] = []
        for dg in generator.batch(n):
            outcome = oracle.outcome(dg.data, dg.dst)
            expect.add(dg.data, outcome)
            writes += outcome.writes
            current.datagrams.append((dg.data, dg.dst, dg.kind))
        return current, writes

    def _send(self, items: list[tuple[bytes, int]]) -> None:
        """Send datagrams in order (sendmmsg, GSO runs), waiting while the socket is full."""
        lens = np.array([len(d) for d, _ in items], np.int32)
        offs = np.zeros(len(items), np.int64)
        if len(items) > 1:
            offs[1:] = np.cumsum(lens[:-1])
        buf = np.zeros(max(int(lens.sum()), 1), np.uint8)
        joined = b"".join(d for d, _ in items)
        buf[: len(joined)] = np.frombuffer(joined, np.uint8)
        dsts = np.array([dst for _, dst in items], np.uint64)
        done = 0
        while done < len(items):
            done += int(
                udp_io.send_batch(
                    self.sock.fileno(),
                    buf,
                    offs[done:],
                    lens[done:],
                    dsts[done:],
                    len(items) - done,
                    self.scratch,
                    self.io_state,
                )
            )
            if done < len(items):
                self._receive(0)  # the other side may be waiting for us to drain replies

    def _barrier(self, token: int) -> str:
        """PING every process; wait for each one's INFO. '' when all answered, else why not.

        A process answers a PING only after everything it received before it (one socket, in
        order), so after the barrier no datagram of the round is waiting in a receive queue."""
        waiting = set(range(len(self.processes)))
        for _attempt in range(BARRIER_RETRIES + 1):
            pings = []
            for p in sorted(waiting):
                self.traffic[p].pings += 1
                ping = header(Opcode.PING, client=self.sync_client, txn=_sync_txn(token, p))
                pings.append((ping, endpoint_to_u64(self.processes[p])))
            self._send(pings)
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while waiting and time.monotonic() < deadline:
                self._receive(5)
                waiting = {p for p in waiting if _sync_txn(token, p) not in self._barrier_seen}
            if not waiting:
                return ""
            self._check_alive()
            if self.crashed:
                return "process died: " + ", ".join(self.crashed)
        names = ", ".join(self.layout.process_name(p) for p in sorted(waiting))
        self.crashed += [
            f"{self.layout.process_name(p)} (no answer to PING)" for p in sorted(waiting)
        ]
        return f"no answer to PING from {names} within {BARRIER_TIMEOUT_S * (BARRIER_RETRIES + 1):.0f} s"

    def _receive(self, timeout_ms: int) -> int:
        """Take every datagram waiting on the fuzzer's socket; decode and tally. Returns how many."""
        n = int(
            udp_io.recv_batch(
                self.sock.fileno(),
                self.rbuf,
                self.roffs,
                self.rlens,
                self.rsrcs,
                self.roffs.shape[0],
                timeout_ms,
                self.io_state,
            )
        )
        offs, lens, srcs = self.roffs[:n].tolist(), self.rlens[:n].tolist(), self.rsrcs[:n].tolist()
        for off, ln, src in zip(offs, lens, srcs, strict=True):
            self._on_reply(bytes(self.rbuf[off : off + ln]), int(src))
        return n

    def _on_reply(self, data: bytes, src: int) -> None:
        p = self.index_of.get(src, -1)
        if p < 0:
            self.foreign += 1
            return
        self.traffic[p].replies_received += 1
        try:
            reply = decode_packet(data)
        except RemoteProtocolError as exc:
            if len(self.bad_replies) < 8:
                self.bad_replies.append(
                    f"{self.layout.process_name(p)}: {exc}: {data[:_QUOTED].hex()}"
                )
            return
        if reply.opcode not in REPLY_OPCODES:
            if len(self.bad_replies) < 8:
                self.bad_replies.append(
                    f"{self.layout.process_name(p)}: sent {reply.opcode.name}, not a reply: {data[:_QUOTED].hex()}"
                )
            return
        self.reply_ops[int(reply.opcode)] += 1
        if reply.opcode == Opcode.READ_RESP and p < len(self.layout.nodes):
            if self.guard.read_matches(p, reply.addr, reply.payload) is False:
                self.read_mismatches += 1
                if len(self.bad_replies) < 8:
                    self.bad_replies.append(
                        f"{self.layout.process_name(p)}: READ_RESP of bytes nobody wrote differs from memory: {data[:_QUOTED].hex()}"
                    )
        if reply.opcode == Opcode.NACK:
            self.traffic[p].nacks_received[int(reply.status)] += 1
            self.nack_statuses[int(reply.status)] += 1
        elif reply.opcode == Opcode.INFO and reply.client_id == self.sync_client:
            self._barrier_seen.add(int(reply.txn_id))

    def _check_alive(self) -> None:
        procs = [(f"node{r}", p) for r, p in enumerate(self.cluster.processes)]
        if self.cluster.switch is not None:
            procs.append(("switch", self.cluster.switch.process))
        for name, proc in procs:
            code = proc.poll()
            label = f"{name} (pid {proc.pid}, exit code {code})"
            if code is not None and label not in self.crashed:
                self.crashed.append(label)

    def _answers_ping(self) -> list[str]:
        """Processes that do not answer PING on their data port (checked after the counters)."""
        silent = []
        for p, ep in enumerate(self.processes):
            try:
                self.admin.ping(ep, timeout=1.0)
            except ControlError:
                silent.append(self.layout.process_name(p))
        return silent

    def _drain_third(self) -> int:
        count = 0
        while True:
            try:
                self.third.recvfrom(65536)
            except BlockingIOError:
                return count
            count += 1

    def _save_round(self, current: _Round, why: str) -> str:
        directory = self.config.artifacts or Path(tempfile.gettempdir())
        directory.mkdir(parents=True, exist_ok=True)
        path = (
            directory
            / f"netdam-fuzz-{self.config.target}-seed{self.config.seed}-round{current.index}.txt"
        )
        lines = [
            f"# netdam fuzz --target {self.config.target} --seed {self.config.seed}: round {current.index}: {why}",
            "# destination (endpoint), kind, datagram hex; destinations in order of sending",
        ]
        for data, dst, kind in current.datagrams:
            ep = self.layout.destinations[dst]
            lines.append(f"{ep[0]}:{ep[1]} {kind} {data.hex()}")
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    # ------------------------------------------------------------ the result

    def _result(
        self,
        layout: Layout,
        generator: DatagramGenerator,
        expect: Expectation,
        guard: MemoryGuard,
        deltas: list[np.ndarray],
        extras: list[np.ndarray],
        sent: int,
        seconds: float,
        misdirected: int,
        error: str,
    ) -> dict[str, Any]:
        silent = self._answers_ping() if not self.crashed else []
        self.crashed += [f"{name} (no answer to PING)" for name in silent]
        kernel_drops = int(sum(int(d[C.KERNEL_DROPS]) for d in deltas))
        own_drops = int(self.io_state[udp_io.ST_KERNEL_DROPS])
        checks: list[CounterCheck] = []
        if not error:
            checks = counter_checks(
                layout, expect, deltas, extras, self.traffic, kernel_drops + own_drops
            )
        failed = [c.as_dict() for c in checks if not c.ok]
        reached: Counter[int] = Counter()
        for d, t in zip(deltas, self.traffic, strict=True):
            for op in Opcode:
                reached[int(op)] += int(d[C.OPCODE_BASE + op])
            reached[int(Opcode.PING)] -= t.pings
            reached[int(Opcode.COUNTERS)] -= int(t.overhead[C.OPCODE_BASE + Opcode.COUNTERS])
        missing = unreached(layout.target, reached, self.nack_statuses)
        stale = uncertain_nacks(expect, deltas)  # of the windowed and open: answered NACK
        kinds = expect.kinds
        send_errors = int(self.io_state[udp_io.ST_SEND_DROPPED])
        ok = not (
            error
            or self.crashed
            or guard.violation_bytes
            or failed
            or missing["opcodes"]
            or missing["statuses"]
            or misdirected
            or self.bad_replies
            or self.foreign
            or send_errors
            or self.read_mismatches
        )
        result: dict[str, Any] = {
            "ok": bool(ok),
            "target": layout.target,
            "nodes": len(layout.nodes),
            "seed": self.config.seed,
            "sent": sent,
            "mix": {k: int(generator.made[k]) for k in ("valid", "mutated", "repeated", "random")},
            "accepted": kinds["accepted"] + kinds["windowed"] - stale,
            "nacks": kinds["nack"] + stale,
            "drops": kinds["drop"],
            "by_opcode": {
                op.name: {
                    "sent": int(expect.sent_by_opcode[int(op)]),
                    "reached": int(reached[int(op)]),
                }
                for op in Opcode
            },
            "by_status": {Status(s).name: int(n) for s, n in sorted(self.nack_statuses.items())},
            "crashes": len(self.crashed),
            "crashed": self.crashed,
            "memory_violations": int(guard.violation_bytes),
            "violation_ranges": [{"node": n, "start": s, "end": e} for n, s, e in guard.ranges],
            "replies": int(sum(self.reply_ops.values())),
            "misdirected": misdirected,
            "bad_replies": len(self.bad_replies) + self.foreign - self.read_mismatches,
            "read_mismatches": self.read_mismatches,
            "unreached": missing,
            "counters_add_up": not failed and bool(checks),
            "counter_checks": len(checks),
            "counter_checks_failed": failed,
            "kernel_drops": {"processes": kernel_drops, "fuzzer": own_drops},
            "send_errors": send_errors,
            "seconds": seconds,
            "datagrams_per_second": sent / seconds if seconds > 0 else None,
            "startup_seconds": self.cluster.startup_seconds,
            "repro_file": self.repro_file,
        }
        if self.bad_replies:
            result["bad_reply_examples"] = self.bad_replies
        if error:
            result["error"] = error
        elif not ok:
            result["error"] = _why(result)
        return result


def _sync_txn(token: int, process: int) -> int:
    """Transaction id of a barrier PING: the round and the process (16 processes at most)."""
    return (token << 4 | process) & 0xFFFFFFFF


#: What each count of a failed run means, for the one-line reason (in the report's order).
_FAILURES = (
    ("crashes", "process(es) crashed or went silent"),
    ("memory_violations", "bytes changed outside every authorized write"),
    ("counter_checks_failed", "counter checks failed"),
    ("misdirected", "datagrams reached the third party"),
    ("bad_replies", "replies were not valid v1 replies"),
    ("read_mismatches", "READ_RESPs differ from memory nobody wrote"),
    ("send_errors", "datagrams could not be sent"),
)


def _why(result: dict[str, Any]) -> str:
    reasons = []
    for key, meaning in _FAILURES:
        count = len(result[key]) if isinstance(result[key], list) else result[key]
        if count:
            reasons.append(f"{count} {meaning}")
    missing = result["unreached"]
    if missing["opcodes"] or missing["statuses"]:
        reasons.append("never reached: " + ", ".join(missing["opcodes"] + missing["statuses"]))
    return "; ".join(reasons)
