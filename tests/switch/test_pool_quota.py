"""Fair shares of the pool (SPEC.md 11.9, 12.4): quotas per tenant, placement that treats each
node's region table as a resource and moves on when a node refuses, and two leaks at the switch
(PING showing what others allocated; QUERY as a reflection amplifier).

Two tiers: the allocator (``PoolService``) and ``SwitchCore`` in memory, with nodes that behave
as SPEC.md 6.1 tells the allocator (fast, exact numbers); then a real switch and nodes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from helpers import VipWire
from pool_memory import ADMIN, PAGE, Allocator, exchange, ok, refused, switch_with_pool

from netdam.cluster.control import ControlClient, ControlError
from netdam.core.guard import GuardConfig
from netdam.core.node import MAX_REGIONS
from netdam.protocol import counters as C
from netdam.protocol.constants import AMPLIFICATION_FACTOR, Opcode, Rights, Status
from netdam.protocol.packet import Packet
from netdam.protocol.payloads import AllocRequest, pack_credential, unpack_region_info
from netdam.switch import controller
from netdam.switch.controller import ControllerError, PoolController, credential_digest
from netdam.switch.state import Quota, load_state, set_quota

KiB = 1024


def test_one_tenant_cannot_take_the_whole_pool(tmp_path: Path) -> None:
    """Measured before: one tenant took the whole free pool in 27 ALLOCs and every other tenant,
    the admin too, then got NO_SPACE. Now the default quota stops it at half the pool."""
    pool = Allocator(tmp_path, [1 << 20, 1 << 20])
    a, _ = pool.tenant(label="a")
    allocs = 0
    while (reply := pool.alloc(64 * KiB, a)).opcode == Opcode.ACK:
        allocs += 1
        assert allocs < 64, "tenant a was never stopped"
    text = refused(reply, Status.QUOTA)
    assert text.startswith("byte quota") and "'a'" in text and "1048576" in text
    held, _ = pool.state().usage(credential_digest(a))
    assert held <= (2 << 20) // 2  # the default: 50% of the pool's bytes
    assert held > (2 << 20) // 2 - 64 * KiB  # ... and all of that was usable
    b, _ = pool.tenant(label="b")
    ok(pool.alloc(256 * KiB, b))
    ok(pool.alloc(256 * KiB, admin=True))  # a new tenant by the admin
    ok(pool.alloc(128 * KiB, a, admin=True))  # the admin's ALLOCs are never limited


def test_region_quota_refuses_until_a_region_is_freed(tmp_path: Path) -> None:
    pool = Allocator(tmp_path, [1 << 20])
    a, first = pool.tenant(label="a")
    digest = credential_digest(a)
    for _ in range(63):  # 64 regions by default, the first included
        ok(pool.alloc(8, a))
    text = refused(pool.alloc(8, a), Status.QUOTA)
    assert text == "region quota: tenant 'a' holds 64 of its 64 regions"
    b, _ = pool.tenant(label="b")
    ok(pool.alloc(8, b))  # another tenant is not held back
    ok(pool.free(first, a))
    ok(pool.alloc(8, a))
    refused(pool.alloc(8, a), Status.QUOTA)
    # The admin gives a a quota of its own: 66 regions, two more than it holds.
    set_quota(pool.path, digest, Quota(regions=66))
    ok(pool.alloc(8, a))
    ok(pool.alloc(8, a))
    refused(pool.alloc(8, a), Status.QUOTA)
    # A tenant's byte quota, absolute: the footprint counts whole pages (8 bytes take a page).
    set_quota(pool.path, digest, Quota(bytes=67 * PAGE, regions=100))
    ok(pool.alloc(8, a))
    assert refused(pool.alloc(8, a), Status.QUOTA).startswith(
        "byte quota: tenant 'a' holds 274432 of its 274432 B"
    )
    # The default quota applies to every tenant without its own.
    set_quota(pool.path, None, Quota(regions=1))
    assert refused(pool.alloc(8, b), Status.QUOTA).startswith("region quota")
    ok(pool.alloc(8, b, admin=True))
    state = pool.state()
    assert state.quota_of(digest) == Quota(bytes=67 * PAGE, regions=100)
    assert state.quota_of(credential_digest(b)) == Quota(percent=50.0, regions=1)


def test_quotas_survive_in_the_state_file_and_old_files_load(tmp_path: Path) -> None:
    pool = Allocator(tmp_path, [1 << 20])
    a, _ = pool.tenant(label="a")
    set_quota(pool.path, credential_digest(a), Quota(percent=10.0))
    set_quota(pool.path, None, Quota(bytes=1 << 19, regions=5))
    data = json.loads(pool.path.read_text())
    assert data["format"] == 1 and data["quotas"]["default"] == {"bytes": 1 << 19, "regions": 5}
    assert data["quotas"]["tenants"] == {credential_digest(a): {"percent": 10.0}}
    assert pool.state().byte_limit(credential_digest(a)) == (1 << 20) // 10
    # A file of the switch that planned node heaps itself, before quotas: loads, built-in quota.
    for node in data["nodes"]:
        node.update(heap_start=0, heap_end=node["memory_bytes"] - 4096)
    del data["quotas"]
    pool.path.write_text(json.dumps(data))
    old = load_state(pool.path)
    assert old.quota_of(credential_digest(a)) == Quota(percent=50.0, regions=64)
    assert [n.memory_bytes for n in old.nodes] == [1 << 20]


# ------------------------------------------------------------------ placement


def test_a_full_region_table_does_not_close_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured before: 511 ALLOCs of 8 bytes filled one node's 512 region slots; the allocator
    kept picking that node (it had the most free bytes) and refused every ALLOC while another node
    had 8 MiB free. Now the switch counts slots per node, and moves on when a node refuses.
    Shown with 16 slots per node (each ALLOC rewrites the state file: 520 took 4 s)."""
    assert controller.NODE_REGION_SLOTS == MAX_REGIONS  # the switch counts a node's real table
    slots = 16
    monkeypatch.setattr(controller, "NODE_REGION_SLOTS", slots)
    pool = Allocator(tmp_path, [16 << 20, 8 << 20])
    pool.nodes.slots = slots
    for k in range(slots + 8):  # the admin's ALLOCs: no quota
        info = unpack_region_info(ok(pool.alloc(8, admin=True)).payload)
        assert info.ways[0].node == (0 if k < slots else 1)  # node 0 has more room until full
    assert len(pool.nodes.tables[pool.endpoints[0]]) == slots
    assert pool.nodes.asked.count(pool.endpoints[0]) == slots  # a full node is not even asked


def test_a_node_that_refuses_for_room_is_skipped(tmp_path: Path) -> None:
    """Regions the switch does not know about (registered on the node directly) fill node 0's
    table: it answers NO_SPACE, and the ALLOC lands on node 1 with nothing left behind."""
    pool = Allocator(tmp_path, [16 << 20, 8 << 20, 8 << 20])
    node0, node1, node2 = pool.endpoints
    pool.nodes.direct(node0, MAX_REGIONS)
    ranged = unpack_region_info(ok(pool.alloc(64 * KiB, admin=True)).payload)
    assert [w.node for w in ranged.ways] == [1] and pool.nodes.asked[-2:] == [node0, node1]
    # Interleaved over 2 of 3 nodes: node 0 refuses, nodes 1 and 2 take the ways.
    inter = unpack_region_info(ok(pool.alloc(64 * KiB, admin=True, stride=8192, ways=2)).payload)
    assert [w.node for w in inter.ways] == [1, 2]
    assert {w.local for w in inter.ways} == {64 * KiB, 0}  # where each node put it (its answer)
    # Over 3 ways nothing fits: NO_SPACE, and the ways registered before are gone again.
    held = {ep: dict(t) for ep, t in pool.nodes.tables.items()}
    text = refused(pool.alloc(64 * KiB, admin=True, stride=8192, ways=3), Status.NO_SPACE)
    assert "node(s) [0] refused for room" in text
    assert pool.nodes.tables == held
    # A node whose memory others filled (the switch counts 8 MiB - 32 KiB free on node 2, more
    # than on node 1) refuses for room the same way, and is skipped.
    pool.nodes.direct(node2, 1, size=4 << 20)
    again = unpack_region_info(ok(pool.alloc(4 << 20, admin=True)).payload)
    assert [w.node for w in again.ways] == [1] and pool.nodes.asked[-3:] == [node0, node2, node1]


# ------------------------------------------------------------------ what the switch reveals


def test_ping_at_the_switch_does_not_show_other_tenants_allocations(tmp_path: Path) -> None:
    """Measured before: INFO's memory was the bytes all regions map, so another tenant's
    12,345-byte ALLOC showed as exactly 12,345. Now it is the pool's capacity, whatever is mapped."""
    fabric, switch, pool = switch_with_pool(tmp_path, 3, GuardConfig())
    before, _ = exchange(fabric, Packet(Opcode.PING, txn_id=1))
    alloc = AllocRequest(12_345, 0, 0, 0, 7, "other").encode()
    ok(exchange(fabric, Packet(Opcode.ALLOC, txn_id=2, rkey=ADMIN, length=40, payload=alloc))[0])
    assert sum(r.size for r in switch.regions) == 12_345  # the switch maps it
    after, _ = exchange(fabric, Packet(Opcode.PING, txn_id=3))
    memory = [struct.unpack_from("<IIQ", p.payload)[2] for p in (before, after)]
    assert memory == [3 << 20, 3 << 20]


def test_query_answers_at_most_3x_to_a_sender_without_its_token(tmp_path: Path) -> None:
    """Measured before: QUERY answered 2.33x its request at 2 ways and 3.33x at 5 (a 72-byte
    request, a 240-byte record). Now an answer over 3x needs the address token in aux_addr;
    without it the switch answers NACK BAD_FIELD (within 3x, text included) and changes nothing."""
    fabric, switch, pool = switch_with_pool(tmp_path, 9, GuardConfig.on())
    five = unpack_region_info(ok(pool.alloc(40 * KiB, stride=8192, ways=5)).payload)
    two = unpack_region_info(ok(pool.alloc(16 * KiB, five.credential, stride=8192, ways=2)).payload)
    cred = pack_credential(five.credential)
    # 2 ways: 168 bytes for 72, within 3x: answered without a token.
    reply, size = exchange(
        fabric, Packet(Opcode.QUERY, txn_id=1, addr=two.gaddr, length=8, payload=cred)
    )
    assert reply.opcode == Opcode.ACK and size == 168
    for opcode, txn in ((Opcode.QUERY, 2), (Opcode.FREE, 3)):  # 5 ways: 240 bytes for 72
        reply, size = exchange(
            fabric, Packet(opcode, txn_id=txn, addr=five.gaddr, length=8, payload=cred)
        )
        assert reply.opcode == Opcode.NACK and reply.status == Status.BAD_FIELD
        assert size <= AMPLIFICATION_FACTOR * 72 and b"token in aux_addr" in reply.payload
    token = exchange(fabric, Packet(Opcode.PING, txn_id=4))[0].aux_addr
    wrong = exchange(
        fabric,
        Packet(Opcode.QUERY, txn_id=5, addr=five.gaddr, aux_addr=token ^ 1, length=8, payload=cred),
    )[0]
    assert wrong.status == Status.BAD_FIELD
    reply, size = exchange(
        fabric,
        Packet(Opcode.QUERY, txn_id=6, addr=five.gaddr, aux_addr=token, length=8, payload=cred),
    )
    assert (
        reply.opcode == Opcode.ACK
        and size == 240
        and len(unpack_region_info(reply.payload).ways) == 5
    )
    assert any(
        r.gaddr == five.gaddr for r in switch_state(pool)
    )  # the FREE without token freed nothing
    # ALLOC (104 bytes) of 9 ways answers 64 + 56 + 9 * 24 = 336 > 312: the token again.
    alloc = AllocRequest(8 * KiB, five.credential, 8192, 9, 7, "").encode()
    reply, size = exchange(fabric, Packet(Opcode.ALLOC, txn_id=7, length=40, payload=alloc))
    assert reply.status == Status.BAD_FIELD and size <= 3 * 104
    assert len(switch_state(pool)) == 2  # nothing was allocated
    reply, size = exchange(
        fabric, Packet(Opcode.ALLOC, txn_id=8, aux_addr=token, length=40, payload=alloc)
    )
    assert reply.opcode == Opcode.ACK and size == 336


def switch_state(pool: Allocator) -> list[object]:
    return list(pool.state().regions)


# ------------------------------------------------------------------ a real switch and nodes


def quota_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, object]]:
    from netdam.cli.main import main as netdam

    code = netdam(["pool", "quota", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def free_all(wire: VipWire) -> None:
    """Free every region of the pool with the admin key (each test leaves the pool empty)."""
    with PoolController(wire.cluster.path) as admin:
        for region in admin.regions():
            admin.free(region.gaddr)


def test_quotas_on_a_running_pool(wire: VipWire, capsys: pytest.CaptureFixture[str]) -> None:
    """Tenant a fills its byte quota (half of the 2 MiB pool); b and the admin still allocate; the
    admin gives a a region quota with `netdam pool quota`; at it a gets QUOTA; a frees and
    allocates again."""
    c = str(wire.cluster.path)
    a_first = unpack_region_info(ok(wire.alloc(256 * KiB, label="tenant-a")).payload)
    a = a_first.credential
    held = [a_first.gaddr]
    while (reply := wire.alloc(256 * KiB, a)).opcode == Opcode.ACK:
        held.append(reply.addr)
    assert "byte quota" in refused(reply, Status.QUOTA) and len(held) == 4
    b = unpack_region_info(ok(wire.alloc(256 * KiB, label="tenant-b")).payload)
    ok(wire.alloc(64 * KiB, b.credential))
    admin = ok(wire.alloc(256 * KiB, a, rkey=wire.admin))  # over a's quota, by the admin
    code, shown = quota_cli(["--cluster", c], capsys)
    rows = {r["tenant"]: r for r in shown["tenants"]}
    assert code == 0 and shown["capacity"] == 2 << 20
    assert rows["tenant-a"]["bytes"] == 5 * 256 * KiB and rows["tenant-a"]["bytes_quota"] == 1 << 20
    assert rows["tenant-b"]["regions"] == 2 and rows["tenant-b"]["regions_quota"] == 64
    code, shown = quota_cli(
        ["--cluster", c, "--tenant", "tenant-a", "--regions", "4", "--bytes", "100%"], capsys
    )
    assert code == 0 and shown["tenants"][0]["own"] == {"percent": 100.0, "regions": 4}
    assert "region quota: tenant 'tenant-a' holds 5 of its 4" in refused(
        wire.alloc(4 * KiB, a), Status.QUOTA
    )
    with (
        PoolController(wire.cluster.path, credential=a) as tenant,
        pytest.raises(ControllerError) as info,
    ):
        tenant.alloc(4 * KiB)
    assert (
        info.value.status == Status.QUOTA
        and "holds 5 of its 4 regions: `netdam pool quota" in str(info.value)
    )
    ok(wire.free(admin.addr, a))
    ok(wire.free(held.pop(), a))
    ok(wire.alloc(4 * KiB, a))  # 4 regions again
    refused(wire.alloc(4 * KiB, a), Status.QUOTA)
    code, _ = quota_cli(["--cluster", c, "--tenant", "nobody", "--regions", "1"], capsys)
    assert code == 2
    free_all(wire)


def test_ping_at_a_running_switch_reports_capacity(wire: VipWire) -> None:
    before = wire.send(Opcode.PING, b"")
    region = unpack_region_info(ok(wire.alloc(12_345)).payload)
    after = wire.send(Opcode.PING, b"")
    assert (
        struct.unpack_from("<IIQ", before.payload)[2]
        == struct.unpack_from("<IIQ", after.payload)[2]
        == 2 << 20
    )
    ok(wire.free(region.gaddr, region.credential))


def test_pool_placement_beside_directly_registered_regions(wire: VipWire) -> None:
    """Memory a direct client registered on a node is not the pool's: the node places a region's
    backing beside it (REGISTER_ANYWHERE), and a node whose region table others filled answers
    NO_SPACE and is skipped, though the switch's count gives it the most room."""
    node0, _ = wire.cluster.endpoints
    with ControlClient.for_cluster(wire.cluster.info) as direct:
        mine = [direct.register(node0, 0, 64 * KiB, Rights.READ | Rights.WRITE)]
        try:
            region = unpack_region_info(ok(wire.alloc(64 * KiB)).payload)
            assert [(w.node, w.local) for w in region.ways] == [(0, 64 * KiB)]  # beside, not on it
            ok(wire.free(region.gaddr, region.credential))
            while len(mine) <= MAX_REGIONS:  # fill node 0's table (the node says when it is full)
                try:
                    mine.append(direct.register_anywhere(node0, 8, Rights.READ)[0])
                except ControlError as exc:
                    assert exc.status == Status.NO_SPACE
                    break
            refusals = int(direct.counters(node0)[C.NACK_BASE + Status.NO_SPACE])
            for _ in range(
                3
            ):  # node 0 first (a tie by the switch's count: lower rank), then node 1
                placed = unpack_region_info(ok(wire.alloc(8)).payload)
                assert [w.node for w in placed.ways] == [1]
                ok(wire.free(placed.gaddr, placed.credential))
            assert int(direct.counters(node0)[C.NACK_BASE + Status.NO_SPACE]) == refusals + 3
        finally:
            for rkey in mine:
                direct.deregister(node0, rkey)
