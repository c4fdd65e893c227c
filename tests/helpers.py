"""Test helpers: a small cluster of node cores on the in-memory fabric, and a client mailbox."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import strategies as st

from netdam.cli import bench as cli_bench
from netdam.cli import common as cliutil
from netdam.cli import model as cli_model
from netdam.cli.common import NetdamArgumentParser
from netdam.cluster.launch import LocalCluster, SwitchHandle
from netdam.core.fabric import Fabric
from netdam.core.faults import FaultSpec
from netdam.core.node import NodeConfig, NodeCore
from netdam.protocol.constants import (
    DATA_OPCODES,
    DEFAULT_MTU,
    MAX_PAYLOAD_BYTES,
    MAX_SEGMENTS,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    ReduceOp,
    Status,
)
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import (
    Algo,
    AllocRequest,
    CollectiveDescriptor,
    RegionInfo,
    pack_credential,
    unpack_region_info,
)
from netdam.protocol.tag import seal_control

CLIENT: Endpoint = ("127.0.0.1", 9001)
ADMIN_KEY = 0x5EC12E7
MEMORY = 1 << 20
#: The region every test cluster registers on every node, under the same rkey.
RKEY = 0x1234_5678


@dataclass
class Cluster:
    fabric: Fabric
    nodes: list[NodeCore]
    endpoints: list[Endpoint]
    client: Endpoint = CLIENT
    txn: int = field(default=1)
    #: Largest payload the client's codec encodes and decodes (SPEC.md 2.7): raise it to send
    #: what a node must refuse itself.
    max_payload: int = MAX_PAYLOAD_BYTES

    def send(self, node: int, packet: Packet) -> None:
        data = encode_packet(packet, self.max_payload)
        self.fabric.send(self.client, self.endpoints[node], data)

    def request(self, node: int, packet: Packet) -> list[Packet]:
        """Send, run to idle, return the decoded replies the client got."""
        self.send(node, packet)
        self.fabric.run_until_idle()
        received = self.fabric.receive(self.client)
        return [decode_packet(data, self.max_payload) for data, _ in received]

    def next_txn(self) -> int:
        self.txn += 1
        return self.txn


def make_cluster(
    n: int = 3, faults: FaultSpec | None = None, memory: int = MEMORY, mtu: int = DEFAULT_MTU
) -> Cluster:
    fabric = Fabric(faults)
    endpoints = [("127.0.0.1", 7001 + i) for i in range(n)]
    nodes = []
    for rank, endpoint in enumerate(endpoints):
        core = NodeCore(
            NodeConfig(
                endpoint=endpoint,
                memory_bytes=memory,
                admin_key=ADMIN_KEY,
                members=tuple(endpoints),
                rank=rank,
                world_size=n,
                mtu=mtu,
            )
        )
        core.register_region(0, memory, RIGHTS_ALL, rkey=RKEY)
        fabric.add_core(endpoint, core)
        nodes.append(core)
    fabric.add_endpoint(CLIENT)
    return Cluster(fabric, nodes, endpoints)


class VipWire:
    """A bare UDP client of a running pool's VIP: one datagram out, the reply with its txn id
    back (the `wire` fixture of conftest.py gives each module one)."""

    def __init__(self, cluster: LocalCluster, switch: SwitchHandle) -> None:
        self.cluster, self.switch = cluster, switch
        self.admin = cluster.info.admin_key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(3.0)
        self.txn = 100

    def raw(self, data: bytes, to: tuple[str, int] | None = None) -> Packet:
        self.sock.sendto(data, to or self.switch.vip)
        txn = HEADER.read(data, "txn_id")
        while True:
            reply = decode_packet(self.sock.recvfrom(65536)[0])
            if reply.txn_id == txn:
                return reply

    def send(
        self,
        opcode: Opcode,
        payload: bytes,
        *,
        rkey: int = 0,
        addr: int = 0,
        txn: int | None = None,
        to: tuple[str, int] | None = None,
    ) -> Packet:
        if txn is None:
            self.txn += 1
            txn = self.txn
        packet = Packet(
            opcode,
            client_id=77,
            txn_id=txn,
            rkey=rkey,
            addr=addr,
            length=len(payload),
            payload=payload,
        )
        data = encode_packet(packet)
        return self.raw(self.sealed(data) if rkey == self.admin else data, to)

    def sealed(self, data: bytes) -> bytes:
        """*data* as the admin sends it (SPEC.md 2.6, "Control tags"): rkey 0 and its control
        tag under the cluster's admin tag key."""
        body = bytearray(data)
        HEADER.write(body, "rkey", 0)
        return seal_control(self.cluster.info.admin_tag_key, bytes(body))

    def alloc(
        self, size: int, credential: int = 0, *, rkey: int | None = None, **kw: Any
    ) -> Packet:
        """ALLOC; as the admin (sealed) unless a tenant's *credential* (or *rkey*) is given."""
        key = self.admin if rkey is None and credential == 0 else (rkey or 0)
        return self.send(Opcode.ALLOC, AllocRequest(size, credential, **kw).encode(), rkey=key)

    def free(self, gaddr: int, credential: int) -> Packet:
        return self.send(Opcode.FREE, pack_credential(credential), addr=gaddr)

    def region(self, reply: Packet) -> RegionInfo:
        assert reply.opcode == Opcode.ACK, (reply.status.name, reply.payload)
        return unpack_region_info(reply.payload)

    def close(self) -> None:
        self.sock.close()


def only(replies: list[Packet], opcode: Opcode) -> Packet:
    assert len(replies) == 1, replies
    assert replies[0].opcode == opcode, replies[0]
    return replies[0]


_u32 = st.integers(0, 2**32 - 1)
_endpoint = st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535))


@st.composite
def valid_packets(draw: st.DrawFn) -> Packet:
    opcode = draw(
        st.sampled_from(
            [
                Opcode.READ,
                Opcode.WRITE,
                Opcode.ADD,
                Opcode.CHAIN_ADD,
                Opcode.ALL_WRITE,
                Opcode.FETCH_ADD,
                Opcode.CAS,
                Opcode.UPDATE,
                Opcode.PING,
                Opcode.ACK,
                Opcode.NACK,
                Opcode.READ_RESP,
            ]
        )
    )
    dtype = draw(
        st.sampled_from(
            list(DType)[1:] if opcode in (Opcode.ADD, Opcode.CHAIN_ADD) else list(DType)
        )
    )
    if opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        dtype = DType.U64
    if opcode == Opcode.UPDATE:
        dtype = draw(st.sampled_from([DType.F32, DType.F16, DType.BF16]))
    size = {DType.RAW: 1, DType.F32: 4, DType.F16: 2, DType.I32: 4}.get(dtype, 8)
    n = draw(st.integers(1, 8192 // size))
    payload = b""
    length = 0
    if opcode == Opcode.READ:
        length = n * size
    elif opcode in DATA_OPCODES:
        payload = draw(st.binary(min_size=n * size, max_size=n * size))
        length = len(payload)
    elif opcode in (Opcode.FETCH_ADD, Opcode.CAS):
        length = 8
        payload = draw(
            st.binary(
                min_size=8 if opcode == Opcode.FETCH_ADD else 16,
                max_size=8 if opcode == Opcode.FETCH_ADD else 16,
            )
        )
    elif opcode in (Opcode.ACK, Opcode.NACK):
        payload = draw(st.binary(max_size=16))
        length = len(payload)
    segments: tuple[tuple[str, int], ...] = ()
    left = 0
    if opcode == Opcode.CHAIN_ADD:
        segments = tuple(draw(st.lists(_endpoint, min_size=1, max_size=MAX_SEGMENTS)))
        left = draw(st.integers(0, len(segments) - 1))
    return Packet(
        opcode=opcode,
        flags=Flags(draw(st.integers(0, 0x1F)) & ~Flags.SPARSE),
        seq=draw(_u32),
        client_id=draw(_u32),
        txn_id=draw(_u32),
        coll_id=draw(_u32),
        epoch=draw(_u32),
        rkey=draw(_u32),
        length=length,
        addr=draw(st.integers(0, 2**64 - 1)),
        aux_addr=draw(st.integers(0, 2**64 - 1)),
        dtype=dtype,
        reduce_op=draw(st.sampled_from(list(ReduceOp))),
        status=draw(st.sampled_from(list(Status))),
        credit=draw(st.integers(0, 255)),
        segments_left=left,
        segments=segments,
        ret=draw(_endpoint),
        payload=payload,
    )


def run_bench_cli(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    """Run `netdam bench ...` in-process (the parser of netdam/cli/bench.py alone); returns the
    exit code and the JSON object printed."""
    parser = NetdamArgumentParser(prog="netdam")
    cli_bench.register(parser.add_subparsers(dest="command", parser_class=NetdamArgumentParser))
    cliutil.JSON_REQUESTED[0] = "--json" in argv
    try:
        args = parser.parse_args(argv)
        code = args.func(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    except cliutil.CommandError as exc:
        cliutil.emit({"ok": False, "error": str(exc)}, True)
        code = int(exc.code)
    finally:
        cliutil.JSON_REQUESTED[0] = False
    out = capsys.readouterr().out
    return code, json.loads(out)


def run_model_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    """Run `netdam model ...` in-process (the parser of netdam/cli/model.py alone); returns the
    exit code and the JSON object printed (with --json) or the text."""
    parser = NetdamArgumentParser(prog="netdam")
    cli_model.register(parser.add_subparsers(dest="command", parser_class=NetdamArgumentParser))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr().out
    return rc, json.loads(out) if "--json" in argv else out


@contextlib.contextmanager
def every_rank(info: Any, world: int) -> Iterator[list[Any]]:
    """One ProcessGroup per rank of the cluster *info*, all in this process (each call is then
    started on every rank, async, before any is waited on); closed afterwards."""
    from netdam.api import ProcessGroup

    made = [ProcessGroup(info, rank) for rank in range(world)]
    try:
        yield made
    finally:
        for group in made:
            group.close()


def rank_fixtures(world: int) -> tuple[Any, Any]:
    """Module fixtures (cluster, ranks): a running cluster of *world* nodes, and every_rank's
    groups on it. Assign them in a test module: ``cluster, groups = rank_fixtures(3)``."""
    from netdam.cluster.launch import start_cluster

    @pytest.fixture(scope="module")
    def cluster() -> Iterator[Any]:
        with start_cluster(world, memory=4 << 20) as running:
            yield running

    @pytest.fixture(scope="module")
    def ranks(cluster: Any) -> Iterator[list[Any]]:
        with every_rank(cluster.info, world) as made:
            yield made

    return cluster, ranks


def load_example(name: str) -> Any:
    """The module examples/<name>.py, imported from the checkout (examples are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_coll_packet(epoch: int, txn_id: int, rkey: int, tag_key: bytes, **kw: object) -> Packet:
    """A START_COLL built the long way (its descriptor, then the Packet), with a call's fields:
    what protocol.packet.StartCollTemplate and its compiled stamper are held to."""
    payload = CollectiveDescriptor(
        Algo.ALL_REDUCE,
        1,
        1024,
        0x1000,
        0x2000,
        rkey,
        group=("239.77.1.2", 10001),
        timeout_ms=2500,
        tag_key=tag_key,
    ).encode()
    fields: dict[str, object] = dict(
        client_id=77,
        txn_id=txn_id,
        rkey=0xABCD,
        coll_id=9,
        epoch=epoch,
        dtype=DType.F32,
        segments=(("127.0.0.1", 9000), ("127.0.0.1", 9001)),
        length=len(payload),
        payload=payload,
    )
    fields.update(kw)
    return Packet(Opcode.START_COLL, **fields)  # type: ignore[arg-type]
