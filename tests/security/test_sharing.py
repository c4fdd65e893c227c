"""Safe to share (SPEC.md 6.1, 7, 8, 12): what one user of the nodes can do to another.

Each test is one attack measured against v0.2 (the figure in its docstring) and the property
that now holds. The fabric ones run the nodes' datapath in memory; the ``slow`` ones run node
processes, a switch and plain sockets, as an unprivileged local user would."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import CLIENT, RKEY, Cluster, make_cluster, only
from reference import all_reduce_reference

from netdam.api import ProcessGroup, collective_key, group_secret
from netdam.api import all_reduce as api_all_reduce
from netdam.clients.pool import PoolClient, tag_keys_of
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import start_cluster, start_pool_cluster
from netdam.core.events import ReplyReceived
from netdam.kernels import datapath
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    DUP_WINDOW_CLIENTS,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.switch.controller import PoolController

KiB = 1024
ATTACKER: Endpoint = ("127.0.0.1", 9666)


def _fetch_add(addr: int, value: int, *, txn: int, client: int, rkey: int) -> Packet:
    return Packet(
        Opcode.FETCH_ADD,
        client_id=client,
        txn_id=txn,
        rkey=rkey,
        addr=addr,
        length=8,
        dtype=DType.U64,
        payload=struct.pack("<Q", value),
    )


def _write(addr: int, data: bytes, *, txn: int, client: int, rkey: int) -> Packet:
    return Packet(
        Opcode.WRITE,
        flags=Flags.ACK_REQ,
        client_id=client,
        txn_id=txn,
        rkey=rkey,
        addr=addr,
        length=len(data),
        payload=data,
    )


def _two_tenants() -> tuple[Cluster, int, int]:
    """One node, RKEY's region split in two: the victim's [0, 64 KiB), the attacker's above."""
    cluster = make_cluster(1)
    node = cluster.nodes[0]
    node.deregister_region(RKEY)
    victim = node.register_region(0, 64 * KiB, RIGHTS_ALL)
    attacker = node.register_region(64 * KiB, 64 * KiB, RIGHTS_ALL)
    cluster.fabric.add_endpoint(ATTACKER)
    return cluster, victim, attacker


def test_forged_writes_cannot_make_a_real_write_vanish() -> None:
    """Before: 200 WRITEs under the victim's source address and client id (the attacker's own
    region and rkey) poisoned the victim's window; 100 of its 100 next WRITEs were ACKed and
    0 applied. The window is keyed by the rkey too: the victim's WRITEs all land."""
    cluster, victim, attacker = _two_tenants()
    for txn in range(1, 201):  # forged from the victim's address: the fabric sends as anyone
        cluster.fabric.send(
            CLIENT,
            cluster.endpoints[0],
            encode_packet(_write(64 * KiB, b"x" * 8, txn=txn, client=7, rkey=attacker)),
        )
    cluster.fabric.run_until_idle()
    cluster.fabric.receive(CLIENT)
    for txn in range(1, 101):
        only(
            cluster.request(
                0, _write(8 * txn, struct.pack("<Q", txn), txn=txn, client=7, rkey=victim)
            ),
            Opcode.ACK,
        )
    written = cluster.nodes[0].memory[8 : 8 * 101].view(np.uint64)
    assert written.tolist() == list(range(1, 101))


def test_retried_fetch_add_never_runs_twice_under_a_client_id_flood() -> None:
    """Before: a tenant writing its own region under 512 client ids evicted the victim's window
    entry, and the victim's retried FETCH_ADD ran twice (20 of 20 trials). Entries of one rkey
    are never taken by clients of another while they may still be retried: the flood gets BUSY
    where the table is full, the victim's retry is answered from its window."""
    cluster, victim, attacker = _two_tenants()
    first = only(cluster.request(0, _fetch_add(0, 1, txn=5, client=77, rkey=victim)), Opcode.ACK)
    for client in range(1, 4 * DUP_WINDOW_CLIENTS + 1):
        cluster.fabric.send(
            ATTACKER,
            cluster.endpoints[0],
            encode_packet(_fetch_add(64 * KiB, 1, txn=1, client=client, rkey=attacker)),
        )
    cluster.fabric.run_until_idle()
    flood = [decode_packet(data) for data, _ in cluster.fabric.receive(ATTACKER)]
    assert len(flood) == 4 * DUP_WINDOW_CLIENTS and all(
        r.opcode == Opcode.ACK for r in flood
    )  # it evicts its own
    retry = only(cluster.request(0, _fetch_add(0, 1, txn=5, client=77, rkey=victim)), Opcode.ACK)
    assert retry.payload == first.payload  # the cached answer: old value 0
    assert int(cluster.nodes[0].memory[0:8].view(np.uint64)[0]) == 1  # ran once


def test_a_members_only_key_names_nothing_for_anyone_else() -> None:
    """A collective's key (rights MEMBERS) works in datagrams from cluster members only: a
    non-member that learned it gets BAD_RKEY for READ, WRITE and atomics, and memory stays."""
    cluster = make_cluster(2)
    node = cluster.nodes[0]
    node.deregister_region(RKEY)
    key = node.register_region(
        0, 64 * KiB, Rights.READ | Rights.WRITE | Rights.ATOMIC | Rights.MEMBERS
    )
    node.memory[:64] = 7
    before = node.memory.copy()
    for packet in (
        Packet(Opcode.READ, rkey=key, addr=0, length=64),
        _write(0, b"overwrite", txn=1, client=3, rkey=key),
        _fetch_add(0, 1, txn=2, client=3, rkey=key),
    ):
        assert only(cluster.request(0, packet), Opcode.NACK).status == Status.BAD_RKEY
    np.testing.assert_array_equal(node.memory, before)
    member = cluster.endpoints[1]  # a node: the answer reaches its core as a reply event
    cluster.fabric.send(
        member,
        cluster.endpoints[0],
        encode_packet(Packet(Opcode.READ, rkey=key, addr=0, length=64)),
    )
    cluster.fabric.run_until_idle()
    events = list(iter(cluster.nodes[1].next_event, None))
    assert [e.packet.opcode for e in events if isinstance(e, ReplyReceived)] == [Opcode.READ_RESP]


#: The attacker: an unprivileged local user with nothing but the standard library. It joins the
#: collective's multicast group, waits for an ALL_WRITE, then uses the key it carried to READ a
#: direct client's secret and the collective's buffer and to WRITE over the secret, and sends
#: ALL_WRITEs of the next epoch (the sniffed key, and the key + 1) to the group and the node.
#: argv: a JSON object with the addresses, the header's field offsets and the opcodes to use.
ATTACKER_SCRIPT = r"""
import json, socket, struct, sys, time
a = json.loads(sys.argv[1])
o = a["offsets"]
sniff = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
sniff.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sniff.bind(("", a["group"][1]))
sniff.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                 socket.inet_aton(a["group"][0]) + socket.inet_aton("127.0.0.1"))
sniff.settimeout(0.2)
print("ready", flush=True)
seen, deadline = None, time.monotonic() + 60
while seen is None and time.monotonic() < deadline:
    try:
        data = sniff.recv(65536)
    except socket.timeout:
        continue
    if len(data) > 64 and data[o["opcode"]] == a["ALL_WRITE"]:
        seen = bytearray(data)
if seen is None:
    print(json.dumps({"sniffed": False}), flush=True)
    sys.exit(0)
u32 = lambda b, f: struct.unpack_from("!I", b, o[f])[0]
result = {"sniffed": True, "rkey": u32(seen, "rkey"), "coll_id": u32(seen, "coll_id"), "epoch": u32(seen, "epoch")}
node = tuple(a["node"])
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.bind(("127.0.0.1", 0))
probe.settimeout(1.0)

def ask(opcode, addr, length, payload=b"", flags=0):
    h = bytearray(seen[:64])
    h[o["opcode"]] = opcode
    for f in ("seq", "coll_id", "epoch", "ret_ip"):
        struct.pack_into("!I", h, o[f], 0)
    struct.pack_into("!H", h, o["flags"], flags)
    struct.pack_into("!I", h, o["client_id"], 9)
    struct.pack_into("!I", h, o["txn_id"], 1)
    struct.pack_into("!I", h, o["length"], length)
    struct.pack_into("!Q", h, o["addr"], addr)
    struct.pack_into("!Q", h, o["aux_addr"], 0)
    h[o["dtype"]] = 0
    probe.sendto(bytes(h) + payload, node)
    try:
        reply = probe.recv(65536)
    except socket.timeout:
        return ["silence", 0]
    return [reply[o["opcode"]], reply[o["status"]]]

result["read_secret"] = ask(a["READ"], a["secret_at"], 64)
result["read_buffer"] = ask(a["READ"], struct.unpack_from("!Q", seen, o["addr"])[0], 64)
result["write_secret"] = ask(a["WRITE"], a["secret_at"], 8, b"owned!!!", flags=1)
length = struct.unpack_from("!I", seen, o["length"])[0]
for rkey in (result["rkey"], (result["rkey"] + 1) & 0xFFFFFFFF):
    forged = bytearray(seen[:64]) + b"\xff" * length
    struct.pack_into("!I", forged, o["epoch"], result["epoch"] + 1)
    struct.pack_into("!I", forged, o["rkey"], rkey)
    for _ in range(50):
        probe.sendto(bytes(forged), tuple(a["group"]))
        probe.sendto(bytes(forged), node)
print(json.dumps(result), flush=True)
"""


def _attacker_command(script: str, arg: str) -> tuple[list[str], dict[str, Any]]:
    """The command and Popen arguments that run *script* (standard library only) as the
    unprivileged user `nobody` when the tests run as root (the local attacker of SPEC.md 12.1),
    with an interpreter `nobody` may run; as the test user, unprivileged already, otherwise."""
    if os.geteuid() != 0:
        return [sys.executable, "-c", script, arg], {}
    nobody = pwd.getpwnam("nobody")
    runnable = [
        p
        for p in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3")
        if p and _runs_as(p, nobody.pw_uid, nobody.pw_gid)
    ]
    if not runnable:
        pytest.skip(
            "no Python interpreter the user nobody may run: the attacker must be unprivileged"
        )
    return [runnable[0], "-c", script, arg], {
        "user": nobody.pw_uid,
        "group": nobody.pw_gid,
        "extra_groups": [],
        "cwd": "/",
    }


def _runs_as(python: str, uid: int, gid: int) -> bool:
    try:
        probe = subprocess.run(
            [python, "-c", "pass"],
            user=uid,
            group=gid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            check=False,
        )
    except OSError:  # not executable by that user (e.g. under root's home)
        return False
    return probe.returncode == 0


@pytest.mark.slow
def test_sniffed_collective_gives_no_memory_access_and_no_wrong_result(tmp_path: Path) -> None:
    """Before: an all-gather's ALL_WRITEs carried one key for all node memory, valid forever;
    with it a local user read and overwrote a tenant's secret, and forged next-epoch
    ALL_WRITEs made 33 of 100 all-reduces wrong with no error. Now a collective's key is its
    own (derived per call from the cluster's 128-bit group key), covers only its buffers, works
    only from members, and is gone when the call ends. The attacker runs as `nobody` (as the
    test user when that is not root) with a plain socket."""
    with start_cluster(2, memory=4 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(2)]
        node = cluster.info.nodes[0].endpoint
        with ControlClient.for_cluster(cluster.info) as admin:  # a direct client's secret
            secret_key, secret_at = admin.register_anywhere(node, 4096, Rights.READ | Rights.WRITE)
            admin.write(node, secret_key, secret_at, b"tenant secret!!!" * 256)
        names = (
            "opcode",
            "flags",
            "seq",
            "client_id",
            "txn_id",
            "coll_id",
            "epoch",
            "rkey",
            "length",
            "addr",
            "aux_addr",
            "dtype",
            "status",
            "ret_ip",
        )
        args = {
            "group": list(groups[0].group),
            "node": list(node),
            "secret_at": secret_at,
            "offsets": {f: HEADER.at(f) for f in names},
            "READ": int(Opcode.READ),
            "WRITE": int(Opcode.WRITE),
            "ALL_WRITE": int(Opcode.ALL_WRITE),
        }
        command, as_user = _attacker_command(ATTACKER_SCRIPT, json.dumps(args))
        attacker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, **as_user)
        try:
            assert attacker.stdout is not None and attacker.stdout.readline().strip() == "ready"
            inputs = [np.arange(1 << 16, dtype=np.float32) * (r + 1) for r in range(2)]
            for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)]:
                w.wait()
            result = json.loads(attacker.stdout.readline())
            assert attacker.wait(timeout=30) == 0
        finally:
            attacker.kill()
        assert result["sniffed"], "the attacker saw no ALL_WRITE: the test would prove nothing"
        assert result["rkey"] == collective_key(
            group_secret(cluster.info), result["coll_id"], result["epoch"]
        )
        for probe in ("read_secret", "read_buffer", "write_secret"):
            assert result[probe] == [int(Opcode.NACK), int(Status.BAD_RKEY)], (probe, result[probe])
        # The forged ALL_WRITEs of the next epoch: the next all-reduce is exact on every rank,
        # and the secret is intact.
        inputs = [np.arange(1 << 16, dtype=np.float32) * (r + 3) for r in range(2)]
        for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)]:
            w.wait()
        expected = (
            np.arange(1 << 16, dtype=np.float32) * 3 + np.arange(1 << 16, dtype=np.float32) * 4
        )
        for b in inputs:
            np.testing.assert_array_equal(b, expected)
        with ControlClient.for_cluster(cluster.info) as admin:
            assert admin.read(node, secret_key, secret_at, 4096) == b"tenant secret!!!" * 256
        for g in groups:
            g.close()


def _spoofed(src: Endpoint, dst: Endpoint, payload: bytes) -> bytes:
    """An IPv4/UDP datagram from *src* (any address: a forged source) to *dst*, for a raw
    socket with IP_HDRINCL (the kernel fills the IP checksum; UDP checksum 0: none)."""
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(udp),
        0,
        0,
        64,
        socket.IPPROTO_UDP,
        0,
        socket.inet_aton(src[0]),
        socket.inet_aton(dst[0]),
    )
    return ip + udp


class _Forger(threading.Thread):
    """Sniffs the all-gather's multicast group and, for every ALL_WRITE seen, forges that live
    collective's datagrams from a member's address (raw socket): the ALL_WRITE again with
    another payload and no tag, the same with the TAGGED flag and a made-up tag, a fatal NACK
    under its key, and a WRITE under its key into its buffer."""

    def __init__(self, group: Endpoint, nodes: list[Endpoint]) -> None:
        super().__init__(daemon=True)
        self.nodes, self.sent, self.seen = nodes, 0, 0
        self.stop = threading.Event()
        self.sniff = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        self.sniff.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sniff.bind(("", group[1]))
        self.sniff.setsockopt(
            socket.IPPROTO_IP,
            socket.IP_ADD_MEMBERSHIP,
            socket.inet_aton(group[0]) + socket.inet_aton("127.0.0.1"),
        )
        self.sniff.settimeout(0.05)
        self.raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sniff.recv(65536)
            except TimeoutError:
                continue
            packet = decode_packet(data)
            if packet.opcode != Opcode.ALL_WRITE:
                continue
            self.seen += 1
            garbage = b"\xff" * len(packet.payload)
            bare = replace(packet, flags=packet.flags & ~Flags.TAGGED, tag=0)
            forged = [
                replace(bare, payload=garbage),
                replace(packet, payload=garbage, tag=packet.tag ^ 1),
                Packet(
                    Opcode.NACK,
                    status=Status.NO_RIGHTS,
                    seq=packet.seq,
                    coll_id=packet.coll_id,
                    epoch=packet.epoch,
                    rkey=packet.rkey,
                ),
                Packet(Opcode.WRITE, rkey=packet.rkey, addr=packet.addr).with_payload(garbage),
            ]
            for victim, node in enumerate(self.nodes):
                member = self.nodes[(victim + 1) % len(self.nodes)]
                for p in forged:
                    self.raw.sendto(_spoofed(member, node, encode_packet(p)), (node[0], 0))
                    self.sent += 1


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="forging a source address takes a raw socket (root)")
def test_a_forger_with_a_members_address_and_the_live_key_changes_no_result(tmp_path: Path) -> None:
    """The residual of SPEC v1's threat model: a sender that forges a member's source address
    and has the running collective's key (here sniffed from the multicast group, as any local
    user can) aborted all-reduces or changed their result. Collectives are tagged now (SPEC.md
    2.6): 20 all-reduces under a forger that answers every ALL_WRITE it sees with forged
    datagrams of that very collective are all exact, and every node counts the forgeries."""
    with start_cluster(3, memory=8 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(3)]
        nodes = [node.endpoint for node in cluster.info.nodes]
        forger = _Forger(groups[0].group, nodes)
        forger.start()
        try:
            rng = np.random.default_rng(21)
            for call in range(20):
                inputs = [rng.standard_normal(1 << 15).astype(np.float32) for _ in range(3)]
                expected = all_reduce_reference(inputs)
                for w in [
                    api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)
                ]:
                    w.wait()
                for rank, b in enumerate(inputs):
                    assert b.tobytes() == expected.tobytes(), (call, rank)
        finally:
            forger.stop.set()
            forger.join()
        assert forger.seen > 0 and forger.sent > 0, (
            "nothing sniffed or forged: the test would prove nothing"
        )
        with ControlClient.for_cluster(cluster.info) as admin:
            for node in nodes:
                assert int(admin.counters(node)[C.DROP_COLL_FORGED]) > 0, node
        for g in groups:
            g.close()


#: A second job's rank 0, in a process of its own: prints what opening its group gave.
SECOND_JOB = """
import sys
from netdam.api import ArenaInUseError, ProcessGroup
from netdam.cluster.clusterfile import load_cluster
try:
    ProcessGroup(load_cluster(sys.argv[1]), 0).close()
    print("opened")
except ArenaInUseError as exc:
    print("refused:", exc)
"""


@pytest.mark.slow
def test_a_second_job_on_the_cluster_file_cannot_take_a_running_jobs_arena(tmp_path: Path) -> None:
    """Before: every job on a cluster file derived the same arena key for a rank, and a second
    job's init took the first one's arena (DEREGISTER, which zeroes it, then REGISTER): the
    first job's staged data was gone. Now the second job's rank gets ArenaInUseError naming the
    holder, the first job's arena keeps every byte, and once the first job closes the rank is
    free again."""
    path = tmp_path / "c.toml"
    with start_cluster(2, memory=4 << 20, cluster_path=path) as cluster:
        first = ProcessGroup(cluster.info, 0)
        first.memory[first.arena_base : first.arena_base + 4096] = 0x5A

        def second_job() -> str:
            run = subprocess.run(
                [sys.executable, "-c", SECOND_JOB, str(path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return run.stdout.strip()

        assert second_job().startswith(f"refused: rank 0: another process (pid {os.getpid()})")
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "netdam",
                "allreduce",
                "--cluster",
                str(path),
                "--size",
                "4KiB",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert cli.returncode == 3 and "another process" in json.loads(cli.stdout)["error"], (
            cli.stderr
        )
        assert (first.memory[first.arena_base : first.arena_base + 4096] == 0x5A).all()
        with ControlClient.for_cluster(cluster.info) as admin:  # still registered
            assert (
                admin.read(cluster.info.nodes[0].endpoint, first.arena_rkey, first.arena_base, 8)
                == b"\x5a" * 8
            )
        first.close()
        assert second_job() == "opened"


@pytest.mark.slow
def test_collectives_leave_pool_tenants_memory_alone(tmp_path: Path) -> None:
    """Before: pool backing began at address 0, inside memory the collectives' key covered, and
    `netdam allreduce --cluster` overwrote 2.09 MB of a tenant's 14.7 MB. A process group now
    owns an arena the node placed in free memory; the tenant's bytes read back bit-exact."""
    cluster, switch = start_pool_cluster(2, memory=4 << 20, cluster_path=tmp_path / "c.toml")
    try:
        controller = PoolController(cluster.path)
        region = controller.alloc(1 << 20, interleave=8 * KiB)
        pattern = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        with PoolClient(switch.vip, tag_keys=tag_keys_of(region)) as client:
            client.write(region.gaddr, pattern, region.rkey, stride=region.stride)
        info = cluster.info
        groups = [ProcessGroup(info, rank) for rank in range(2)]
        for _ in range(3):
            bufs = [np.full(256 * KiB, rank + 1.0, np.float32) for rank in range(2)]
            for w in [api_all_reduce(b, group=g, async_op=True) for b, g in zip(bufs, groups)]:
                w.wait()
            assert all((b == 3.0).all() for b in bufs)
        with PoolClient(switch.vip, tag_keys=tag_keys_of(region)) as client:
            assert (
                client.read(region.gaddr, len(pattern), region.rkey, stride=region.stride)
                == pattern
            )
        for g in groups:
            assert not any(
                g.arena_base < w.local + w.size and w.local < g.arena_end
                for w in region.ways
                if w.node == g.rank
            )
            g.close()
    finally:
        switch.stop()
        cluster.stop()


@pytest.mark.slow
def test_alloc_returns_zeroed_memory(tmp_path: Path) -> None:
    """Before: tenant B's first READ of a fresh ALLOC returned all 65,536 bytes tenant A had
    written and freed. Freed backing is wiped: B reads zeros."""
    cluster, switch = start_pool_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml")
    try:
        admin = PoolController(cluster.path)
        first = admin.alloc(64 * KiB)
        with PoolClient(switch.vip, tag_keys=tag_keys_of(first)) as client:
            client.write(first.gaddr, b"A's data" * (8 * KiB), first.rkey)
        admin.free(first.gaddr)
        second = admin.alloc(64 * KiB)
        assert {(w.node, w.local) for w in second.ways} == {(w.node, w.local) for w in first.ways}
        with PoolClient(switch.vip, tag_keys=tag_keys_of(second)) as client:
            assert client.read(second.gaddr, 64 * KiB, second.rkey) == bytes(64 * KiB)
    finally:
        switch.stop()
        cluster.stop()


def test_window_key_includes_the_rkey() -> None:
    """The same client id and requester under two rkeys are two window entries."""
    requester = endpoint_to_u64(CLIENT)
    assert int(datapath._requester_key(7, requester, 1)) != int(
        datapath._requester_key(7, requester, 2)
    )
