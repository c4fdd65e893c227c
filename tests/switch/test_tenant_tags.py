"""Tenant tags (SPEC.md 11.9, "Tenant tags"): a pool tenant's ALLOC, FREE and QUERY name it by a
public id and prove it with a control tag under a key derived from its credential, which never
travels; a forged or unknown one gets nothing, and a guesser sharing the tenant's address cannot
lock those requests out.

The switch's compiled datapath and its allocator on an in-memory fabric (tests/pool_memory.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pool_memory import ADMIN, CLIENT, PAGE, VIP, ok, refused, switch_with_pool

from netdam.cluster.control import ControlClient
from netdam.cluster.tenants import TenantKeys, credential_digest, tenant_keys, tenant_keys_of
from netdam.core.fabric import Fabric
from netdam.core.guard import GuardConfig
from netdam.kernels.tag import verify_control_bytes
from netdam.protocol import counters as C
from netdam.protocol.constants import LOCKOUT_BURST, Opcode, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import AllocRequest, pack_credential, unpack_region_info
from netdam.switch import controller
from netdam.switch.core import SwitchCore
from netdam.switch.state import PoolState

GUESSER: Endpoint = (CLIENT[0], 9002)  # another socket of the tenant's host: the same address


def send(fabric: Fabric, data: bytes, src: Endpoint = CLIENT) -> list[bytes]:
    """Datagram *data* from *src* to the VIP; what *src* gets back."""
    fabric.add_endpoint(src)
    fabric.send(src, VIP, data)
    fabric.run_until_idle()
    return [d for d, _ in fabric.receive(src)]


def sealed(credential: int, opcode: Opcode, payload: bytes, addr: int = 0, txn: int = 1) -> bytes:
    """A tenant's request as its client sends it (ControlClient.for_tenant)."""
    client = ControlClient.for_tenant(credential, bind="127.0.0.1")
    try:
        return client.encode(
            Packet(opcode, client_id=3, txn_id=txn, addr=addr, length=len(payload), payload=payload)
        )
    finally:
        client.close()


def new_tenant(fabric: Fabric, txn: int = 90) -> int:
    """A tenant made by the admin's ALLOC (a v1 admin key: the in-memory switch has no tag key)."""
    alloc = AllocRequest(PAGE, 0, 0, 0, 7, "t").encode()
    [answer] = send(
        fabric,
        encode_packet(Packet(Opcode.ALLOC, txn_id=txn, rkey=ADMIN, length=40, payload=alloc)),
    )
    return unpack_region_info(ok(decode_packet(answer)).payload).credential


def counters(switch: SwitchCore) -> dict[str, object]:
    return C.counters_to_dict(switch.counters)


def test_the_keys_derive_from_the_digest_the_state_file_keeps() -> None:
    """SPEC.md 11.9: id = SHA-256(digest, 0, "tenant-id")[:4] big-endian (0 -> 1), tag key =
    SHA-256(digest, 0, "tenant-tag")[:16], where digest is SHA-256 of the credential's 8 LE bytes."""
    credential = 0x0123456789ABCDEF
    digest = hashlib.sha256(credential.to_bytes(8, "little")).digest()
    assert credential_digest(credential) == digest.hex()
    expect_id = int.from_bytes(hashlib.sha256(digest + b"\x00tenant-id").digest()[:4], "big") or 1
    expect_key = hashlib.sha256(digest + b"\x00tenant-tag").digest()[:16]
    assert (
        tenant_keys_of(credential) == tenant_keys(digest.hex()) == TenantKeys(expect_id, expect_key)
    )


def test_a_tenant_seals_its_requests_and_its_credential_never_travels(tmp_path: Path) -> None:
    """Issue "no secret on the wire": a tenant's ALLOC/QUERY/FREE carried its 64-bit credential in
    the payload. Now rkey is its id, the payload's credential 0, and a control tag under its key
    proves it; the switch answers sealed under the same key, the credential nowhere."""
    fabric, switch, pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    credential = new_tenant(fabric)
    keys = tenant_keys_of(credential)
    secret = credential.to_bytes(8, "little")
    alloc = sealed(credential, Opcode.ALLOC, AllocRequest(2 * PAGE, 0, 0, 0, 7, "mine").encode())
    assert secret not in alloc and decode_packet(alloc).rkey == keys.id
    [answer] = send(fabric, alloc)
    assert verify_control_bytes(keys.tag_key, answer) and secret not in answer
    region = unpack_region_info(ok(decode_packet(answer)).payload)
    assert region.credential == 0 and region.label == "mine"
    assert pool.state().regions[-1].owner == credential_digest(credential)
    for txn, opcode in ((2, Opcode.QUERY), (3, Opcode.FREE)):
        request = sealed(credential, opcode, pack_credential(0), addr=region.gaddr, txn=txn)
        assert secret not in request
        [answer] = send(fabric, request)
        assert verify_control_bytes(keys.tag_key, answer)
        assert unpack_region_info(ok(decode_packet(answer)).payload).gaddr == region.gaddr
    assert all(r.gaddr != region.gaddr for r in pool.state().regions)  # freed


def test_a_forged_tenant_tag_gets_nothing(tmp_path: Path) -> None:
    """Who may send a tenant's requests: whoever holds its tag key. A made-up key, or another
    tenant's id under one's own key, is dropped unanswered and counted (drop_control_forged), and
    is not a failed authentication (a 64-bit tag is not guessed at any rate)."""
    fabric, switch, pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    victim, attacker = new_tenant(fabric, 90), new_tenant(fabric, 91)
    victims_region = pool.state().regions[0]
    free = Packet(
        Opcode.FREE,
        client_id=3,
        txn_id=7,
        rkey=tenant_keys_of(victim).id,
        addr=victims_region.gaddr,
        length=8,
        payload=pack_credential(0),
    )
    from netdam.kernels.tag import seal_control_bytes

    made_up = seal_control_bytes(bytes(range(16)), encode_packet(free))
    under_own_key = seal_control_bytes(tenant_keys_of(attacker).tag_key, encode_packet(free))
    for forged in (made_up, under_own_key):
        assert send(fabric, forged, GUESSER) == []
    got = counters(switch)
    assert got["drop_control_forged"] == 2 and got["auth_failures"] == 0
    assert any(r.gaddr == victims_region.gaddr for r in pool.state().regions)  # nothing was freed


def test_an_unknown_tenant_id_is_refused_and_counted(tmp_path: Path) -> None:
    """A sealed request naming no tenant is UNAUTHORIZED and a failed authentication of its
    address (ids are 32 bits: guessing one is guessing a key)."""
    fabric, switch, _pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    stranger = 0x1234
    [answer] = send(fabric, sealed(stranger, Opcode.QUERY, pack_credential(0)))
    assert decode_packet(answer).status == Status.UNAUTHORIZED
    assert counters(switch)["auth_failures"] == 1


def test_a_sealed_request_with_the_credential_in_its_payload_is_refused(tmp_path: Path) -> None:
    """The tag proves the tenant: a credential in the payload as well is BAD_FIELD, with why."""
    fabric, _switch, _pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    credential = new_tenant(fabric)
    [answer] = send(fabric, sealed(credential, Opcode.QUERY, pack_credential(credential)))
    assert "credential 0" in refused(decode_packet(answer), Status.BAD_FIELD)


def test_a_guesser_on_the_tenants_address_cannot_lock_its_sealed_requests_out(
    tmp_path: Path,
) -> None:
    """Issue "lockout is a weapon", for the pool's own requests: wrong credentials from another
    socket of the same host lock the address out (SPEC.md 12.3); the tenant's sealed ALLOC, QUERY
    and FREE from that address are still answered, its v1 request (credential in the payload) is
    not, as SPEC says."""
    fabric, switch, _pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    credential = new_tenant(fabric)
    for k in range(LOCKOUT_BURST + 5):
        wrong = Packet(
            Opcode.QUERY, txn_id=100 + k, length=8, payload=pack_credential(credential ^ (k + 1))
        )
        send(fabric, encode_packet(wrong), GUESSER)
    assert counters(switch)["lockouts"] == 1
    v1 = Packet(Opcode.QUERY, txn_id=200, length=8, payload=pack_credential(credential))
    assert send(fabric, encode_packet(v1)) == []  # the address is locked out
    [answer] = send(
        fabric,
        sealed(credential, Opcode.ALLOC, AllocRequest(PAGE, 0, 0, 0, 7, "").encode(), txn=201),
    )
    region = unpack_region_info(ok(decode_packet(answer)).payload)
    [answer] = send(
        fabric, sealed(credential, Opcode.FREE, pack_credential(0), addr=region.gaddr, txn=202)
    )
    ok(decode_packet(answer))
    assert counters(switch)["drop_lockout"] >= 1


def test_tenant_ids_are_distinct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch finds a tenant by its id: a new credential whose id another tenant has is drawn
    again (new_credential), so one id names one tenant."""
    first, clash, fresh = 0x1111, 0x2222, 0x3333
    real = controller.tenant_keys

    def keys(digest: str) -> TenantKeys:  # the clash gets first's id
        derived = real(digest)
        return (
            TenantKeys(real(credential_digest(first)).id, derived.tag_key)
            if digest == credential_digest(clash)
            else derived
        )

    monkeypatch.setattr(controller, "tenant_keys", keys)
    draws = iter([clash, fresh])
    monkeypatch.setattr(controller.secrets, "randbits", lambda bits: next(draws))
    state = PoolState(nodes=[], tenants={credential_digest(first): "first"})
    assert controller.new_credential(state) == (fresh, credential_digest(fresh))
    table = controller.tenant_table(
        PoolState(nodes=[], tenants={credential_digest(first): "", credential_digest(clash): ""})
    )
    assert list(table.values()) == [
        (credential_digest(first), real(credential_digest(first)).tag_key)
    ]


def test_a_tenants_request_replayed_from_another_source_gets_nothing(tmp_path: Path) -> None:
    """A sealed ALLOC seen on the path and re-sent from another source: the switch took it once;
    the replay is dropped and counted (drop_control_replayed), allocates nothing and answers
    nothing (the answer would hand the replayer the new region's tag key)."""
    fabric, switch, pool = switch_with_pool(tmp_path, 2, GuardConfig.on())
    credential = new_tenant(fabric)
    alloc = sealed(credential, Opcode.ALLOC, AllocRequest(PAGE, 0, 0, 0, 7, "").encode(), txn=5)
    ok(decode_packet(send(fabric, alloc)[0]))
    regions = len(pool.state().regions)
    assert send(fabric, alloc, GUESSER) == []
    assert counters(switch)["drop_control_replayed"] == 1 and len(pool.state().regions) == regions
