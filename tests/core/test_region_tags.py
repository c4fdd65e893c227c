"""Tagged regions (SPEC.md 2.6, "Region tags"): a region registered with a tag key takes only
datagrams sealed under it, seals what it answers, and a guesser cannot lock its users out.

On one node core with a hand clock: every request here is one datagram in, its answers out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from netdam.clients.pool import PoolClient, PoolError, tag_keys_of
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import start_pool_cluster
from netdam.core.guard import GuardConfig
from netdam.core.node import NodeConfig, NodeCore
from netdam.protocol import counters as C
from netdam.protocol.constants import (
    LOCKOUT_BURST,
    RIGHTS_ALL,
    DType,
    Flags,
    Opcode,
    Rights,
    Status,
)
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import pack_credential, pack_register, pack_u64, unpack_u64
from netdam.protocol.tag import seal, verify
from netdam.switch.addrmap import GLOBAL_BASE, Region, Way
from netdam.switch.controller import ControllerError, PoolController
from netdam.switch.core import SwitchConfig, SwitchCore

ME: Endpoint = ("10.0.0.1", 7000)
CLIENT: Endpoint = ("10.0.0.9", 5000)
ADMIN = 0xAD
KEY = bytes(range(16))
RKEY = 0x600D_F00D
KiB = 1024
#: A guesser: READs with wrong rkeys from 127.0.0.1 to the targets (argv 1) naming the address
#: argv 2, for argv 3 seconds; prints how many it sent.
FLOOD = """
import ast, socket, struct, sys, time
targets, gaddr, seconds = ast.literal_eval(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet, encode_packet
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 0))
end, k = time.monotonic() + seconds, 0
while time.monotonic() < end:
    for _ in range(64):
        rkey = (k * 2654435761) & 0xFFFFFFFF | 1
        sock.sendto(encode_packet(Packet(Opcode.READ, client_id=1, txn_id=k, rkey=rkey, addr=gaddr, length=8)),
                    targets[k % len(targets)])
        k += 1
print(k)
"""


def tagged_node(guard: bool = False) -> NodeCore:
    core = NodeCore(
        NodeConfig(
            endpoint=ME,
            memory_bytes=1 << 16,
            admin_key=ADMIN,
            guard=GuardConfig.on() if guard else GuardConfig(),
        )
    )
    core.register_region(0, 4096, RIGHTS_ALL, rkey=RKEY, tag_key=KEY)
    return core


def exchange(core: NodeCore, data: bytes, src: Endpoint = CLIENT, now: float = 0.0) -> list[bytes]:
    core.receive_datagram(data, src, now)
    return [d for d, _ in core.datagrams_to_send(now)]


def write(addr: int, data: bytes, txn: int = 1, rkey: int = RKEY) -> Packet:
    return Packet(
        Opcode.WRITE,
        flags=Flags.ACK_REQ,
        client_id=7,
        txn_id=txn,
        rkey=rkey,
        addr=addr,
        length=len(data),
        payload=data,
    )


def read(addr: int, length: int, txn: int = 1, rkey: int = RKEY) -> Packet:
    return Packet(Opcode.READ, client_id=7, txn_id=txn, rkey=rkey, addr=addr, length=length)


def test_a_tagged_region_executes_sealed_requests_and_seals_its_answers() -> None:
    core = tagged_node()
    [ack] = exchange(core, seal(KEY, encode_packet(write(64, b"\x11" * 32, txn=1))))
    assert verify(KEY, ack) and decode_packet(ack).opcode == Opcode.ACK
    [resp] = exchange(core, seal(KEY, encode_packet(read(64, 32, txn=2))))
    assert verify(KEY, resp) and decode_packet(resp).payload == b"\x11" * 32
    fa = Packet(
        Opcode.FETCH_ADD,
        client_id=7,
        txn_id=3,
        rkey=RKEY,
        addr=128,
        length=8,
        dtype=DType.U64,
        payload=pack_u64(5),
    )
    [old] = exchange(core, seal(KEY, encode_packet(fa)))
    assert verify(KEY, old) and unpack_u64(decode_packet(old).payload) == 0
    # A retry is answered from the duplicate window, sealed again, and not executed twice.
    [again] = exchange(core, seal(KEY, encode_packet(fa)))
    assert verify(KEY, again) and int(np.frombuffer(core.memory[128:136], "<u8")[0]) == 5


def test_the_rkey_alone_no_longer_reads_or_writes_a_tagged_region() -> None:
    core = tagged_node()
    core.memory[:32] = 0x42
    [nack] = exchange(core, encode_packet(write(0, b"\x00" * 32)))
    assert decode_packet(nack).status == Status.BAD_RKEY and bytes(core.memory[:32]) == b"\x42" * 32
    [nack] = exchange(core, encode_packet(read(0, 32, txn=2)))
    assert decode_packet(nack).status == Status.BAD_RKEY


def test_a_made_up_tag_is_dropped_and_counted() -> None:
    core = tagged_node()
    core.memory[:32] = 0x42
    wrong = bytes(16 - i for i in range(16))
    assert exchange(core, seal(wrong, encode_packet(write(0, b"\x00" * 32)))) == []
    assert exchange(core, seal(wrong, encode_packet(read(0, 32, txn=2)))) == []
    assert bytes(core.memory[:32]) == b"\x42" * 32
    assert C.counters_to_dict(core.counters)["drop_region_forged"] == 2


def test_a_tag_under_no_tagged_regions_rkey_is_a_wrong_key() -> None:
    """TAGGED naming an untagged region (or none) executes nothing: BAD_RKEY, unsealed."""
    core = tagged_node()
    core.register_region(4096, 4096, RIGHTS_ALL, rkey=0x0BAD)
    core.memory[4096:4128] = 0x42
    for rkey in (0x0BAD, 0x7777):
        [nack] = exchange(core, seal(KEY, encode_packet(write(4096, b"\x00" * 32, rkey=rkey))))
        assert (
            decode_packet(nack).status == Status.BAD_RKEY
            and not decode_packet(nack).flags & Flags.TAGGED
        )
    assert bytes(core.memory[4096:4128]) == b"\x42" * 32


def test_a_tag_covers_the_address_and_the_transaction() -> None:
    """A sealed request with its address or txn id changed afterwards is dropped."""
    core = tagged_node()
    sealed = bytearray(seal(KEY, encode_packet(write(64, b"\x11" * 32))))
    moved = bytearray(sealed)
    moved[39] ^= 0x40  # addr's low byte (big-endian u64 at 32)
    assert exchange(core, bytes(moved)) == []
    sealed[15] ^= 1  # txn_id's low byte
    assert exchange(core, bytes(sealed)) == []
    assert not core.memory[:4096].any()


def test_register_takes_a_tag_key_over_the_wire_and_deregister_drops_it() -> None:
    core = NodeCore(NodeConfig(endpoint=ME, memory_bytes=1 << 16, admin_key=ADMIN))
    admin: Endpoint = ("10.0.0.2", 6000)
    payload = pack_register(0, int(RIGHTS_ALL), KEY)
    [ack] = exchange(
        core,
        encode_packet(
            Packet(
                Opcode.REGISTER,
                rkey=ADMIN,
                addr=0,
                aux_addr=4096,
                length=len(payload),
                payload=payload,
            )
        ),
        admin,
    )
    rkey = decode_packet(ack).rkey
    [nack] = exchange(core, encode_packet(read(0, 8, rkey=rkey)))
    assert decode_packet(nack).status == Status.BAD_RKEY
    [resp] = exchange(core, seal(KEY, encode_packet(read(0, 8, txn=2, rkey=rkey))))
    assert verify(KEY, resp) and decode_packet(resp).opcode == Opcode.READ_RESP
    zero_key = pack_register(0, int(RIGHTS_ALL)) + bytes(16)  # all zeros is no key
    [nack] = exchange(
        core,
        encode_packet(
            Packet(
                Opcode.REGISTER,
                rkey=ADMIN,
                addr=8192,
                aux_addr=4096,
                txn_id=9,
                length=len(zero_key),
                payload=zero_key,
            )
        ),
        admin,
    )
    assert decode_packet(nack).status == Status.BAD_FIELD
    core.deregister_region(rkey)
    core.register_region(0, 4096, RIGHTS_ALL, rkey=rkey)  # the same rkey, untagged now
    [resp] = exchange(core, encode_packet(read(0, 8, txn=3, rkey=rkey)))
    assert decode_packet(resp).opcode == Opcode.READ_RESP


def test_a_members_only_region_takes_no_tag_key() -> None:
    core = NodeCore(NodeConfig(endpoint=ME, memory_bytes=1 << 16, admin_key=ADMIN))
    with pytest.raises(ValueError, match="BAD_FIELD"):
        core.register_region(0, 4096, Rights.READ | Rights.MEMBERS, tag_key=KEY)


def test_a_guesser_on_the_same_address_cannot_lock_a_tagged_client_out() -> None:
    """SPEC.md 12.3: the lockout holds every untagged datagram of the address, and a tagged one
    whose tag is wrong; a right tag proves the key, so its sender goes on."""
    core = tagged_node(guard=True)
    guesser: Endpoint = (CLIENT[0], 5999)  # another socket of the same address
    for k in range(LOCKOUT_BURST + 5):
        exchange(core, encode_packet(read(0, 8, txn=k, rkey=RKEY ^ 1)), guesser)
    assert (
        exchange(core, encode_packet(read(0, 8, txn=1, rkey=RKEY ^ 1)), guesser) == []
    )  # locked out
    for txn in range(2, 22):
        [ack] = exchange(
            core,
            seal(KEY, encode_packet(write(0, txn.to_bytes(8, "little"), txn=txn))),
            CLIENT,
            0.1,
        )
        assert verify(KEY, ack) and decode_packet(ack).opcode == Opcode.ACK
    assert exchange(core, seal(bytes(16), encode_packet(read(0, 8, txn=40))), CLIENT, 0.1) == []
    assert exchange(core, encode_packet(read(0, 8, txn=41)), CLIENT, 0.1) == []
    counters = C.counters_to_dict(core.counters)
    assert counters["lockouts"] == 1 and counters["drop_lockout"] >= 3


@pytest.mark.slow
@pytest.mark.alone
def test_a_guess_flood_from_the_same_address_leaves_a_tagged_client_working(tmp_path: Path) -> None:
    """Issue "lockout is a weapon": every local client sends from 127.0.0.1, so wrong keys from
    any socket locked every other local client out. A tagged client goes on at >= 99% during the
    flood (at the switch and at a node); an untagged one on the same address is locked out, as
    SPEC 12.3 says it still is."""
    cluster, switch = start_pool_cluster(2, memory=1 << 20, cluster_path=tmp_path / "c.toml")
    try:
        ctl = PoolController(cluster.path)
        tagged = ctl.alloc(16 * KiB, interleave=8 * KiB)
        untagged = ctl.alloc(4 * KiB, tagged=False)
        # The guesser is a process of its own (as an attacker is: no GIL shared with the clients),
        # sending READs with wrong rkeys from 127.0.0.1 to the VIP and both nodes for 4 s.
        targets = [switch.vip, *cluster.endpoints]
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOOD, repr(targets), str(tagged.gaddr), "4.5"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)  # the address is locked out by now
        done = failed = 0
        with PoolClient(
            switch.vip, timeout=0.05, retries=20, tag_keys=tag_keys_of(tagged)
        ) as client:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                payload = done.to_bytes(8, "little")
                try:
                    client.write(
                        tagged.gaddr + 8 * (done % 512), payload, tagged.rkey, stride=tagged.stride
                    )
                    ok = (
                        client.read(
                            tagged.gaddr + 8 * (done % 512), 8, tagged.rkey, stride=tagged.stride
                        )
                        == payload
                    )
                except PoolError:
                    ok = False
                done += 1
                failed += not ok
        with PoolClient(switch.vip, timeout=0.05, retries=2) as plain:
            locked = 0
            for k in range(8):
                try:
                    plain.write(untagged.gaddr, k.to_bytes(8, "little"), untagged.rkey)
                except PoolError:
                    locked += 1
        # The tenant's own requests (SPEC 11.9, "Tenant tags"), from a controller made during the
        # flood (its first requests need no address token, so no PING that the lockout drops).
        tenant = PoolController(
            cluster.path, credential=int(tagged.extra["credential"]), timeout=0.2
        )
        pool_ops = pool_failed = 0
        for _ in range(10):
            for op in ("alloc", "query", "free"):
                pool_ops += 1
                try:
                    if op == "alloc":
                        mine = tenant.alloc(4 * KiB)
                    elif op == "query":
                        assert tenant.query(mine.gaddr).gaddr == mine.gaddr
                    else:
                        tenant.free(mine.gaddr)
                except ControllerError:
                    pool_failed += 1
        with (
            ControlClient() as v1
        ):  # the same tenant's v1 request (credential in the payload): locked out
            query = Packet(
                Opcode.QUERY, length=8, payload=pack_credential(int(tagged.extra["credential"]))
            )
            with pytest.raises(ControlError, match="no answer"):
                v1.request(switch.vip, query, timeout=0.2, retries=0)
        sent = int(flooder.communicate(timeout=30)[0])
        assert sent > 20000, sent  # a real flood
        assert done > 100 and failed <= done // 100, (done, failed)
        assert locked >= 6, locked  # the untagged client on the same address: locked out
        assert pool_failed == 0, (pool_ops, pool_failed)
        # The admin's control opcodes keep the per-address lockout (SPEC 12.3): ask from another
        # loopback address while 127.0.0.1 is still locked out.
        with ControlClient.for_cluster(cluster.info, bind="127.0.0.3") as admin:
            switch_ctr = C.counters_to_dict(admin.counters(switch.entry.control_endpoint))
        assert switch_ctr["lockouts"] >= 1 and switch_ctr["drop_lockout"] > 100
    finally:
        switch.stop()
        cluster.stop()


def test_a_sealed_answer_fits_the_mtu_with_its_tag() -> None:
    """A READ whose sealed answer would pass the MTU is TOO_LARGE (sealed), not sent and lost
    (EMSGSIZE): at MTU 1500 a tagged region answers 1400 bytes, not 1408 (SPEC.md 2.6)."""
    core = NodeCore(NodeConfig(endpoint=ME, memory_bytes=1 << 16, admin_key=ADMIN, mtu=1500))
    core.register_region(0, 4096, RIGHTS_ALL, rkey=RKEY, tag_key=KEY)
    [resp] = exchange(core, seal(KEY, encode_packet(read(0, 1400, txn=1))))
    assert (
        verify(KEY, resp)
        and len(resp) == 1500 - 28
        and decode_packet(resp).opcode == Opcode.READ_RESP
    )
    [nack] = exchange(core, seal(KEY, encode_packet(read(0, 1408, txn=2))))
    assert verify(KEY, nack) and decode_packet(nack).status == Status.TOO_LARGE


def test_the_switch_forwards_a_proven_request_of_a_locked_out_address_and_nothing_else() -> None:
    """At the switch (SPEC.md 11.3, 12.3): once an address is locked out, only its requests whose
    tag is right under a tagged region's key go on (sealed anew, to the node); an untagged one, a
    made-up tag and a malformed TAGGED datagram from it get nothing."""
    vip: Endpoint = ("10.0.0.100", 7744)
    node: Endpoint = ("10.0.0.1", 7000)
    region = Region(GLOBAL_BASE, 4096, RKEY, int(RIGHTS_ALL), 0, (Way(0, 0, 4096),), tag_key=KEY)
    switch = SwitchCore(
        SwitchConfig(vip=vip, nodes=(node,), admin_key=ADMIN, guard=GuardConfig.on()), [region]
    )
    guesser: Endpoint = (CLIENT[0], 5999)

    def send(data: bytes, src: Endpoint = CLIENT) -> list[tuple[bytes, Endpoint]]:
        switch.receive_datagram(data, src, 0.1)
        return switch.datagrams_to_send(0.1)

    for k in range(LOCKOUT_BURST + 5):
        send(encode_packet(read(GLOBAL_BASE, 8, txn=k, rkey=RKEY ^ 1)), guesser)
    assert send(encode_packet(read(GLOBAL_BASE, 8, txn=50))) == []  # the address is locked out
    [(forwarded, to)] = send(seal(KEY, encode_packet(read(GLOBAL_BASE + 64, 8, txn=51))))
    assert to == node and verify(KEY, forwarded) and decode_packet(forwarded).addr == 64
    assert send(seal(bytes(range(1, 17)), encode_packet(read(GLOBAL_BASE, 8, txn=52)))) == []
    malformed = bytearray(seal(KEY, encode_packet(read(GLOBAL_BASE, 8, txn=53))))
    malformed[1] = 0x3F  # no such opcode: a NACK BAD_OPCODE would answer a locked-out address
    assert send(bytes(malformed)) == []
    counters = C.counters_to_dict(switch.counters)
    assert counters["drop_lockout"] >= 3 and counters["lockouts"] == 1
