"""Pool control on the wire (SPEC.md 11.9): ALLOC, FREE and QUERY as datagrams to the VIP of a
real switch process, tenant credentials, and every malformed request answered as documented."""

from __future__ import annotations

import stat
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import VipWire

from netdam.protocol.constants import Opcode, Status
from netdam.protocol.packet import Packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import pack_credential, unpack_region_info
from netdam.switch.controller import ControllerError, PoolController, credential_digest
from netdam.switch.state import load_state

KiB = 1024


def nack(reply: Packet, status: Status) -> None:
    assert reply.opcode == Opcode.NACK, reply
    assert reply.status == status, (reply.status.name, reply.payload)


@pytest.mark.slow
def test_alloc_use_query_free_round_trip(wire: VipWire) -> None:
    reply = wire.alloc(20 * KiB, stride=8192, rights=7, label="t1")
    region = wire.region(reply)
    assert reply.rkey == region.rkey and reply.addr == region.gaddr and region.credential != 0
    assert (
        region.size == 20 * KiB
        and region.stride == 8192
        and len(region.ways) == 2
        and region.label == "t1"
    )
    # The state file (0600) keeps the region, owned by the credential's digest, not the credential.
    state_path = Path(wire.switch.entry.state_file)
    assert stat.S_IMODE(state_path.stat().st_mode) == 0o600
    text = state_path.read_text()
    assert f"{region.credential}" not in text and credential_digest(region.credential) in text
    assert any(
        r.gaddr == region.gaddr and r.rkey == region.rkey for r in load_state(state_path).regions
    )
    # The switch serves it at once: WRITE and READ through the VIP with the rkey.
    data = bytes(range(200))
    ack = wire.raw(
        encode_packet(
            Packet(
                Opcode.WRITE,
                flags=1,
                client_id=77,
                txn_id=5000,
                rkey=region.rkey,
                addr=region.gaddr + 8192,
                length=200,
                payload=data,
            )
        )
    )
    assert ack.opcode == Opcode.ACK
    token = wire.send(Opcode.PING, b"").aux_addr  # a READ over 3x its size needs it (SPEC.md 12.4)
    back = wire.raw(
        encode_packet(
            Packet(
                Opcode.READ,
                client_id=77,
                txn_id=5001,
                rkey=region.rkey,
                addr=region.gaddr + 8192,
                length=200,
                aux_addr=token,
            )
        )
    )
    assert back.payload == data
    # QUERY with the credential alone, then FREE with it.
    queried = wire.region(
        wire.send(Opcode.QUERY, pack_credential(region.credential), addr=region.gaddr)
    )
    assert queried.gaddr == region.gaddr and queried.rkey == region.rkey and queried.credential == 0
    freed = wire.send(Opcode.FREE, pack_credential(region.credential), addr=region.gaddr, txn=7000)
    assert wire.region(freed).gaddr == region.gaddr
    # A retry of the FREE (same txn) gets the same ACK; nothing is freed twice.
    again = wire.send(Opcode.FREE, pack_credential(region.credential), addr=region.gaddr, txn=7000)
    assert encode_packet(again) == encode_packet(freed)
    nack(
        wire.send(Opcode.QUERY, pack_credential(region.credential), addr=region.gaddr),
        Status.NO_ROUTE,
    )
    nack(
        wire.raw(
            encode_packet(
                Packet(
                    Opcode.READ,
                    client_id=77,
                    txn_id=5002,
                    rkey=region.rkey,
                    addr=region.gaddr,
                    length=8,
                )
            )
        ),
        Status.NO_ROUTE,
    )
    # The backing is gone from the nodes too.
    gone = wire.raw(
        encode_packet(
            Packet(
                Opcode.READ,
                client_id=77,
                txn_id=5003,
                rkey=region.rkey,
                addr=region.ways[0].local,
                length=8,
            )
        ),
        wire.cluster.endpoints[0],
    )
    nack(gone, Status.BAD_RKEY)


def test_alloc_retry_allocates_once(wire: VipWire) -> None:
    first = wire.region(wire.alloc(4 * KiB))
    wire.txn -= 1  # the same txn id again: a retry of the ALLOC
    second = wire.region(wire.alloc(4 * KiB))
    assert second == first
    regions = [
        r
        for r in load_state(Path(wire.switch.entry.state_file)).regions
        if r.owner == credential_digest(first.credential)
    ]
    assert [r.gaddr for r in regions] == [first.gaddr]
    wire.send(Opcode.FREE, pack_credential(first.credential), addr=first.gaddr)


def test_tenants_cannot_free_or_query_each_other(wire: VipWire) -> None:
    a = wire.region(wire.alloc(8 * KiB, label="a"))
    b = wire.region(wire.alloc(8 * KiB, label="b"))
    assert a.credential != b.credential
    # B allocates a second region with its credential alone (rkey 0).
    b2 = wire.region(wire.alloc(4 * KiB, b.credential))
    assert b2.credential == b.credential and b2.gaddr > a.gaddr
    cb = pack_credential(b.credential)
    # B cannot free A's region, nor see it: NO_ROUTE, as for an unmapped address.
    nack(wire.send(Opcode.FREE, cb, addr=a.gaddr), Status.NO_ROUTE)
    seen = []
    addr = 0
    while (reply := wire.send(Opcode.QUERY, cb, addr=addr)).opcode == Opcode.ACK:
        seen.append(unpack_region_info(reply.payload))
        addr = seen[-1].gaddr + 1
    nack(reply, Status.NO_ROUTE)
    assert [r.gaddr for r in seen] == [b.gaddr, b2.gaddr]
    assert a.rkey not in {r.rkey for r in seen}
    # Wrong keys: an unknown credential, a wrong admin key, a new tenant without the admin key.
    nack(
        wire.send(Opcode.FREE, pack_credential(b.credential ^ 1), addr=b.gaddr), Status.UNAUTHORIZED
    )
    nack(wire.send(Opcode.QUERY, pack_credential(0), addr=0), Status.UNAUTHORIZED)
    nack(
        wire.send(Opcode.FREE, pack_credential(0), addr=a.gaddr, rkey=wire.admin ^ 4),
        Status.UNAUTHORIZED,
    )
    nack(wire.alloc(4 * KiB, rkey=0), Status.UNAUTHORIZED)
    nack(wire.alloc(4 * KiB, 12345), Status.UNAUTHORIZED)
    # A's region is untouched and still A's; the admin key sees and frees everything.
    assert (
        wire.region(wire.send(Opcode.QUERY, pack_credential(a.credential), addr=a.gaddr)).rkey
        == a.rkey
    )
    for r in (a, b, b2):
        wire.region(wire.send(Opcode.FREE, pack_credential(0), addr=r.gaddr, rkey=wire.admin))


def _alloc_bytes(
    size: int = 4096,
    credential: int = 0,
    stride: int = 0,
    ways: int = 0,
    rights: int = 7,
    reserved: int = 0,
) -> bytes:
    return struct.pack("<QQIHBB16s", size, credential, stride, ways, rights, reserved, b"")


def test_malformed_pool_requests_are_nacked_as_documented(wire: VipWire) -> None:
    admin = wire.admin
    alloc = encode_packet(
        Packet(Opcode.ALLOC, client_id=77, txn_id=9000, length=40, payload=_alloc_bytes())
    )

    def patched(offset: int, new: bytes, txn: int) -> bytes:
        data = alloc[:offset] + new + alloc[offset + len(new) :]
        return data[:12] + txn.to_bytes(4, "big") + data[16:]

    cases = [  # (datagram, status): SPEC.md 11.9's order of checks, each sealed as the admin's
        (patched(28, (39).to_bytes(4, "big"), 9001), Status.BAD_LENGTH),  # length field
        (patched(0, b"", 9002)[:96], Status.BAD_LENGTH),  # payload cut short
        (patched(64 + 23, b"\x02", 9003), Status.BAD_FIELD),  # an undefined flag (bit 0 is TAGGED)
        (patched(64, bytes(8), 9005), Status.BAD_FIELD),  # size 0
        (patched(64 + 22, b"\x00", 9006), Status.BAD_FIELD),  # rights 0
        (patched(64 + 22, b"\x08", 9007), Status.BAD_FIELD),  # undefined right
        (
            patched(64 + 16, struct.pack("<I", 12), 9008),
            Status.BAD_FIELD,
        ),  # stride not a multiple of 8
        (
            patched(64 + 16, struct.pack("<IH", 8192, 3), 9009),
            Status.BAD_FIELD,
        ),  # 3 ways of 2 nodes
        (patched(64 + 20, struct.pack("<H", 1), 9010), Status.BAD_FIELD),  # ways without a stride
        (patched(64, struct.pack("<Q", 1 << 40), 9011), Status.NO_SPACE),  # no room
        (patched(52, b"\x01\x00\x01", 9012) + bytes(8), Status.BAD_SEGMENT),  # an SR list
    ]
    for data, status in cases:
        nack(wire.raw(wire.sealed(data)), status)
    # The admin key alone, unsealed, is refused: the switch takes the admin's control tag only.
    nack(wire.raw(patched(24, admin.to_bytes(4, "big"), 9004)), Status.UNAUTHORIZED)
    for k, opcode in enumerate((Opcode.FREE, Opcode.QUERY)):
        good = encode_packet(
            Packet(opcode, client_id=77, txn_id=9100 + k, length=8, payload=pack_credential(0))
        )
        nack(wire.raw(wire.sealed(good + bytes(8))), Status.BAD_LENGTH)  # 16 payload bytes
        nack(wire.raw(wire.sealed(good[:64])), Status.BAD_LENGTH)  # none
    nack(wire.send(Opcode.FREE, pack_credential(0), rkey=admin, addr=1 << 32 | 5), Status.NO_ROUTE)
    nack(wire.send(Opcode.QUERY, pack_credential(0), rkey=admin, addr=1 << 62), Status.NO_ROUTE)
    # A NACK from the allocator says why in UTF-8; a node answers pool opcodes BAD_FIELD.
    assert wire.raw(wire.sealed(cases[3][0])).payload.decode().startswith("size must be")
    nack(
        wire.send(Opcode.ALLOC, _alloc_bytes(), rkey=admin, to=wire.cluster.endpoints[0]),
        Status.BAD_FIELD,
    )
    # Nothing was allocated and the switch still answers.
    assert wire.send(Opcode.PING, b"").opcode == Opcode.INFO
    assert load_state(Path(wire.switch.entry.state_file)).regions == []


def test_controller_uses_the_wire(wire: VipWire) -> None:
    admin = PoolController(wire.cluster.path)
    region = admin.alloc(16 * KiB, interleave=8192, tenant="ctl")
    credential = int(region.extra["credential"])
    tenant = PoolController(wire.cluster.path, credential=credential)
    assert [r.gaddr for r in tenant.regions()] == [region.gaddr]
    mine = tenant.alloc(4 * KiB)
    assert {r.gaddr for r in tenant.regions()} == {region.gaddr, mine.gaddr}
    other = PoolController(
        wire.cluster.path, credential=credential ^ 0xFF, timeout=0.3
    )  # its refusal is unsealed: one wait
    with pytest.raises(ControllerError, match="UNAUTHORIZED"):
        other.free(region.gaddr)
    tenant.free(mine.gaddr)
    with pytest.raises(ControllerError, match="no region at"):
        tenant.free(mine.gaddr)
    admin.free(region.gaddr)
    assert admin.regions() == []
    _ = replace, endpoint_to_u64  # imported for readers of the datagrams above


def test_cli_keeps_tenant_credentials_off_the_command_line(
    wire: VipWire, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`netdam pool alloc --save-credential F` writes the new tenant's credential to F, mode 0600;
    query and free take it back with --credential-file (a file others can read is refused with
    the fix), so the credential never has to appear in argv, where `ps` shows it."""
    import json

    from netdam.cli.main import main as netdam

    path = str(wire.cluster.path)
    key = tmp_path / "tenant.key"
    assert (
        netdam(
            [
                "pool",
                "alloc",
                "--cluster",
                path,
                "--size",
                "16KiB",
                "--save-credential",
                str(key),
                "--json",
            ]
        )
        == 0
    )
    made = json.loads(capsys.readouterr().out)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert int(key.read_text(), 16) == int(made["credential"], 16)
    gaddr = made["gaddr_hex"]
    assert (
        netdam(
            [
                "pool",
                "query",
                "--cluster",
                path,
                "--gaddr",
                gaddr,
                "--credential-file",
                str(key),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["gaddr_hex"] == gaddr
    key.chmod(0o644)
    assert (
        netdam(["pool", "free", "--cluster", path, "--gaddr", gaddr, "--credential-file", str(key)])
        == 2
    )
    assert "chmod 600" in capsys.readouterr().err
    key.chmod(0o600)
    assert (
        netdam(["pool", "free", "--cluster", path, "--gaddr", gaddr, "--credential-file", str(key)])
        == 0
    )
    capsys.readouterr()
    # Another tenant's credential file frees nothing of this tenant's (NO_ROUTE, SPEC.md 11.9).
    other = tmp_path / "other.key"
    assert (
        netdam(
            ["pool", "alloc", "--cluster", path, "--size", "8KiB", "--save-credential", str(other)]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        netdam(
            [
                "pool",
                "alloc",
                "--cluster",
                path,
                "--size",
                "8KiB",
                "--credential-file",
                str(key),
                "--json",
            ]
        )
        == 0
    )
    mine = json.loads(capsys.readouterr().out)["gaddr_hex"]
    assert (
        netdam(
            ["pool", "free", "--cluster", path, "--gaddr", mine, "--credential-file", str(other)]
        )
        == 3
    )
    assert (
        netdam(["pool", "free", "--cluster", path, "--gaddr", mine, "--credential-file", str(key)])
        == 0
    )


def test_cli_allocates_tagged_regions_and_keeps_their_keys_in_0600_files(
    wire: VipWire, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`netdam pool alloc` makes a tagged region (SPEC.md 2.6) and prints no key; with
    --save-tag-key the key goes to a 0600 file, which read and write take with --tag-key-file.
    A wrong key gets no answer it could trust (a timeout naming what was ignored); --untagged
    makes a region of SPEC v1 before tags."""
    import json

    from netdam.cli.main import main as netdam

    path = str(wire.cluster.path)
    key = tmp_path / "region.tag"
    assert (
        netdam(
            [
                "pool",
                "alloc",
                "--cluster",
                path,
                "--size",
                "8KiB",
                "--save-tag-key",
                str(key),
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    made = json.loads(out)
    assert made["tagged"] is True and "tag_key" not in made
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().strip()[2:] not in out  # the key is in the file only
    gaddr, rkey = made["gaddr_hex"], made["rkey_hex"]
    common = ["--cluster", path, "--gaddr", gaddr, "--rkey", rkey, "--tag-key-file", str(key)]
    assert netdam(["pool", "write", *common, "--data", "sealed"]) == 0
    assert netdam(["pool", "read", *common, "--length", "6B", "--format", "text"]) == 0
    assert capsys.readouterr().out.endswith("sealed\n")
    wrong = tmp_path / "wrong.tag"
    wrong.write_text("0x" + "11" * 16 + "\n")
    wrong.chmod(0o600)
    bad = ["--cluster", path, "--gaddr", gaddr, "--rkey", rkey, "--tag-key-file", str(wrong)]
    assert netdam(["pool", "write", *bad, "--data", "forged"]) == 3
    assert "no answer" in capsys.readouterr().err
    assert netdam(["pool", "free", "--cluster", path, "--gaddr", gaddr]) == 0
    capsys.readouterr()
    assert (
        netdam(["pool", "alloc", "--cluster", path, "--size", "4KiB", "--untagged", "--json"]) == 0
    )
    plain = json.loads(capsys.readouterr().out)
    assert plain["tagged"] is False
    assert netdam(["pool", "free", "--cluster", path, "--gaddr", plain["gaddr_hex"]]) == 0


def test_top_shows_each_process_rates(wire: VipWire, capsys: pytest.CaptureFixture[str]) -> None:
    """`netdam top --json`: one sample per line, per NIC and the switch. 300 PINGs sent to node 0
    while it runs show as node 0's received packets (and its answers as sent ones), and not at
    node 1."""
    import json
    import socket
    import threading

    from netdam.cli.main import main

    node0 = wire.cluster.endpoints[0]

    def ping_node0() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            for k in range(300):
                s.sendto(encode_packet(Packet(Opcode.PING, txn_id=k)), node0)

    top = ["top", "--cluster", str(wire.cluster.path), "--json", "--count"]
    assert (
        main([*top, "1", "--interval", "0.05"]) == 0
    )  # imports done: the next run's baseline is at once
    capsys.readouterr()
    sender = threading.Timer(0.15, ping_node0)  # inside the first interval
    sender.start()
    assert main([*top, "2", "--interval", "0.5"]) == 0
    sender.join()
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["name"] for row in first["processes"]] == ["rank 0", "rank 1", "switch"]
    rank0, rank1 = first["processes"][0], first["processes"][1]
    # Each COUNTERS answer is itself a datagram in and out: a few besides the PINGs.
    assert 300 <= rank0["moved"]["rx_packets"] <= 310 and rank0["moved"]["tx_packets"] >= 300
    assert rank0["ops"]["PING"] == 300 and "PING" not in rank1["ops"]
    assert rank0["rx_pps"] == pytest.approx(rank0["moved"]["rx_packets"] / rank0["interval_s"])
    assert second["sample"] == 2 and second["processes"][0]["moved"].get("rx_packets", 0) < 10


def test_top_rates_are_deltas_over_time() -> None:
    """rates(): counters wrap as u64 do, and a zero interval is refused."""
    from netdam.protocol import counters as C
    from netdam.tools.top import rates

    before, after = C.new_counters(), C.new_counters()
    before[C.RX_BYTES] = 2**64 - 500  # wraps to 1,000 bytes
    after[C.RX_BYTES] = 500
    after[C.RETRANSMITS] = 6
    after[C.DROP_LOCKOUT] = 4
    got = rates(before, after, 2.0)
    assert got["rx_gbps"] == pytest.approx(1000 * 8 / 2.0 / 1e9)
    assert (
        got["retransmits_ps"] == 3.0
        and got["drops_ps"] == 2.0
        and got["moved"]["drop_lockout"] == 4
    )
    with pytest.raises(ValueError):
        rates(before, after, 0.0)


def test_top_shows_pool_operations_by_tenant(
    wire: VipWire, capsys: pytest.CaptureFixture[str]
) -> None:
    """`netdam top --json` with a pool switch: each tenant's reads, writes and atomics per
    second from the switch's per-region counters, named by the tenant's label."""
    import json
    import threading

    from netdam.cli.main import main
    from netdam.clients.pool import PoolClient, tag_keys_of

    admin = PoolController(wire.cluster.path)
    region = admin.alloc(16 * KiB, interleave=8192, tenant="tops")
    other = admin.alloc(4 * KiB, tenant="idle")

    def traffic() -> None:
        with PoolClient(wire.switch.vip, tag_keys=tag_keys_of(region)) as client:
            for k in range(40):
                client.write(region.gaddr, bytes([k]) * 64, region.rkey, stride=region.stride)
            for _ in range(60):
                client.read(region.gaddr, 64, region.rkey, stride=region.stride)

    try:
        worker = threading.Timer(0.2, traffic)  # inside the first interval
        worker.start()
        top = ["top", "--cluster", str(wire.cluster.path), "--json", "--count", "2"]
        assert main([*top, "--interval", "0.8"]) == 0
        worker.join()
        first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        seconds = first["links_interval_s"]  # ~ the pool's interval too (read right after)
        tops = first["pool_ops"]["tops"]
        assert tops["writes_ps"] * seconds == pytest.approx(40, rel=0.1)
        assert tops["reads_ps"] * seconds == pytest.approx(60, rel=0.1)
        assert first["pool_ops"]["idle"] == {"reads_ps": 0, "writes_ps": 0, "atomics_ps": 0}
        assert second["pool_ops"]["tops"]["reads_ps"] == 0
    finally:
        admin.free(region.gaddr)
        admin.free(other.gaddr)
