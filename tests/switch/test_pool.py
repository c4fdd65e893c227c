"""The memory pool on real processes: switch + 3 nodes, controller, blocking and asyncio
clients, rkeys, multicast, retries under injected loss, restart with persisted state."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from netdam.clients.async_pool import AsyncPoolClient
from netdam.clients.pool import PoolClient, PoolError, tag_keys_of
from netdam.cluster.clusterfile import load_switch_entry
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import LocalCluster, SwitchHandle, start_pool_cluster, start_switch
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Flags, Opcode, Rights, Status
from netdam.protocol.packet import Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.switch.controller import PoolController
from netdam.switch.core import counters_from_payload

ROOT = Path(__file__).resolve().parents[2]
KiB = 1024


class Pool:
    def __init__(self, cluster: LocalCluster, switch: SwitchHandle) -> None:
        self.cluster, self.switch = cluster, switch
        self.controller = PoolController(cluster.path)

    def restart_switch(self, faults: str = "", seed: int = 0) -> None:
        self.switch.stop()
        self.switch = start_switch(self.cluster, self.switch.vip, faults=faults, seed=seed)

    def switch_counters(self) -> dict[str, object]:
        with ControlClient.for_cluster(self.cluster.info) as client:
            # 6 tries: right after a run with injected faults the switch may still be draining
            # delayed duplicates on a loaded machine (one suite run lost 3 tries in 3 s).
            reply = client.request(
                self.switch.entry.control_endpoint,
                Packet(Opcode.COUNTERS, rkey=self.cluster.info.admin_key),
                retries=5,
            )
        return counters_from_payload(reply.payload)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    path = tmp_path_factory.mktemp("pool") / "c.toml"
    cluster, switch = start_pool_cluster(3, memory=1 << 20, cluster_path=path)
    p = Pool(cluster, switch)
    try:
        yield p
    finally:
        p.switch.stop()
        cluster.stop()


@pytest.mark.slow
def test_cluster_file_names_the_switch(pool: Pool) -> None:
    entry = load_switch_entry(pool.cluster.path)
    assert (
        entry is not None and entry.vip == pool.switch.vip and entry.pid == pool.switch.process.pid
    )
    assert Path(entry.state_file).exists()


def test_alloc_write_read_free_blocking(pool: Pool) -> None:
    ctl = pool.controller
    inter = ctl.alloc(100 * KiB + 40, interleave=8 * KiB)
    # Untagged (SPEC v1): its backing is read directly at the node below, by rkey alone.
    ranged = ctl.alloc(20 * KiB, rights=int(Rights.READ | Rights.WRITE), tenant="b", tagged=False)
    assert len(inter.ways) == 3 and inter.rkey != ranged.rkey
    assert inter.end <= ranged.gaddr  # tenants never overlap, globally ...
    local = [(w.node, w.local, w.local + w.size) for r in ctl.regions() for w in r.ways]
    for i, (n1, s1, e1) in enumerate(local):  # ... nor in node memory
        assert all(n1 != n2 or e1 <= s2 or e2 <= s1 for n2, s2, e2 in local[i + 1 :])
    data = bytes((k * 7) % 251 for k in range(inter.size))
    with PoolClient(pool.switch.vip, window=16, tag_keys=tag_keys_of(inter, ranged)) as client:
        client.write(inter.gaddr, data, inter.rkey, stride=inter.stride)
        assert client.read(inter.gaddr, inter.size, inter.rkey, stride=inter.stride) == data
        client.write(ranged.gaddr, b"x" * 9000, ranged.rkey)
        assert client.read(ranged.gaddr + 8990, 10, ranged.rkey) == b"x" * 10
        with pytest.raises(PoolError, match="BAD_RKEY"):
            client.read(inter.gaddr, 8, ranged.rkey)
        with pytest.raises(PoolError, match="OUT_OF_BOUNDS"):
            client.read(ranged.gaddr + 20 * KiB - 4, 8, ranged.rkey)
        with pytest.raises(PoolError, match="NO_RIGHTS"):
            client.fetch_add(ranged.gaddr, 1, ranged.rkey)
        with pytest.raises(PoolError, match="SPANS_NODES"):
            client.read(inter.gaddr + 8 * KiB - 4, 8, inter.rkey)  # no stride given: not split
        # The backing on a node is registered under the same rkey, for exactly its range.
        way = ranged.ways[0]
        node = pool.cluster.endpoints[way.node]
        with ControlClient() as direct:
            assert direct.read(node, ranged.rkey, way.local, 4) == b"xxxx"
            with pytest.raises(ControlError, match="OUT_OF_BOUNDS"):
                direct.read(node, ranged.rkey, way.local + way.size - 4, 8)
        ctl.free(ranged.gaddr)
        with pytest.raises(PoolError, match="NO_ROUTE"):
            client.read(ranged.gaddr, 8, ranged.rkey)
        with ControlClient() as direct, pytest.raises(ControlError, match="BAD_RKEY"):
            direct.read(node, ranged.rkey, way.local, 4)
    ctl.free(inter.gaddr)


def test_asyncio_client_concurrent_atomics(pool: Pool) -> None:
    region = pool.controller.alloc(16 * KiB, interleave=8 * KiB)

    async def run() -> tuple[int, list[int], int, bytes]:
        async with await AsyncPoolClient.open(
            pool.switch.vip, window=16, tag_keys=tag_keys_of(region)
        ) as client:
            olds = await asyncio.gather(
                *(client.fetch_add(region.gaddr + 8 * KiB, 3, region.rkey) for _ in range(50))
            )
            await client.write(region.gaddr, b"a" * 10000, region.rkey, stride=region.stride)
            first = await client.cas(region.gaddr + 16, 0, 42, region.rkey)
            second = await client.cas(region.gaddr + 16, 0, 43, region.rkey)
            back = await client.read(region.gaddr, 16, region.rkey)
            return first, sorted(olds), second, back

    first, olds, second, back = asyncio.run(run())
    assert [v - olds[0] for v in olds] == [3 * k for k in range(50)]  # each add applied once
    assert first == int.from_bytes(b"a" * 8, "little") and second == first  # both compares failed
    assert back == b"a" * 16
    pool.controller.free(region.gaddr)


def test_multicast_through_the_switch(pool: Pool) -> None:
    group = ("239.77.0.5", 7744)
    rkey = 0x6C0FFEE
    nodes = pool.cluster.endpoints
    with ControlClient.for_cluster(pool.cluster.info) as admin:
        for ep in nodes:
            admin.register(ep, 1000 * KiB, 4 * KiB, Rights.READ | Rights.WRITE, rkey=rkey)
    for ep in nodes[:2]:
        pool.controller.join(group, ep)
    payload = bytes(range(64))
    packet = Packet(
        Opcode.ALL_WRITE,
        flags=Flags.MCAST | Flags.ACK_REQ,
        client_id=5,
        txn_id=1,
        rkey=rkey,
        addr=1000 * KiB + 64,
        aux_addr=endpoint_to_u64(group),
        dtype=DType.RAW,
        length=64,
        payload=payload,
    )
    acks = set()
    with ControlClient() as client:
        client.sock.settimeout(2.0)
        client.sock.sendto(encode_packet(packet), pool.switch.vip)
        while len(acks) < 2:
            data, src = client.sock.recvfrom(65536)
            reply = decode_packet(data)
            assert reply.opcode == Opcode.ACK and reply.flags & Flags.MCAST
            acks.add(src)
        for k, ep in enumerate(nodes):
            assert (client.read(ep, rkey, 1000 * KiB + 64, 64) == payload) == (k < 2)
    assert acks == {nodes[0], nodes[1]}
    assert pool.switch_counters()["switch"]["replicated"] >= 2


@pytest.mark.slow
def test_restart_keeps_map_rkeys_and_groups(pool: Pool) -> None:
    region = pool.controller.alloc(24 * KiB, interleave=8 * KiB)
    pool.controller.join(("239.77.0.9", 7744), pool.cluster.endpoints[2])
    with PoolClient(pool.switch.vip, tag_keys=tag_keys_of(region)) as client:
        client.write(region.gaddr, b"persist!" * 3000, region.rkey, stride=region.stride)
    old_pid = pool.switch.process.pid
    pool.restart_switch()
    assert pool.switch.process.pid != old_pid
    with PoolClient(pool.switch.vip, tag_keys=tag_keys_of(region)) as client:
        assert (
            client.read(region.gaddr, 24000, region.rkey, stride=region.stride)
            == b"persist!" * 3000
        )
    counters = pool.switch_counters()
    assert counters["switch"]["groups"] >= 1 and counters["switch"]["regions"] >= 1
    assert any(r["gaddr"] == region.gaddr for r in counters["regions"])
    pool.controller.free(region.gaddr)


@pytest.mark.slow
def test_retries_under_injected_loss_never_apply_twice(pool: Pool) -> None:
    region = pool.controller.alloc(16 * KiB, interleave=8 * KiB)
    # Requests are lost, duplicated and delayed past the client's timeout on every link.
    pool.restart_switch(
        faults="client:rx:loss=0.2;node0:tx:dup=0.3,delay=0.3,delay_ms=30;"
        "node1:tx:dup=0.3,delay=0.3,delay_ms=30;node2:tx:loss=0.2",
        seed=7,
    )
    try:
        with PoolClient(
            pool.switch.vip, timeout=0.01, retries=50, window=8, tag_keys=tag_keys_of(region)
        ) as client:
            for offset in (0, 8 * KiB):
                olds = [client.fetch_add(region.gaddr + offset, 1, region.rkey) for _ in range(30)]
                assert [v - olds[0] for v in olds] == list(range(30))
                from netdam.clients.pool import fetch_add_packet

                replies = client.execute(
                    [fetch_add_packet(region.gaddr + offset + 8, 2, region.rkey)] * 40
                )
                values = sorted(struct.unpack("<Q", r.payload)[0] for r in replies)
                assert [v - values[0] for v in values] == [2 * k for k in range(40)]
            assert client.retransmits > 0
        counters = pool.switch_counters()
        ports = {p["port"]: p for p in counters["ports"]}
        assert ports["client"]["fault_drops_rx"] > 0 and ports["node0"]["fault_dups"] > 0
        with ControlClient.for_cluster(pool.cluster.info) as admin:
            replays = sum(int(admin.counters(ep)[C.DUP_REPLAYS]) for ep in pool.cluster.endpoints)
        assert replays > 0  # duplicates reached nodes and were answered from the window
    finally:
        pool.restart_switch()
        pool.controller.free(region.gaddr)


def test_plain_socket_example(pool: Pool) -> None:
    """The stdlib-only example allocates, uses and frees a region with documented datagrams."""
    before = {r.gaddr for r in pool.controller.regions()}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "pool_plain_socket.py"),
            "--cluster",
            str(pool.cluster.path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "relayed: True" in result.stdout and "NO_ROUTE" in result.stdout
    assert result.stdout.strip().endswith("ok")
    assert {r.gaddr for r in pool.controller.regions()} == before  # freed again


def test_switch_nacks_control_it_does_not_serve(pool: Pool) -> None:
    with ControlClient.for_cluster(pool.cluster.info) as admin:
        with pytest.raises(ControlError, match="BAD_FIELD") as info:
            admin.register(pool.switch.vip, 0, 64, Rights.READ)
        assert info.value.status == Status.BAD_FIELD


def pool_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """`netdam ARGV`, with netdam.cli.pool registered even before cli.py lists it."""
    import netdam.cli.main as cli

    if "netdam.cli.pool" not in cli._COMMAND_MODULES:
        monkeypatch.setattr(cli, "_COMMAND_MODULES", (*cli._COMMAND_MODULES, "netdam.cli.pool"))
    return cli.main(argv)


def test_pool_cli(
    pool: Pool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    c = str(pool.cluster.path)
    assert (
        pool_cli(
            ["pool", "alloc", "--cluster", c, "--size", "20KiB", "--interleave", "8KiB", "--json"],
            monkeypatch,
        )
        == 0
    )
    region = json.loads(capsys.readouterr().out)
    assert region["stride"] == 8192 and len(region["ways"]) == 3
    gaddr = region["gaddr_hex"]
    assert (
        pool_cli(
            ["pool", "write", "--cluster", c, "--gaddr", gaddr, "--data", "x" * 10000], monkeypatch
        )
        == 0
    )
    capsys.readouterr()
    assert (
        pool_cli(
            [
                "pool",
                "read",
                "--cluster",
                c,
                "--gaddr",
                hex(region["gaddr"] + 8190),
                "--length",
                "4B",
                "--json",
            ],
            monkeypatch,
        )
        == 0
    )
    assert (
        json.loads(capsys.readouterr().out)["hex"] == "78787878"
    )  # split at the stride by the CLI
    assert (
        pool_cli(
            [
                "pool",
                "read",
                "--cluster",
                c,
                "--gaddr",
                gaddr,
                "--length",
                "3B",
                "--format",
                "text",
            ],
            monkeypatch,
        )
        == 0
    )
    assert capsys.readouterr().out == "xxx\n"
    assert (
        pool_cli(
            [
                "pool",
                "read",
                "--cluster",
                c,
                "--gaddr",
                gaddr,
                "--length",
                "8B",
                "--rkey",
                "1",
                "--json",
            ],
            monkeypatch,
        )
        == 1
    )
    assert "BAD_RKEY" in json.loads(capsys.readouterr().out)["error"]
    assert pool_cli(["pool", "stats", "--cluster", c, "--json"], monkeypatch) == 0
    assert json.loads(capsys.readouterr().out)["switch"]["regions"] >= 1
    assert pool_cli(["pool", "free", "--cluster", c, "--gaddr", gaddr], monkeypatch) == 0
    capsys.readouterr()
    assert pool_cli(["pool", "free", "--cluster", c, "--gaddr", gaddr, "--json"], monkeypatch) == 3
    assert "no region at" in json.loads(capsys.readouterr().out)["error"]


def test_a_tagged_region_through_the_vip_takes_only_sealed_requests(pool: Pool) -> None:
    """SPEC.md 2.6 and 11.3: the pool's regions are tagged by default. The switch checks the
    client's tag, rewrites the address and seals anew for the node, which checks it again and
    seals its answer; the rkey alone opens nothing, at the switch or at the node."""
    ctl = pool.controller
    region = ctl.alloc(16 * KiB, interleave=8 * KiB)
    assert len(region.tag_key) == 16 and any(region.tag_key)
    assert ctl.query(region.gaddr).tag_key == region.tag_key  # the owner may ask again
    data = bytes(range(256)) * 64
    with PoolClient(pool.switch.vip, tag_keys=tag_keys_of(region)) as client:
        client.write(region.gaddr, data, region.rkey, stride=region.stride)
        assert client.read(region.gaddr, len(data), region.rkey, stride=region.stride) == data
        assert client.fetch_add(region.gaddr + 8 * KiB, 5, region.rkey) == int.from_bytes(
            data[8 * KiB : 8 * KiB + 8], "little"
        )
        assert client.unsealed == 0
    with PoolClient(pool.switch.vip, timeout=0.05, retries=1) as keyless:
        with pytest.raises(PoolError, match="BAD_RKEY"):
            keyless.write(region.gaddr, b"\0" * 64, region.rkey)
        with pytest.raises(PoolError, match="BAD_RKEY"):
            keyless.read(region.gaddr, 64, region.rkey)
    wrong = bytes(16 - k for k in range(16))
    with PoolClient(
        pool.switch.vip, timeout=0.05, retries=1, tag_keys={region.rkey: wrong}
    ) as forger:
        with pytest.raises(PoolError, match="no answer"):
            forger.write(region.gaddr, b"\0" * 64, region.rkey)

    async def asyncio_clients() -> None:
        async with await AsyncPoolClient.open(
            pool.switch.vip, tag_keys=tag_keys_of(region)
        ) as client:
            assert await client.read(region.gaddr, 64, region.rkey) == data[:64]
        async with await AsyncPoolClient.open(pool.switch.vip, retries=1) as keyless:
            with pytest.raises(PoolError, match="BAD_RKEY"):
                await keyless.read(region.gaddr, 64, region.rkey)
        async with await AsyncPoolClient.open(
            pool.switch.vip, retries=1, tag_keys={region.rkey: wrong}
        ) as forger:
            with pytest.raises(PoolError, match="tag key"):
                await forger.write(region.gaddr, b"\0" * 64, region.rkey)

    asyncio.run(asyncio_clients())
    way = region.ways[0]
    with ControlClient() as direct, pytest.raises(ControlError, match="BAD_RKEY"):
        direct.read(pool.cluster.endpoints[way.node], region.rkey, way.local, 8)
    with PoolClient(pool.switch.vip, tag_keys=tag_keys_of(region)) as client:
        added = (int.from_bytes(data[8 * KiB : 8 * KiB + 8], "little") + 5).to_bytes(8, "little")
        after = data[: 8 * KiB] + added + data[8 * KiB + 8 :]  # the FETCH_ADD, and no forged WRITE
        assert client.read(region.gaddr, len(data), region.rkey, stride=region.stride) == after
    assert pool.switch_counters()["drop_region_forged"] >= 1
    ctl.free(region.gaddr)
    untagged = ctl.alloc(4 * KiB, tagged=False)  # SPEC v1's region: its rkey alone opens it
    assert untagged.tag_key == b""
    with PoolClient(pool.switch.vip) as plain:
        plain.write(untagged.gaddr, b"v1 client", untagged.rkey)
        assert plain.read(untagged.gaddr, 9, untagged.rkey) == b"v1 client"
    ctl.free(untagged.gaddr)


@pytest.mark.slow
def test_the_pool_at_an_emulation_mtu_moves_60_kib_a_datagram(tmp_path: Path) -> None:
    """SPEC.md 2.7 through the switch: at MTU 65000 the switch and its nodes take 61440-byte
    payloads, a client splits at that, and an interleaved region still splits at its stride."""
    cluster, switch = start_pool_cluster(
        2, memory=1 << 20, cluster_path=tmp_path / "c.toml", mtu=65000
    )
    try:
        ctl = PoolController(cluster.path)
        ranged, inter = ctl.alloc(300 * KiB), ctl.alloc(96 * KiB, interleave=8 * KiB)
        data = bytes((k * 13) % 251 for k in range(300 * KiB))
        keys = tag_keys_of(ranged, inter)
        with PoolClient(switch.vip, mtu=cluster.info.mtu, tag_keys=keys) as client:
            assert client.max_payload == 61440
            before = pool_switch_counters(cluster, switch)
            client.write(ranged.gaddr + 8, data[: 300 * KiB - 8], ranged.rkey)
            assert client.read(ranged.gaddr + 8, 300 * KiB - 8, ranged.rkey) == data[:-8]
            after = pool_switch_counters(cluster, switch)
            # The requests pass the switch (a node answers the client itself), + its counters
            # asks: 307192 bytes in 61440-byte pieces are 5 WRITEs and 5 READs (at 9000: 38 each).
            assert 5 + 5 <= after["rx_packets"] - before["rx_packets"] <= 5 + 5 + 2
            client.write(inter.gaddr, data[: 96 * KiB], inter.rkey, stride=inter.stride)
            assert (
                client.read(inter.gaddr, 96 * KiB, inter.rkey, stride=inter.stride)
                == data[: 96 * KiB]
            )
    finally:
        switch.stop()
        cluster.stop()


def pool_switch_counters(cluster: LocalCluster, switch: SwitchHandle) -> dict[str, object]:
    """The switch's counters, asked at its control port."""
    return Pool(cluster, switch).switch_counters()
