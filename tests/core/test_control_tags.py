"""Control tags (SPEC.md 2.6, "Control tags"): a node or switch given the cluster's admin tag
key takes control opcodes only sealed under it, never on the 32-bit admin key alone, seals what
it answers, and a guesser sharing the admin's address cannot lock the admin out.

Cores with a hand clock (one datagram in, its answers out), then a real cluster.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from reference import all_reduce_reference

from netdam.api import ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import start_cluster
from netdam.core.events import GroupJoined
from netdam.core.guard import GuardConfig
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels.tag import seal_control_bytes, verify_control_bytes
from netdam.protocol import counters as C
from netdam.protocol.constants import LOCKOUT_BURST, RIGHTS_ALL, Opcode, Rights, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64
from netdam.protocol.payloads import pack_key_rights, pack_register
from netdam.protocol.tag import seal_control, siphash24, verify_control
from netdam.switch.addrmap import Region
from netdam.switch.core import SwitchConfig, SwitchCore

ME: Endpoint = ("10.0.0.1", 7000)
ADMIN_HOST: Endpoint = ("10.0.0.9", 5000)
ADMIN = 0xAD
TAG_KEY = bytes(range(100, 116))
#: A guesser of the admin key: COUNTERS with wrong keys in rkey from 127.0.0.1 to the targets
#: (argv 1) for argv 2 seconds; prints how many it sent.
GUESSER = """
import ast, socket, sys, time
targets, seconds = ast.literal_eval(sys.argv[1]), float(sys.argv[2])
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet, encode_packet
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 0))
end, k = time.monotonic() + seconds, 0
while time.monotonic() < end:
    for _ in range(64):
        key = (k * 2654435761) & 0xFFFFFFFF | 1
        sock.sendto(encode_packet(Packet(Opcode.COUNTERS, client_id=1, txn_id=k, rkey=key)), targets[k % len(targets)])
        k += 1
print(k)
"""


def node(tag_key: bytes = TAG_KEY, guard: bool = False) -> NodeCore:
    return NodeCore(
        NodeConfig(
            endpoint=ME,
            memory_bytes=1 << 16,
            admin_key=ADMIN,
            admin_tag_key=tag_key,
            guard=GuardConfig.on() if guard else GuardConfig(),
        )
    )


def exchange(
    core: NodeCore | SwitchCore, data: bytes, src: Endpoint = ADMIN_HOST, now: float = 0.0
) -> list[bytes]:
    core.receive_datagram(data, src, now)
    return [d for d, _ in core.datagrams_to_send(now)]


def register(base: int, size: int, txn: int = 1, rkey: int = 0) -> Packet:
    payload = pack_register(0, int(RIGHTS_ALL))
    return Packet(
        Opcode.REGISTER,
        client_id=3,
        txn_id=txn,
        rkey=rkey,
        addr=base,
        aux_addr=size,
        length=len(payload),
        payload=payload,
    )


def test_the_compiled_control_tag_matches_the_reference() -> None:
    for n in (64, 65, 71, 72, 88, 144, 161):  # every tail length, with and without a payload
        body = bytes((i * 7 + n) & 0xFF for i in range(n))
        sealed = seal_control_bytes(TAG_KEY, body)
        assert sealed == seal_control(TAG_KEY, body)
        assert verify_control_bytes(TAG_KEY, sealed) and verify_control(TAG_KEY, sealed)
        # The whole datagram is covered (payload too), but for the bytes a relay rewrites.
        assert int.from_bytes(sealed[-8:], "little") != siphash24(TAG_KEY, sealed[:-8])
        flipped = bytearray(sealed)
        flipped[n - 1 if n > 64 else 8] ^= 1  # the payload's last byte, else the header's
        assert not verify_control_bytes(TAG_KEY, bytes(flipped)) and not verify_control(
            TAG_KEY, bytes(flipped)
        )


def test_a_sealed_register_is_the_admins_and_its_answer_is_sealed() -> None:
    core = node()
    [ack] = exchange(core, seal_control(TAG_KEY, encode_packet(register(0, 4096))))
    assert verify_control(TAG_KEY, ack)
    reply = decode_packet(ack)
    assert reply.opcode == Opcode.ACK and reply.rkey in core.regions()
    # Its retry (same client and txn) is answered from the duplicate window, sealed again.
    [again] = exchange(core, seal_control(TAG_KEY, encode_packet(register(0, 4096))))
    assert verify_control(TAG_KEY, again) and len(core.regions()) == 1


def test_a_sniffed_control_datagram_replayed_from_another_source_is_dropped() -> None:
    """SPEC.md 2.6: a control tag covers the whole datagram, so whoever saw one (root, or on the
    path) could only re-send it as it is; from another source it was taken again (a second admin
    ALLOC allocated again, and its answer went to the replayer). Now the process remembers the
    tags it took and drops the same datagram from another source, counted; a retry from the
    admin's own source is still answered (from the duplicate window)."""
    core = node()
    request = seal_control(TAG_KEY, encode_packet(register(0, 4096)))
    [ack] = exchange(core, request)
    assert decode_packet(ack).opcode == Opcode.ACK
    assert exchange(core, request, src=("10.0.0.66", 4000)) == []
    assert int(core.counters[C.DROP_CONTROL_REPLAYED]) == 1
    [again] = exchange(core, request)  # the admin's retry
    assert decode_packet(again).opcode == Opcode.ACK and len(core.regions()) == 1


def test_a_join_reaches_the_shell_only_sealed_and_its_late_answer_is_sealed() -> None:
    """A JOIN is answered once the shell has bound the group's port (NodeCore.answer_join).
    The admin's sealed JOIN hears that answer sealed, refusal included; one on the bare admin
    key is refused, one under another tag is dropped, and neither becomes an event the shell
    would act on (bind a socket, join a group)."""
    core = node()
    join = Packet(Opcode.JOIN, client_id=3, txn_id=5, addr=endpoint_to_u64(("239.77.0.9", 11000)))
    [bare] = exchange(core, encode_packet(replace(join, rkey=ADMIN)))
    assert decode_packet(bare).status == Status.UNAUTHORIZED
    assert exchange(core, seal_control(bytes(16), encode_packet(join))) == []
    assert core.next_event() is None
    assert exchange(core, seal_control(TAG_KEY, encode_packet(join))) == []
    event = core.next_event()
    assert isinstance(event, GroupJoined)
    core.answer_join(event, Status.IN_USE)
    [refused] = [d for d, _ in core.datagrams_to_send(0.0)]
    assert verify_control(TAG_KEY, refused) and decode_packet(refused).status == Status.IN_USE
    assert core.groups == set()


def test_the_admin_key_alone_is_refused_where_control_tags_are_required() -> None:
    core = node()
    [nack] = exchange(core, encode_packet(register(0, 4096, rkey=ADMIN)))
    answer = decode_packet(nack)
    assert answer.opcode == Opcode.NACK and answer.status == Status.UNAUTHORIZED
    assert b"admin tag key" in answer.payload and core.regions() == {}
    # A node without an admin tag key (a bare core, a hand-started node) takes it, as v1 did.
    [ack] = exchange(node(tag_key=b""), encode_packet(register(0, 4096, rkey=ADMIN)))
    assert decode_packet(ack).opcode == Opcode.ACK


def test_a_proven_request_hears_even_its_refusal_sealed() -> None:
    """A sealed ALLOC sent to a node, not the VIP: BAD_FIELD (pool opcodes go to a switch),
    sealed, so the admin's client takes it instead of timing out on an unsealed answer."""
    alloc = Packet(Opcode.ALLOC, client_id=3, txn_id=4, length=40, payload=bytes(40))
    [nack] = exchange(node(), seal_control(TAG_KEY, encode_packet(alloc)))
    assert verify_control(TAG_KEY, nack) and decode_packet(nack).status == Status.BAD_FIELD


def test_a_wrong_control_tag_is_dropped_and_counted_and_changes_nothing() -> None:
    core = node()
    rkey = core.register_region(0, 4096, RIGHTS_ALL)
    deregister = Packet(
        Opcode.DEREGISTER, client_id=3, txn_id=9, length=8, payload=pack_key_rights(rkey, 0)
    )
    assert exchange(core, seal_control(bytes(16), encode_packet(deregister))) == []
    # The payload is covered: a sealed DEREGISTER of another rkey cannot be turned on this one.
    other = seal_control(
        TAG_KEY,
        encode_packet(
            Packet(
                Opcode.DEREGISTER,
                client_id=3,
                txn_id=9,
                length=8,
                payload=pack_key_rights(rkey ^ 1, 0),
            )
        ),
    )
    spliced = other[:64] + pack_key_rights(rkey, 0) + other[-8:]
    assert exchange(core, spliced) == []
    assert rkey in core.regions()
    assert int(core.counters[C.DROP_CONTROL_FORGED]) == 2
    # A control tag where no admin tag key is set proves nothing: UNAUTHORIZED.
    [nack] = exchange(node(tag_key=b""), seal_control(TAG_KEY, encode_packet(register(0, 4096))))
    assert decode_packet(nack).status == Status.UNAUTHORIZED


def test_a_guesser_on_the_admins_address_does_not_lock_the_admin_out() -> None:
    core = node(guard=True)
    for k in range(LOCKOUT_BURST + 5):  # wrong admin keys from the admin's own address
        exchange(
            core,
            encode_packet(Packet(Opcode.COUNTERS, client_id=1, txn_id=k, rkey=0x1000 + k)),
            now=0.1,
        )
    # Locked out: the untagged admin key is dropped with the guesses...
    assert (
        exchange(
            core, encode_packet(Packet(Opcode.COUNTERS, client_id=3, txn_id=1, rkey=ADMIN)), now=0.2
        )
        == []
    )
    assert int(core.counters[C.LOCKOUTS]) >= 1
    # ...but a control tag proves the admin tag key, which a guesser does not hold.
    [ack] = exchange(
        core,
        seal_control(TAG_KEY, encode_packet(Packet(Opcode.COUNTERS, client_id=3, txn_id=2))),
        now=0.3,
    )
    assert verify_control(TAG_KEY, ack) and decode_packet(ack).opcode == Opcode.ACK
    # and a forged tag from the locked address gets nothing, nor counts as a guess.
    failures = int(core.counters[C.AUTH_FAILURES])
    assert (
        exchange(
            core, seal_control(bytes(16), encode_packet(Packet(Opcode.COUNTERS, txn_id=3))), now=0.4
        )
        == []
    )
    assert int(core.counters[C.AUTH_FAILURES]) == failures


def test_the_switch_takes_the_admins_pool_requests_only_sealed() -> None:
    vip: Endpoint = ("10.0.0.100", 9000)
    switch = SwitchCore(
        SwitchConfig(
            vip=vip, nodes=(ME,), admin_key=ADMIN, admin_tag_key=TAG_KEY, guard=GuardConfig.on()
        ),
        list[Region](),
    )
    counters = Packet(Opcode.COUNTERS, client_id=3, txn_id=1, rkey=ADMIN)
    [nack] = exchange(switch, encode_packet(counters))
    assert decode_packet(nack).status == Status.UNAUTHORIZED
    [ack] = exchange(
        switch, seal_control(TAG_KEY, encode_packet(Packet(Opcode.COUNTERS, client_id=3, txn_id=2)))
    )
    assert verify_control(TAG_KEY, ack) and decode_packet(ack).opcode == Opcode.ACK
    assert (
        exchange(switch, seal_control(bytes(16), encode_packet(Packet(Opcode.COUNTERS, txn_id=3))))
        == []
    )
    assert int(switch.counters[C.DROP_CONTROL_FORGED]) == 1
    # Locked out by guesses from the same address, the sealed request still passes.
    for k in range(LOCKOUT_BURST + 5):
        exchange(
            switch,
            encode_packet(Packet(Opcode.COUNTERS, client_id=1, txn_id=100 + k, rkey=0x1000 + k)),
        )
    assert (
        exchange(switch, encode_packet(Packet(Opcode.COUNTERS, client_id=3, txn_id=4, rkey=ADMIN)))
        == []
    )
    [ack] = exchange(
        switch, seal_control(TAG_KEY, encode_packet(Packet(Opcode.COUNTERS, client_id=3, txn_id=5)))
    )
    assert verify_control(TAG_KEY, ack)


def test_the_admins_tools_seal_and_a_cluster_refuses_the_bare_admin_key() -> None:
    with start_cluster(nodes=1) as cluster:
        info = cluster.info
        target = cluster.endpoints[0]
        with ControlClient.for_cluster(info) as admin:
            rkey = admin.register(target, 0, 4096, Rights.READ | Rights.WRITE)
            admin.deregister(target, rkey)
            counters = C.counters_to_dict(admin.counters(target))
        assert counters["ops"]["REGISTER"] == 1
        with (
            ControlClient(admin_key=info.admin_key) as v1_tool,
            pytest.raises(ControlError) as refused,
        ):
            v1_tool.counters(target)
        assert (
            refused.value.status == Status.UNAUTHORIZED
            and b"admin tag key" in refused.value.payload
        )


@pytest.mark.slow
@pytest.mark.alone
def test_a_guess_flood_on_the_admins_address_leaves_the_admin_and_collectives_working(
    tmp_path: Path,
) -> None:
    """Every local client sends from 127.0.0.1: a guesser there locked the operator out (~67 s
    refused) and failed all-reduces. Control tags exempt the admin's proven requests, and the
    hosts' START_COLLs are the admin's: 20 all-reduces under the flood are all exact."""
    with start_cluster(2, memory=8 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        targets = list(cluster.endpoints)
        groups = [ProcessGroup(cluster.info, rank) for rank in range(2)]
        guesser = subprocess.Popen(
            [sys.executable, "-c", GUESSER, repr(targets), "4"], stdout=subprocess.PIPE, text=True
        )
        try:
            time.sleep(0.5)  # the guesser has locked 127.0.0.1 out by now
            v1 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            v1.bind(("127.0.0.1", 0))
            v1.settimeout(0.3)
            v1.sendto(encode_packet(Packet(Opcode.PING)), targets[0])
            with pytest.raises(TimeoutError):
                v1.recvfrom(65536)  # an unproven datagram from the address is dropped
            v1.close()
            rng = np.random.default_rng(5)
            asked = answered = calls = 0
            with ControlClient.for_cluster(cluster.info, bind="127.0.0.1") as admin:
                while guesser.poll() is None and calls < 20:
                    asked += 1
                    try:
                        admin.counters(targets[asked % 2], timeout=0.5)
                        answered += 1
                    except ControlError:
                        pass
                    inputs = [rng.standard_normal(1 << 14).astype(np.float32) for _ in range(2)]
                    expected = all_reduce_reference(inputs)
                    for w in [
                        api_all_reduce(b, group=g, async_op=True) for b, g in zip(inputs, groups)
                    ]:
                        w.wait()
                    for rank, b in enumerate(inputs):
                        assert b.tobytes() == expected.tobytes(), (calls, rank)
                    calls += 1
            assert calls == 20 and answered >= 0.99 * asked
        finally:
            sent = int(guesser.communicate(timeout=30)[0])
            for g in groups:
                g.close()
        assert sent > 1000
        with ControlClient.for_cluster(cluster.info) as admin:
            lockouts = [int(admin.counters(t)[C.LOCKOUTS]) for t in targets]
        assert min(lockouts) >= 1, lockouts  # the flood did lock the address out, at both nodes
