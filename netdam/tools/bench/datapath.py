"""``netdam bench datapath``: a node's packet rate against a bare relay, in one run.

Four phases, in sequence, each measured for ``seconds`` after ``warmup`` (BRIEF section 6: "a
node's datapath: at least 90% of the packet rate of a bare relay that forwards the same
datagrams with the best batching this machine offers (GSO/GRO) and does no work, same run"):

1. ``feeder -> null sink``: how fast the feeder can offer load (``feeder_pps``, counted by the
   feeder). The run is only *valid* when the feeder outruns both others by 20%, or they would
   be measuring the feeder.
2. ``feeder -> relay -> sink``: a bare relay (GRO in, GSO out, no work) (``raw_pps``).
   ``ratio`` = node / relay: the compiled relay is the strictest bar.
2b. ``feeder -> Python relay -> sink``: the same relay written as a plain Python program would
   be (one ``recvmsg`` per GRO run, one ``sendmsg`` with ``UDP_SEGMENT`` per run, 7 x 8 KiB
   datagrams a call; :func:`py_relay_run`) (``py_relay_pps``; ``ratio_vs_py_relay``).
3. ``feeder -> node -> sink``: a real ``netdam node`` process executing CHAIN_ADD (add 2048 f32
   from its memory, forward to the next SR segment) (``node_pps``: datagrams the sink verified
   bitwise against ``payload + operand`` computed by numpy).

Every process is real and runs its hot loop in a numba kernel (``netdam.kernels.udp_io``):
feeder, relays and sinks are ``multiprocessing`` "spawn" children (the Python relay in plain
Python), the node is
``python -m netdam node``. Both phases 2 and 3 send the *same* datagrams (the CHAIN_ADD packets,
``datagram_bytes`` each) and the sink does the same work in both (a bitwise compare of every
payload with its expected value), so the ratio compares like with like. Counts come from the
processes (feeder and sink counters, the node's COUNTERS); the measurement window is
CLOCK_MONOTONIC, shared by all processes. Everything is bounded: children exit by themselves
after their budget or when the parent goes away, and the parent kills stragglers.

Two choices keep the ratio about the device under test (relay or node) rather than the
scheduler, measured on the 2-core reference machine:

- **Window pacing** (``window``, default 1024 datagrams in flight, the sink's running count
  shared through a memory-mapped file). UDP on loopback never paces a sender: what the
  receiver cannot take is dropped, and the sender pays for making it. An unpaced feeder burns a
  whole core producing drops, and the relay's rate then swung between 150 k and 260 k
  datagrams/s from run to run with about half the offered load dropped; window-paced it held
  320 k with no drops. ``window = 0`` restores the unpaced feeder.
- **Pinning** (``auto_pinning``): the device under test gets a CPU of its own, the same in
  both phases; feeder and sink share the other CPU on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from netdam.cluster.launch import warm_node_kernels
from netdam.cluster.secrets_io import key_pipe
from netdam.kernels import udp_io as U
from netdam.kernels.state import RxBatch, SinkCheck, TimeWindow, TxQueue
from netdam.outcome import ExitCode
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    SEGMENT_SIZE,
    DType,
    Flags,
    Opcode,
    Rights,
    largest_payload,
    slot_bytes,
)
from netdam.protocol.errors import NetdamError, RemoteProtocolError
from netdam.protocol.packet import Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import pack_key_rights
from netdam.shell.startup import CpuWatch, StartStalled, stall_reason, wait_while_working
from netdam.shell.udp import (
    SO_RXQ_OVFL,
    SOL_UDP,
    UDP_GRO,
    UDP_SEGMENT,
    check_mtu_fits,
    granted_buffers,
    max_payload,
    open_udp_socket,
)
from netdam.tools.bench.report import machine_info
from netdam.tools.workers import worker_context

LOOPBACK = "127.0.0.1"
#: rkey of the benchmark's region on the node.
BENCH_RKEY = 0x0BE4C401
#: Datagrams per feeder send batch: 8 GSO messages of 7 datagrams (7 x 8272 B < 64 KiB).
FEED_BATCH = 56
#: Receive batch of relay and sink: 64 GRO runs in one recvmmsg at most (4 MiB of buffer).
RECV_MAX_DATAGRAMS = 4096
RECV_BUFFER_BYTES = 64 << 16
#: How long a child waits for its next command before it gives up and exits.
CHILD_IDLE_SECONDS = 120.0
#: Slack after a phase's window before the parent declares a process hung.
PHASE_GRACE_SECONDS = 15.0
#: How long the sink keeps counting after the window (in-flight data; not counted as pps).
SINK_TAIL_SECONDS = 0.3


@dataclass
class DatapathBenchConfig:
    """Settings of one ``netdam bench datapath`` run."""

    seconds: float = 3.0
    warmup: float = 1.0
    #: Distinct CHAIN_ADD packets the feeder cycles through (a multiple of FEED_BATCH).
    packets: int = 224
    mtu: int = 9000
    seed: int = 1
    #: Command that starts one node process; None: this Python's ``-m netdam node``.
    node_cmd: list[str] | None = None
    #: Node memory (bytes): must hold ``packets`` operands.
    node_memory: int = 16 << 20
    #: Feeder pacing: at most this many datagrams in flight (sent, not yet counted by the
    #: sink); 0 = as fast as the socket takes them (see DEFAULT_WINDOW).
    window: int = 1024
    #: CPU per role ("feeder", "relay", "sink", "node"); None: auto_pinning(); {}: no pinning.
    pin: dict[str, int] | None = None


@dataclass
class _Workload:
    """The feeder's payloads, the node's operands and the sums the sink expects (all f32)."""

    elements: int
    payloads: np.ndarray  # (packets, elements) <f4
    operands: np.ndarray  # (packets, elements) <f4
    sums: np.ndarray  # (packets, elements) <f4
    #: The largest payload at the run's MTU (SPEC.md 2.7): what the codec lets a datagram carry.
    max_payload: int

    @property
    def payload_bytes(self) -> int:
        return self.elements * 4


def elements_per_packet(mtu: int) -> int:
    """f32 per CHAIN_ADD with a 2-segment SR list at *mtu* (SPEC.md 2.4)."""
    return int(min(largest_payload(mtu), max_payload(mtu) - HEADER_SIZE - 2 * SEGMENT_SIZE) // 4)


def _workload(seed: int, packets: int, mtu: int) -> _Workload:
    elements = elements_per_packet(mtu)
    rng = np.random.default_rng(seed)
    payloads = rng.uniform(-1.0, 1.0, (packets, elements)).astype("<f4")
    operands = rng.uniform(-1.0, 1.0, (packets, elements)).astype("<f4")
    sums = np.add(payloads, operands, dtype=np.float32)  # the node's SUM: out = payload + local
    return _Workload(elements, payloads, operands, sums, largest_payload(mtu))


def _chain_packet(
    k: int, w: _Workload, node: tuple[str, int], sink: tuple[str, int], tag: int = 1
) -> bytes:
    """CHAIN_ADD k: at the node (segments_left 1) add operand k and forward to the sink. Its
    seq is ``tag << SEQ_TAG_SHIFT | k``: the sink finds row k by it and, by the tag, which
    phase sent it (udp_io._sink_run)."""
    nbytes = w.payload_bytes
    data: bytes = encode_packet(
        Packet(
            opcode=Opcode.CHAIN_ADD,
            seq=tag << U.SEQ_TAG_SHIFT | k,
            rkey=BENCH_RKEY,
            length=nbytes,
            addr=k * nbytes,
            aux_addr=k * nbytes,
            dtype=DType.F32,
            segments_left=1,
            segments=(node, sink),
            payload=w.payloads[k].tobytes(),
        ),
        w.max_payload,
    )
    return data


# ---------------------------------------------------------------- child processes


def _worker(role: str, conn: Connection, params: dict[str, Any]) -> None:
    """Entry point of a spawned child: warm its kernel, report ready, run phases on command."""
    started = time.monotonic()
    parent = os.getppid()
    try:
        pinned = params.get("pin", {}).get(role)
        if pinned is not None:
            os.sched_setaffinity(0, {pinned})

        if role == "feeder":
            sock = open_udp_socket((LOOPBACK, 0), rcvbuf=1 << 20, gro=False)
        else:
            sock = open_udp_socket((LOOPBACK, 0), rcvbuf=params["rcvbuf"])
        fd = sock.fileno()
        state = U.new_state()
        scratch = U.new_send_scratch()
        counts = np.zeros(U.COUNTS_LEN, np.int64)
        buf = np.zeros(RECV_BUFFER_BYTES, np.uint8)
        buf64 = buf.view(np.uint64)
        offs = np.zeros(RECV_MAX_DATAGRAMS, np.int64)
        lens = np.zeros(RECV_MAX_DATAGRAMS, np.int32)
        addrs = np.zeros(RECV_MAX_DATAGRAMS, np.uint64)
        w = _workload(params["seed"], params["packets"], params["mtu"])
        # The sink's running receive count, shared with the feeder (window pacing).
        progress = np.memmap(params["progress_file"], dtype=np.int64, mode="r+", shape=(8,))
        expect = {
            "raw": np.ascontiguousarray(w.payloads).view(np.uint64),
            "node": np.ascontiguousarray(w.sums).view(np.uint64),
        }
        # Load (or compile) the kernel now, with the argument types of the real run.
        if role == "feeder":
            U.feed_run(
                fd,
                TxQueue(buf, offs, lens, addrs, slot_bytes(params["mtu"])),
                0,
                1,
                scratch,
                state,
                0,
                0,
                counts,
                progress,
                0,
                0,
            )
        elif role == "relay":
            U.relay_run(
                fd,
                buf,
                offs,
                lens,
                addrs,
                addrs.copy(),
                RECV_MAX_DATAGRAMS,
                scratch,
                state,
                np.uint64(0),
                0,
                counts,
            )
        elif role == "pyrelay":
            pass  # plain Python: nothing to compile
        else:
            U.sink_run(
                fd,
                RxBatch(buf, offs, lens, addrs),
                buf64,
                RECV_MAX_DATAGRAMS,
                state,
                SinkCheck(expect["raw"], 0, 0, False, 1),
                TimeWindow(0, 0, 0),
                counts,
                progress,
            )
        conn.send(
            (
                "ready",
                {
                    "port": sock.getsockname()[1],
                    "startup_seconds": time.monotonic() - started,
                    "buffers": granted_buffers(sock),
                },
            )
        )
        while True:
            command = _next_command(conn, parent)
            if command is None or command[0] == "exit":
                return
            cmd = command[1]
            counts[:] = 0
            before = state.copy()
            t_start, t_end, t_stop = int(cmd["t_start"]), int(cmd["t_end"]), int(cmd["t_stop"])
            # Each phase runs in three calls (until t_start, t_end, t_stop) so the CPU time
            # spent inside the measurement window can be read between them.
            cpu: list[float] = []
            if role == "feeder":
                first_hop = (LOOPBACK, int(cmd["first_hop"]))
                node_ep = (LOOPBACK, int(cmd["node"]))
                sink_ep = (LOOPBACK, int(cmd["sink"]))
                tag = int(cmd["tag"])
                pkt = [_chain_packet(k, w, node_ep, sink_ep, tag) for k in range(params["packets"])]
                size = len(pkt[0])
                fbuf = np.frombuffer(b"".join(pkt), np.uint8).copy()
                n = len(pkt)
                foffs = np.arange(n, dtype=np.int64) * size
                flens = np.full(n, size, np.int32)
                fdsts = np.full(n, endpoint_to_u64(first_hop), np.uint64)
                counts[U.FEED_PROGRESS_BASE] = progress[0]
                i0 = 0
                for until in (t_start, t_end):
                    cpu.append(_cpu_now())
                    i0 = U.feed_run(
                        fd,
                        TxQueue(fbuf, foffs, flens, fdsts, slot_bytes(params["mtu"])),
                        n,
                        FEED_BATCH,
                        scratch,
                        state,
                        t_start,
                        until,
                        counts,
                        progress,
                        int(cmd["window"]),
                        i0,
                    )
                cpu.append(_cpu_now())
            elif role == "relay":
                dsts = np.zeros(RECV_MAX_DATAGRAMS, np.uint64)
                dst = np.uint64(endpoint_to_u64((LOOPBACK, int(cmd["dst"]))))
                in_window = 0
                for until in (t_start, t_end, t_stop):
                    cpu.append(_cpu_now())
                    sent = counts[U.RELAY_TX]
                    U.relay_run(
                        fd,
                        buf,
                        offs,
                        lens,
                        addrs,
                        dsts,
                        RECV_MAX_DATAGRAMS,
                        scratch,
                        state,
                        dst,
                        until,
                        counts,
                    )
                    if until == t_end:
                        in_window = int(counts[U.RELAY_TX] - sent)
                cpu.append(_cpu_now())
                counts[U.RELAY_TX_IN_WINDOW] = in_window
            elif role == "pyrelay":
                dst_ep = (LOOPBACK, int(cmd["dst"]))
                in_window = 0
                for until in (t_start, t_end, t_stop):
                    cpu.append(_cpu_now())
                    sent = py_relay_run(sock, dst_ep, until, state)
                    counts[U.RELAY_TX] += sent
                    if until == t_end:
                        in_window = sent
                cpu.append(_cpu_now())
                counts[U.RELAY_TX_IN_WINDOW] = in_window
            else:
                mode = cmd["mode"]
                table = expect["node" if mode == "node" else "raw"]
                size = HEADER_SIZE + 2 * SEGMENT_SIZE + w.payload_bytes
                for until in (t_start, t_end, t_stop):
                    cpu.append(_cpu_now())
                    U.sink_run(
                        fd,
                        RxBatch(buf, offs, lens, addrs),
                        buf64,
                        RECV_MAX_DATAGRAMS,
                        state,
                        SinkCheck(
                            table,
                            size,
                            HEADER_SIZE + 2 * SEGMENT_SIZE,
                            mode != "null",
                            int(cmd["tag"]),
                        ),
                        TimeWindow(t_start, t_end, until),
                        counts,
                        progress,
                    )
                cpu.append(_cpu_now())
            conn.send(
                (
                    "done",
                    {
                        "counts": counts.tolist(),
                        "state": (state - before).tolist(),
                        "kernel_drops": int(state[U.ST_KERNEL_DROPS]),
                        "cpu_window": cpu[2] - cpu[1],
                        "cpu_total": cpu[-1] - cpu[0],
                    },
                )
            )
    except BaseException as exc:  # report and exit: the parent turns it into `error`
        with contextlib.suppress(Exception):
            conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))


#: Ancillary space on recvmsg for both control messages the socket may get, each an int:
#: SO_RXQ_OVFL (open_udp_socket turns it on; the kernel adds it, first, once the socket has
#: dropped anything) and UDP_GRO. Room for one only truncates UDP_GRO away after the first
#: drop (MSG_CTRUNC), and the relay then took a run of 7 datagrams for one 57904-byte datagram.
_RECV_CMSG_SPACE = 2 * socket.CMSG_SPACE(4)


def py_relay_run(
    sock: socket.socket, dst: tuple[str, int], until_ns: int, state: np.ndarray
) -> int:
    """Forward datagrams from *sock* to *dst* until ``time.monotonic_ns() >= until_ns`` as a
    plain Python program would, with the kernel's batching: one recvmsg takes a GRO run
    (up to 64 KiB of coalesced datagrams, udp(7)) and one sendmsg hands it back whole with
    UDP_SEGMENT, so a run of 7 x 8 KiB datagrams costs two system calls and no work in
    Python. Returns the datagrams sent; counts calls and runs in *state* like the compiled
    relay (udp_io's ST_* slots)."""
    sock.settimeout(0.02)
    sent = 0
    while time.monotonic_ns() < until_ns:
        try:
            data, ancdata, flags, _addr = sock.recvmsg(1 << 16, _RECV_CMSG_SPACE)
        except (TimeoutError, BlockingIOError, InterruptedError):
            continue
        state[U.ST_RECV_CALLS] += 1
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            # Without the whole run or its UDP_GRO size the datagram boundaries are unknown:
            # dropped (and counted) rather than forwarded as one merged datagram.
            state[U.ST_TRUNCATED] += 1
            continue
        segment = len(data)
        for level, kind, value in ancdata:
            if level == SOL_UDP and kind == UDP_GRO and len(value) >= 4:
                segment = int.from_bytes(value[:4], sys.byteorder)
            elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(value) >= 4:
                state[U.ST_KERNEL_DROPS] = int.from_bytes(value[:4], sys.byteorder)
        n = -(-len(data) // segment) if segment else 0
        state[U.ST_RX_DATAGRAMS] += n
        try:
            if n > 1:
                state[U.ST_GRO_RUNS] += 1
                state[U.ST_GSO_RUNS] += 1
                sock.sendmsg(
                    [data], [(SOL_UDP, UDP_SEGMENT, segment.to_bytes(2, sys.byteorder))], 0, dst
                )
            else:
                sock.sendto(data, dst)
        except (BlockingIOError, TimeoutError, InterruptedError):
            state[U.ST_SEND_DROPPED] += n
            continue
        except OSError:  # ENOBUFS and the like: counted, as the compiled relay counts them
            state[U.ST_SEND_DROPPED] += n
            continue
        state[U.ST_SEND_CALLS] += 1
        state[U.ST_TX_DATAGRAMS] += n
        sent += n
    return sent


def _cpu_now() -> float:
    """CPU seconds (user + system) this process has used."""
    t = os.times()
    return t.user + t.system


def _next_command(conn: Connection, parent: int) -> tuple[str, dict[str, Any]] | None:
    """Wait for the parent's next command; None when it is gone or silent too long."""
    deadline = time.monotonic() + CHILD_IDLE_SECONDS
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return None
        try:
            if conn.poll(0.5):
                message: tuple[str, dict[str, Any]] = conn.recv()
                return message
        except (EOFError, OSError):
            return None
    return None


class _Child:
    """One spawned child and its pipe."""

    def __init__(self, ctx: Any, role: str, params: dict[str, Any]) -> None:
        self.role = role
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(role, child_conn, params), name=f"netdam-bench-{role}"
        )
        self.proc.daemon = True
        self.proc.start()
        child_conn.close()
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        """The child's ready message, waited for as long as the child works (a first run
        compiles its kernels; netdam.shell.startup)."""
        assert self.proc.pid is not None
        try:
            wait_while_working(self.proc.pid, self.conn.poll, f"{self.role} process")
        except StartStalled as exc:
            raise _BenchFailure(str(exc)) from None
        return self.expect("ready", 0)

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        """The child's next message, which must be *kind*; raises _BenchFailure otherwise."""
        if not self.conn.poll(timeout):
            code = self.proc.exitcode
            what = f"exited with code {code}" if code is not None else "did not answer"
            raise _BenchFailure(f"{self.role} process {what} within {timeout:.0f} s")
        try:
            tag, body = self.conn.recv()
        except (EOFError, OSError):
            raise _BenchFailure(
                f"{self.role} process died (exit code {self.proc.exitcode})"
            ) from None
        if tag == "error":
            raise _BenchFailure(str(body))
        if tag != kind:
            raise _BenchFailure(f"{self.role} process sent {tag!r}, expected {kind!r}")
        result: dict[str, Any] = body
        return result

    def send(self, message: tuple[str, dict[str, Any]]) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            raise _BenchFailure(f"{self.role} process is gone") from None

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("exit", {}))
        self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)
        self.conn.close()


class _BenchFailure(NetdamError):
    """A process failed or timed out: the run reports `error` and exits 3."""


# ---------------------------------------------------------------- the node process


class _NodeProcess:
    """``netdam node`` as a subprocess, driven over the wire (REGISTER, WRITE, COUNTERS)."""

    def __init__(self, cmd: list[str], sink_port: int, mtu: int, memory: int, shm_dir: str) -> None:
        self.admin_key = secrets.randbits(31) | 1
        key_fd = key_pipe(self.admin_key)  # the key through a pipe: never on a command line
        port = _free_port()
        self.argv = cmd + [
            "--bind",
            f"{LOOPBACK}:{port}",
            "--memory",
            f"{memory}B",
            "--members",
            f"{LOOPBACK}:{sink_port}",
            "--admin-key-fd",
            str(key_fd),
            "--shm-dir",
            shm_dir,
            "--name",
            "bench-node",
            "--mtu",
            str(mtu),
        ]
        self.stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                pass_fds=(key_fd,),
                start_new_session=True,  # our Ctrl-C does not reach it; we stop it ourselves
            )
        finally:
            os.close(key_fd)
        self.port = 0
        self._ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._ctl.bind((LOOPBACK, 0))
        self._txn = 0

    def wait_ready(self) -> None:
        """Its ``ready`` line, waited for as long as the node works (netdam.shell.startup)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        watch = CpuWatch(self.proc.pid)
        started = time.monotonic()
        data = b""
        while b"\n" not in data:
            reason = stall_reason(watch, started, time.monotonic())
            if reason is not None:
                raise _BenchFailure(
                    f"node process (pid {self.proc.pid}) {reason} before its 'ready' line; "
                    f"its stderr ends: {self.stderr_tail()}"
                )
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise _BenchFailure(
                        f"node process exited (code {self.proc.wait(5)}) before 'ready'; "
                        f"its stderr ends: {self.stderr_tail()}"
                    )
                data += chunk
        line = data.split(b"\n", 1)[0].decode(errors="replace").strip()
        words = line.split()
        try:
            if words[0] != "ready":
                raise ValueError(line)
            self.port = int(words[1].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            raise _BenchFailure(
                f"node process printed {line!r}, expected 'ready <ip>:<port> ...'"
            ) from None
        # Drain whatever else it prints, so a chatty node never blocks on a full pipe.
        threading.Thread(target=_drain, args=(fd,), daemon=True).start()

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-800:].decode(errors="replace").strip()

    def request(
        self,
        packet: Packet,
        timeout: float = 2.0,
        tries: int = 5,
        max_payload: int = MAX_PAYLOAD_BYTES,
    ) -> Packet:
        """Send a control/data request (client 1, next txn) and return its ACK; NACK raises.
        *max_payload*: the run's largest payload (SPEC.md 2.7)."""
        self._txn += 1
        packet = Packet(**{**packet.__dict__, "client_id": 1, "txn_id": self._txn})
        data = encode_packet(packet, max_payload)
        for _ in range(tries):
            self._ctl.sendto(data, (LOOPBACK, self.port))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ctl.settimeout(left)
                try:
                    reply_data = self._ctl.recv(65536)
                except TimeoutError:
                    break
                try:
                    reply = decode_packet(reply_data)
                except RemoteProtocolError:
                    continue
                if reply.txn_id != self._txn:
                    continue
                if reply.opcode == Opcode.NACK:
                    raise _BenchFailure(
                        f"node answered {packet.opcode.name} with NACK {reply.status.name}"
                    )
                return reply
        raise _BenchFailure(f"node did not answer {packet.opcode.name} after {tries} tries")

    def setup_region(self, w: _Workload, packets: int) -> None:
        """REGISTER the operand region and WRITE every operand (ACKed)."""
        nbytes = w.payload_bytes
        self.request(
            Packet(
                opcode=Opcode.REGISTER,
                rkey=self.admin_key,
                length=8,
                addr=0,
                aux_addr=packets * nbytes,
                payload=pack_key_rights(BENCH_RKEY, int(Rights.READ | Rights.WRITE)),
            )
        )
        for k in range(packets):
            self.request(
                Packet(
                    opcode=Opcode.WRITE,
                    flags=Flags.ACK_REQ,
                    rkey=BENCH_RKEY,
                    length=nbytes,
                    addr=k * nbytes,
                    dtype=DType.F32,
                    payload=w.operands[k].tobytes(),
                ),
                max_payload=w.max_payload,
            )

    def counters(self) -> np.ndarray:
        reply = self.request(Packet(opcode=Opcode.COUNTERS, rkey=self.admin_key))
        values: np.ndarray = np.frombuffer(reply.payload, "<u8").astype(np.uint64)
        return values

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctl.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        if self.proc.stdout is not None:
            with contextlib.suppress(Exception):
                self.proc.stdout.close()
        self.stderr.close()


def _drain(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def default_node_cmd() -> list[str]:
    """How the benchmark starts a node: this interpreter running ``netdam node`` (same package), which
    exits by itself if the benchmark dies (no orphans)."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cluster.launch import netdam_python

    return [*netdam_python(), "node", "--die-with-parent"]


def parse_node_cmd(text: str) -> list[str]:
    """--node-cmd: a shell-quoted command line."""
    return shlex.split(text)


# ---------------------------------------------------------------- the run


@dataclass
class _Run:
    cfg: DatapathBenchConfig
    result: dict[str, Any] = field(default_factory=dict)
    children: dict[str, _Child] = field(default_factory=dict)
    node: _NodeProcess | None = None


#: Each phase's seq tag (udp_io.SEQ_TAG_SHIFT), increasing in the order the phases run: a sink
#: counts a datagram with an earlier phase's tag as stale, not as a mismatch.
PHASE_TAGS = {"feeder": 1, "raw": 2, "py_relay": 3, "node": 4}


def _phase(
    run: _Run,
    name: str,
    first_hop: int,
    node_port: int,
    sink_mode: str,
    relay_dst: int | None,
    relay_role: str = "relay",
) -> dict[str, Any]:
    """Run one phase: every involved process gets the same window; return their reports, and
    record in ``cpu`` how busy each was inside the window, and the sink's mismatches and stale
    datagrams in ``mismatches_by_phase`` and ``stale_datagrams``."""
    cfg = run.cfg
    feeder, sink = run.children["feeder"], run.children["sink"]
    sink_port = sink.info["port"]
    now = time.monotonic_ns()
    t_start = now + int(0.2e9) + int(cfg.warmup * 1e9)
    t_end = t_start + int(cfg.seconds * 1e9)
    t_stop = t_end + int(SINK_TAIL_SECONDS * 1e9)
    window = {"t_start": t_start, "t_end": t_end, "t_stop": t_stop}
    budget = (t_stop - now) / 1e9 + PHASE_GRACE_SECONDS
    tag = PHASE_TAGS[name]
    sink.send(("run", {"mode": sink_mode, "tag": tag, **window}))
    relay = run.children.get(relay_role) if relay_dst is not None else None
    if relay is not None:
        relay.send(("run", {"dst": relay_dst, **window}))
    feeder.send(
        (
            "run",
            {
                "first_hop": first_hop,
                "node": node_port,
                "sink": sink_port,
                "window": cfg.window,
                "tag": tag,
                **window,
            },
        )
    )
    node_cpu: float | None = None
    if run.node is not None and first_hop == run.node.port:
        pid = run.node.proc.pid
        _sleep_until(t_start)
        before = _proc_cpu_seconds(pid)
        _sleep_until(t_end)
        node_cpu = _proc_cpu_seconds(pid) - before
    reports = {"feeder": feeder.expect("done", budget), "sink": sink.expect("done", budget)}
    if relay is not None:
        reports["relay"] = relay.expect("done", budget)
    cpu_window = {role: float(r["cpu_window"]) for role, r in reports.items()}
    if node_cpu is not None:
        cpu_window["node"] = node_cpu
    run.result["cpu"][name] = {role: round(v, 3) for role, v in cpu_window.items()}
    sink_counts = reports["sink"]["counts"]
    if sink_mode != "null":
        run.result["mismatches_by_phase"][name] = int(sink_counts[U.SINK_MISMATCHES])
        run.result["mismatches"] += int(sink_counts[U.SINK_MISMATCHES])
    run.result["stale_datagrams"] += int(sink_counts[U.SINK_STALE])
    return {"name": name, "cpu_window": cpu_window, **reports}


def _sleep_until(t_ns: int) -> None:
    while (left := t_ns - time.monotonic_ns()) > 0:
        time.sleep(left / 1e9)


def auto_pinning() -> dict[str, int]:
    """Give the device under test (relay or node) a CPU of its own, the same one in both
    phases, so the ratio compares the two and not the scheduler's mood: with 3+ CPUs one each
    for feeder, sink and device; with 2 the feeder and sink share the other; with 1 nothing."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 3:
        return {
            "feeder": cpus[0],
            "sink": cpus[1],
            "relay": cpus[2],
            "pyrelay": cpus[2],
            "node": cpus[2],
        }
    if len(cpus) == 2:
        return {
            "feeder": cpus[0],
            "sink": cpus[0],
            "relay": cpus[1],
            "pyrelay": cpus[1],
            "node": cpus[1],
        }
    return {}


def _pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of *pid* to *cpu* (affinity is per thread, proc(5) /proc/PID/task)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})


def _proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (proc(5): fields 14 and 15 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_datapath_bench(cfg: DatapathBenchConfig) -> tuple[dict[str, Any], int]:
    """Run the three phases; return (result object, exit code). Never raises for a failed run:
    the result carries ``error`` and the exit code is 3."""

    if cfg.packets % FEED_BATCH or cfg.packets <= 0:
        raise ValueError(f"--packets must be a positive multiple of {FEED_BATCH}")
    if cfg.packets > 1 << U.SEQ_TAG_SHIFT:  # the packet index shares seq with the phase tag
        raise ValueError(f"--packets must be at most {1 << U.SEQ_TAG_SHIFT}")
    if cfg.window != 0 and cfg.window < FEED_BATCH:
        raise ValueError(
            f"--window {cfg.window} is smaller than one feeder batch: give 0 (unpaced) or at "
            f"least {FEED_BATCH}"
        )
    elements = elements_per_packet(cfg.mtu)
    datagram = HEADER_SIZE + 2 * SEGMENT_SIZE + elements * 4
    if elements < 1:
        smallest = HEADER_SIZE + 2 * SEGMENT_SIZE + 4
        raise ValueError(
            f"--mtu {cfg.mtu} is too small for a CHAIN_ADD with a 2-segment SR list: use --mtu "
            f"{smallest + 28} or more"
        )
    check_mtu_fits(cfg.mtu, datagram)
    if cfg.packets * elements * 4 > cfg.node_memory:
        raise ValueError(
            f"--packets {cfg.packets} x {elements * 4} bytes exceeds --node-memory "
            f"{cfg.node_memory}: give fewer packets or more memory"
        )
    res: dict[str, Any] = {
        "ok": False,
        "error": None,
        "raw_pps": None,
        "node_pps": None,
        "feeder_pps": None,
        "ratio": None,
        "py_relay_pps": None,
        "ratio_vs_py_relay": None,
        "valid": False,
        "verified": None,
        "verified_datagrams": 0,
        "mismatches": 0,
        "mismatches_by_phase": {},
        "stale_datagrams": 0,
        "node_counters": None,
        "kernel_drops": 0,
        "kernel_drops_by_process": {},
        "seconds": cfg.seconds,
        "warmup_seconds": cfg.warmup,
        "window": cfg.window,
        "startup_seconds": None,
        "payload_bytes": elements * 4,
        "datagram_bytes": datagram,
        "elements_per_packet": elements,
        "raw_gbps": None,
        "node_gbps": None,
        "feeder_gbps": None,
        "buffers": {},
        "cpu": {},
        "cpu_us_per_datagram": {},
        "ratio_cpu": None,
        "device_busy": {},
        "bottleneck": {},
        "machine": machine_info(),
    }
    run = _Run(cfg, res)
    node_cmd = cfg.node_cmd
    pin = auto_pinning() if cfg.pin is None else dict(cfg.pin)
    res["pinning"] = pin
    code = ExitCode.OK
    t0 = time.monotonic()
    ctx = worker_context()
    params: dict[str, Any] = {
        "seed": cfg.seed,
        "packets": cfg.packets,
        "mtu": cfg.mtu,
        "rcvbuf": 64 << 20,
        "pin": pin,
    }
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    try:
        with tempfile.TemporaryDirectory(prefix="netdam-bench-", dir=shm_root) as shm_dir:
            try:
                progress_file = os.path.join(shm_dir, "progress")
                with open(progress_file, "wb") as f:
                    f.write(bytes(64))
                params["progress_file"] = progress_file
                # The node's kernels first, here (with progress, as `netdam up` does): on a cold
                # cache the node compiled them for ~2.5 min after the workers were ready, and
                # they gave up waiting for their first command (CHILD_IDLE_SECONDS).
                if node_cmd is None:
                    warm_node_kernels()
                for role in ("sink", "relay", "pyrelay", "feeder"):
                    run.children[role] = _Child(ctx, role, params)
                for role, child in run.children.items():
                    child.info = child.wait_ready()
                    res["buffers"][role] = list(child.info["buffers"])
                sink_port = run.children["sink"].info["port"]
                if "skipped" not in res:
                    run.node = _NodeProcess(
                        node_cmd or default_node_cmd(), sink_port, cfg.mtu, cfg.node_memory, shm_dir
                    )
                    run.node.wait_ready()
                    if "node" in pin:
                        _pin_process(run.node.proc.pid, pin["node"])
                res["startup_seconds"] = round(time.monotonic() - t0, 3)
                res["startup_by_process"] = {
                    r: round(c.info["startup_seconds"], 3) for r, c in run.children.items()
                }
                w = _workload(cfg.seed, cfg.packets, cfg.mtu)
                if run.node is not None:
                    run.node.setup_region(w, cfg.packets)

                # Phase 1: feeder -> null sink.
                p1 = _phase(run, "feeder", sink_port, sink_port, "null", None)
                res["feeder_pps"] = p1["feeder"]["counts"][U.FEED_SENT_IN_WINDOW] / cfg.seconds
                res["null_sink_pps"] = p1["sink"]["counts"][U.SINK_RX_IN_WINDOW] / cfg.seconds
                drops: dict[str, int] = {"null_sink": _new_drops(U, p1["sink"])}
                # Phase 2: feeder -> relay -> sink.
                relay_port = run.children["relay"].info["port"]
                p2 = _phase(run, "raw", relay_port, relay_port, "raw", sink_port)
                raw_n = p2["sink"]["counts"][U.SINK_VERIFIED_IN_WINDOW]
                res["raw_pps"] = raw_n / cfg.seconds
                res["raw_offered_pps"] = p2["feeder"]["counts"][U.FEED_SENT_IN_WINDOW] / cfg.seconds
                drops["relay"] = _new_drops(U, p2["relay"])
                drops["raw_sink"] = _new_drops(U, p2["sink"])
                res["relay_io"] = _state_dict(U, p2["relay"]["state"])
                _device_cpu(res, "raw", "relay", p2["cpu_window"]["relay"], raw_n, cfg.seconds)
                # Phase 2b: feeder -> plain-Python GRO/GSO relay -> sink.
                py_port = run.children["pyrelay"].info["port"]
                p2b = _phase(run, "py_relay", py_port, py_port, "raw", sink_port, "pyrelay")
                py_n = p2b["sink"]["counts"][U.SINK_VERIFIED_IN_WINDOW]
                res["py_relay_pps"] = py_n / cfg.seconds
                drops["py_relay"] = _new_drops(U, p2b["relay"])
                drops["py_relay_sink"] = _new_drops(U, p2b["sink"])
                res["py_relay_io"] = _state_dict(U, p2b["relay"]["state"])
                _device_cpu(
                    res, "py_relay", "py_relay", p2b["cpu_window"]["relay"], py_n, cfg.seconds
                )
                # Phase 3: feeder -> node -> sink.
                if run.node is not None:
                    node_port = run.node.port
                    before = run.node.counters()
                    p3 = _phase(run, "node", node_port, node_port, "node", None)
                    node_n = p3["sink"]["counts"][U.SINK_VERIFIED_IN_WINDOW]
                    res["node_pps"] = node_n / cfg.seconds
                    res["node_offered_pps"] = (
                        p3["feeder"]["counts"][U.FEED_SENT_IN_WINDOW] / cfg.seconds
                    )
                    res["verified_datagrams"] = p3["sink"]["counts"][U.SINK_VERIFIED_TOTAL]
                    after = run.node.counters()
                    res["node_counters"] = C.counters_to_dict(after)
                    drops["node"] = int(after[C.KERNEL_DROPS]) - int(before[C.KERNEL_DROPS])
                    drops["node_sink"] = _new_drops(U, p3["sink"])
                    # Mismatches (of any phase) turn this to False in _verdict.
                    res["verified"] = res["verified_datagrams"] > 0
                    _device_cpu(res, "node", "node", p3["cpu_window"]["node"], node_n, cfg.seconds)
                    relay_us = res["cpu_us_per_datagram"].get("relay")
                    node_us = res["cpu_us_per_datagram"].get("node")
                    if relay_us and node_us:
                        res["ratio_cpu"] = relay_us / node_us
                res["kernel_drops_by_process"] = drops
                res["kernel_drops"] = sum(drops.values())
            except _BenchFailure as exc:
                res["error"] = str(exc)
                if (
                    run.node is not None
                    and run.node.proc.poll() is not None
                    and "stderr" not in res["error"]
                ):
                    res["error"] += f" (node stderr: {run.node.stderr_tail()})"
                code = ExitCode.RUN_FAILED
            finally:
                for child in run.children.values():
                    child.stop()
                if run.node is not None:
                    run.node.stop()
    except OSError as exc:
        res["error"] = f"cannot set up the benchmark: {exc}"
        code = ExitCode.RUN_FAILED
    _finish(res)
    return res, int(_verdict(res, code))


def _verdict(res: dict[str, Any], code: ExitCode) -> ExitCode:
    """Make ``ok``, ``verified``, ``error`` and the exit code say one thing (BRIEF section 7).

    Any mismatch, in any phase, is a wrong result: a relay phase's sink checks that the relay
    delivered each payload unchanged, the node phase's sink that each sum is bitwise right, so
    ``verified`` is False, ``error`` says how many failed where, and the exit code is 1 (3 stays
    3: the run failed as well). A node that delivered nothing checkable verified nothing: the
    run failed (3). ``ok`` is True exactly when the exit code is 0."""
    mismatches = int(res["mismatches"])
    reasons: list[str] = []
    if mismatches:
        by_phase = ", ".join(
            f"{phase} {n}" for phase, n in res.get("mismatches_by_phase", {}).items() if n
        )
        reasons.append(
            f"{mismatches} datagrams failed the sink's bitwise check ({by_phase}): wrong sums "
            "or payloads changed on the way"
        )
        res["verified"] = False
        if code == ExitCode.OK:
            code = ExitCode.CHECK_FAILED
    elif res.get("verified") is False and not res.get("error"):
        reasons.append("the sink verified no datagram from the node: it forwarded nothing")
        if code == ExitCode.OK:
            code = ExitCode.RUN_FAILED
    if reasons:
        res["error"] = "; ".join(([res["error"]] if res.get("error") else []) + reasons)
    res["ok"] = code == ExitCode.OK
    return code


def _new_drops(U: Any, report: dict[str, Any]) -> int:
    """Datagrams the kernel dropped at this socket during the phase (SO_RXQ_OVFL delta)."""
    return int(report["state"][U.ST_KERNEL_DROPS])


def _device_cpu(
    res: dict[str, Any], phase: str, device: str, cpu_seconds: float, datagrams: int, seconds: float
) -> None:
    """CPU cost per forwarded datagram of the device under test, and whether it was the
    bottleneck (busy >= 90% of its CPU inside the window). When it was not, the pps ratio
    only says both kept up with the load generator; the CPU ratio still compares them."""
    busy = cpu_seconds / seconds
    res["device_busy"][device] = round(busy, 3)
    if datagrams:
        res["cpu_us_per_datagram"][device] = round(cpu_seconds * 1e6 / datagrams, 3)
    res["bottleneck"][phase] = (
        device if busy >= 0.9 else f"feeder/sink ({device} busy {busy:.0%} of a CPU)"
    )


def _state_dict(U: Any, state: list[int]) -> dict[str, int]:
    names = {
        "recv_calls": U.ST_RECV_CALLS,
        "send_calls": U.ST_SEND_CALLS,
        "rx_datagrams": U.ST_RX_DATAGRAMS,
        "tx_datagrams": U.ST_TX_DATAGRAMS,
        "gro_runs": U.ST_GRO_RUNS,
        "gso_runs": U.ST_GSO_RUNS,
        "send_waits": U.ST_SEND_WAITS,
        "send_dropped": U.ST_SEND_DROPPED,
    }
    return {k: int(state[i]) for k, i in names.items()}


def _finish(res: dict[str, Any]) -> None:
    """Derived numbers: ratio, validity, Gb/s (10^9 bit/s of UDP payload)."""
    raw, node, feeder = res["raw_pps"], res["node_pps"], res["feeder_pps"]
    if raw and node is not None:
        res["ratio"] = node / raw
    py = res.get("py_relay_pps")
    if py and node is not None:
        res["ratio_vs_py_relay"] = node / py
    measured = [v for v in (raw, node) if v is not None]
    if feeder is not None and measured:
        res["valid"] = bool(feeder >= 1.2 * max(measured))
        if not res["valid"]:
            res["invalid_reason"] = (
                f"the feeder offered {feeder:,.0f} pps, less than 1.2 x {max(measured):,.0f}: "
                "the run measured the feeder, not the relay or node"
            )
    for key in ("raw", "node", "feeder"):
        pps = res[f"{key}_pps"]
        res[f"{key}_gbps"] = None if pps is None else pps * res["datagram_bytes"] * 8 / 1e9


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "NO"


def format_text(res: dict[str, Any]) -> str:
    """The small table ``netdam bench datapath`` prints without --json."""

    def pps(v: float | None) -> str:
        return "-" if v is None else f"{v:>12,.0f}"

    def gbps(v: float | None) -> str:
        return "-" if v is None else f"{v:8.1f}"

    lines = [
        f"netdam bench datapath: {res['seconds']} s per phase after {res['warmup_seconds']} s "
        f"warm-up, {res['datagram_bytes']}-byte datagrams ({res['elements_per_packet']} f32)",
        f"  {'phase':<32}{'datagrams/s':>12}{'Gb/s':>9}",
        f"  {'feeder -> null sink':<32}{pps(res['feeder_pps'])}{gbps(res['feeder_gbps'])}",
        f"  {'feeder -> relay -> sink':<32}{pps(res['raw_pps'])}{gbps(res['raw_gbps'])}",
        f"  {'feeder -> Python relay -> sink':<32}{pps(res.get('py_relay_pps'))}"
        f"{gbps(None if res.get('py_relay_pps') is None else res['py_relay_pps'] * res['datagram_bytes'] * 8 / 1e9)}",
        f"  {'feeder -> node -> sink':<32}{pps(res['node_pps'])}{gbps(res['node_gbps'])}",
    ]
    ratio = "-" if res["ratio"] is None else f"{res['ratio']:.3f}"
    py_ratio = "-" if res.get("ratio_vs_py_relay") is None else f"{res['ratio_vs_py_relay']:.3f}"
    lines.append(
        f"  ratio node/raw {ratio}, node/Python relay {py_ratio}; valid {'yes' if res['valid'] else 'NO'}; "
        f"sums verified {_yes_no(res['verified'])} ({res['verified_datagrams']} datagrams, "
        f"{res['mismatches']} mismatches, {res.get('stale_datagrams', 0)} stale); "
        f"kernel drops {res['kernel_drops']}"
    )
    cost = res.get("cpu_us_per_datagram") or {}
    if cost:
        busy = res.get("device_busy") or {}
        parts = [f"{d} {us:.2f} us ({busy.get(d, 0):.0%} busy)" for d, us in cost.items()]
        ratio_cpu = res.get("ratio_cpu")
        extra = "" if ratio_cpu is None else f"; relay/node {ratio_cpu:.3f}"
        lines.append(f"  CPU per datagram: {', '.join(parts)}{extra}")
    for phase, what in (res.get("bottleneck") or {}).items():
        lines.append(f"  bottleneck of the {phase} phase: {what}")
    if res.get("startup_seconds") is not None:
        lines.append(f"  start-up {res['startup_seconds']:.2f} s (not timed)")
    for key in ("skipped", "invalid_reason", "error"):
        if res.get(key):
            lines.append(f"  {key}: {res[key]}")
    return "\n".join(lines)
