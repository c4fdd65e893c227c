"""Isolation campaign (SPEC sections 3.1, 4, 7, 8, 11 and 12; netdam/tools/isolation.py): two
tenants of one pool, the attacker trying 2,500 cross-accesses of every kind, through the switch
and straight at the nodes, with the same compiled cores the node and switch processes run.

Checked for every kind: no cross-access succeeds (no READ_RESP, ACK or INFO of the victim's
comes back), nothing outside the attacker's own regions changes by a single byte, no byte of
the victim's reaches the attacker, no datagram goes to a third party, each kind is counted as
SPEC says, and the victim's own traffic is unaffected afterwards. ``netdam isolation`` runs the
same campaign.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from netdam.cluster.control import ControlClient
from netdam.cluster.launch import start_cluster
from netdam.protocol.constants import DType, Flags, Opcode, Rights, Status
from netdam.protocol.packet import Packet, decode_packet, encode_packet
from netdam.tools.isolation import KINDS, Tenancy, make_tenancy, run_kind, victim_unaffected


@pytest.fixture(scope="module")
def tenancy() -> Tenancy:
    return make_tenancy()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_cross_tenant_attempts_all_fail(tenancy: Tenancy, kind: str) -> None:
    result = run_kind(tenancy, kind)
    assert result.failures() == [], kind
    assert result.replies > 0 or kind in ("replayed control datagram", "tenant id without its key")


def test_victim_unaffected_after_campaign(tenancy: Tenancy) -> None:
    """After every attack (and a borrowed client id), the victim writes, reads and counts as usual."""
    assert victim_unaffected(tenancy) == []


def test_a_campaign_that_lets_one_through_says_so(
    tenancy: Tenancy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks can fail: an "attack" that is the victim's own READ of its region (its rkey,
    its memory) is reported as a cross-access that succeeded and as leaked bytes."""
    from netdam.tools import isolation

    def own_read(rng, t):
        return isolation.VIP, Packet(
            Opcode.READ, rkey=isolation.VICTIM_RKEY, addr=t.victim.gaddr, length=64, dtype=DType.RAW
        )

    monkeypatch.setitem(isolation.KINDS, "victim's own read", own_read)
    result = run_kind(tenancy, "victim's own read", attempts=16)
    assert any("16 of 16 succeeded" in f for f in result.failures()) and result.leaked_runs > 0


def test_the_campaign_as_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`netdam isolation` runs the same campaign: every kind, one JSON object, exit 0."""
    from netdam.cli.main import main

    assert main(["isolation", "--attempts", "40", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (
        result["ok"] is True
        and set(result["kinds"]) == set(KINDS)
        and result["victim_failures"] == []
    )
    assert result["kinds"]["replayed control datagram"]["dropped_replayed"] == 40
    assert main(["isolation", "--attempts", "5", "--kind", "made-up tag"]) == 0
    assert "ok: nothing got through" in capsys.readouterr().out
    assert main(["isolation", "--kind", "no such kind"]) == 2
    assert "made-up tag" in capsys.readouterr().err  # the fix: the kinds there are


@pytest.mark.slow
def test_real_node_relays_to_members_only(tmp_path: Path) -> None:
    """On a node process: a chain whose next segment is not a member is NACKed NOT_MEMBER and
    nothing reaches that endpoint; a return segment naming a third party is ignored."""
    with (
        start_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as bystander,
    ):
        node = cluster.info.nodes[0].endpoint
        with ControlClient.for_cluster(cluster.info) as admin:
            rkey = admin.register(node, 0, 4096, Rights.READ | Rights.WRITE)
            admin.write(node, rkey, 0, b"secret!!" * 8)
        for s in (attacker, bystander):
            s.bind(("127.0.0.1", 0))
            s.settimeout(0.5)
        third = bystander.getsockname()
        chain = Packet(
            Opcode.CHAIN_ADD,
            flags=Flags.ACK_REQ,
            client_id=3,
            txn_id=1,
            rkey=rkey,
            addr=0,
            aux_addr=0,
            length=64,
            dtype=DType.F32,
            segments=(node, third),
            segments_left=1,
            payload=bytes(64),
        )
        read = Packet(Opcode.READ, client_id=3, txn_id=2, rkey=rkey, addr=0, length=64, ret=third)
        attacker.sendto(encode_packet(chain), node)
        nack = decode_packet(attacker.recv(65536))
        assert nack.opcode == Opcode.NACK and nack.status == Status.NOT_MEMBER
        attacker.sendto(encode_packet(read), node)
        resp = decode_packet(attacker.recv(65536))
        assert resp.opcode == Opcode.READ_RESP and resp.payload == b"secret!!" * 8
        with pytest.raises(TimeoutError):
            bystander.recv(65536)
