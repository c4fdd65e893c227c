"""A dress rehearsal of the paths a node runs in Python between compiled calls.

numba compiles a kernel for each new combination of argument types. The serve loop's kernels
have one, compiled by ``warm_up``; but the control opcodes (REGISTER, DEREGISTER, the
duplicate window, PING's address token) reach a few kernels from Python, with Python integers,
and each of those needs a specialization of its own. A node that met its first REGISTER before
they existed compiled them then: seconds on a busy machine, while the switch that sent the
REGISTER gave up after 0.6 s and refused the pool's first ALLOC (issue 23).

``rehearse_control_paths()`` runs those paths once on two scratch cores on the in-memory fabric
(none of the caller's state is touched), so that a process is ready before it says so. The test
``test_ready`` checks that nothing a node or switch does afterwards needs another one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from netdam.core.fabric import Fabric
from netdam.core.node import NodeConfig, NodeCore
from netdam.kernels.tag import seal_bytes, seal_control_bytes, verify_bytes, verify_control_bytes
from netdam.protocol.constants import DType, Flags, Opcode, Rights
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet
from netdam.protocol.payloads import Algo, CollectiveDescriptor, pack_key_rights, pack_register

_ADMIN_KEY = 0x5EED1
_NODES: tuple[Endpoint, ...] = (("127.0.0.1", 1), ("127.0.0.1", 2))
_CLIENT: Endpoint = ("127.0.0.1", 3)
_SEALED: Endpoint = ("127.0.0.1", 4)
_MEMORY = 1 << 16


def rehearse_control_paths() -> None:
    """REGISTER, a retried REGISTER, WRITE, READ, FETCH_ADD, PING, COUNTERS, DEREGISTER, a
    tagged START_COLL and a tagged region's REGISTER and sealed WRITE, over the wire with the
    admin key, and a COUNTERS with the admin's control tag, on scratch cores."""
    fabric = Fabric()
    cores = []
    for rank, endpoint in enumerate(_NODES):
        core = NodeCore(
            NodeConfig(
                endpoint=endpoint,
                memory_bytes=_MEMORY,
                admin_key=_ADMIN_KEY,
                members=_NODES,
                rank=rank,
                world_size=len(_NODES),
            )
        )
        fabric.add_core(endpoint, core)
        cores.append(core)
    fabric.add_endpoint(_CLIENT)
    register = Packet(
        Opcode.REGISTER,
        rkey=_ADMIN_KEY,
        addr=0,
        aux_addr=4096,
        length=8,
        client_id=1,
        txn_id=1,
        payload=pack_key_rights(0, int(Rights.READ | Rights.WRITE | Rights.ATOMIC)),
    )
    rkey = 0
    for _attempt in range(2):  # the retry is answered from the duplicate window
        for reply in _exchange(fabric, register):
            rkey = reply.rkey
    requests = [
        Packet(
            Opcode.WRITE,
            flags=Flags.ACK_REQ,
            rkey=rkey,
            addr=64,
            length=8,
            client_id=1,
            txn_id=2,
            payload=bytes(8),
        ),
        Packet(Opcode.READ, rkey=rkey, addr=64, length=8, client_id=1, txn_id=3),
        Packet(
            Opcode.FETCH_ADD,
            rkey=rkey,
            addr=64,
            length=8,
            dtype=DType.U64,
            client_id=1,
            txn_id=4,
            payload=np.uint64(1).tobytes(),
        ),
        Packet(Opcode.PING, client_id=1, txn_id=5),
        Packet(Opcode.COUNTERS, rkey=_ADMIN_KEY, client_id=1, txn_id=6),
        Packet(
            Opcode.DEREGISTER,
            rkey=_ADMIN_KEY,
            length=8,
            client_id=1,
            txn_id=7,
            payload=pack_key_rights(rkey, 0),
        ),
    ]
    for request in requests:
        _exchange(fabric, request)
    # A tagged START_COLL whose buffers no region holds: its NACK is sealed (SPEC.md 2.6), which
    # is the Python path's one call of the compiled seal.
    descriptor = CollectiveDescriptor(
        Algo.ALL_REDUCE, 0, 16, 0, 64, 0x7A9, tag_key=bytes(range(1, 17))
    )
    _exchange(
        fabric,
        Packet(
            Opcode.START_COLL,
            rkey=_ADMIN_KEY,
            coll_id=1,
            epoch=1,
            dtype=DType.F32,
            segments=_NODES,
            client_id=1,
            txn_id=8,
        ).with_payload(descriptor.encode()),
    )
    # A START_COLL that starts (one rank, buffers in a region): the epoch's setup and the
    # local copy are compiled kernels the control plane calls (kernels.collective.begin_epoch,
    # local_part), in this install's cache before a host's first collective.
    [arena] = _exchange(fabric, replace(register, txn_id=12))
    one_rank = CollectiveDescriptor(Algo.ALL_REDUCE, 0, 16, 0, 64, arena.rkey ^ 0x5A5A)
    _exchange(
        fabric,
        Packet(
            Opcode.START_COLL,
            rkey=_ADMIN_KEY,
            coll_id=2,
            epoch=1,
            dtype=DType.F32,
            segments=_NODES[:1],
            client_id=1,
            txn_id=13,
        ).with_payload(one_rank.encode()),
    )
    # A tagged region (SPEC.md 2.6): its REGISTER, and a WRITE sealed and answered as a pool
    # client seals and checks, so the clients' compiled seal and check (kernels.tag.seal_bytes,
    # verify_bytes) are in this install's cache before any client of it runs.
    key = bytes(range(2, 18))
    payload = pack_register(0, int(Rights.READ | Rights.WRITE), key)
    [registered] = _exchange(
        fabric,
        Packet(
            Opcode.REGISTER,
            rkey=_ADMIN_KEY,
            addr=8192,
            aux_addr=4096,
            length=len(payload),
            client_id=1,
            txn_id=9,
            payload=payload,
        ),
    )
    write = Packet(
        Opcode.WRITE,
        flags=Flags.ACK_REQ,
        rkey=registered.rkey,
        addr=8192,
        length=8,
        client_id=1,
        txn_id=10,
        payload=bytes(8),
    )
    fabric.send(_CLIENT, _NODES[0], seal_bytes(key, encode_packet(write)))
    fabric.run_until_idle()
    for data, _ in fabric.receive(_CLIENT):
        verify_bytes(key, data)
    # The admin's control tag (SPEC.md 2.6, "Control tags"): a COUNTERS sealed as ControlClient
    # seals it, to a core given an admin tag key, which checks it and seals its answer, checked
    # as the client checks it (kernels.tag.seal_control_bytes, verify_control_bytes).
    admin_tag_key = bytes(range(3, 19))
    fabric.add_core(
        _SEALED,
        NodeCore(
            NodeConfig(
                endpoint=_SEALED,
                memory_bytes=_MEMORY,
                admin_key=_ADMIN_KEY,
                admin_tag_key=admin_tag_key,
            )
        ),
    )
    counters = encode_packet(Packet(Opcode.COUNTERS, client_id=1, txn_id=11))
    fabric.send(_CLIENT, _SEALED, seal_control_bytes(admin_tag_key, counters))
    fabric.run_until_idle()
    for data, _ in fabric.receive(_CLIENT):
        verify_control_bytes(admin_tag_key, data)


def _exchange(fabric: Fabric, packet: Packet) -> list[Packet]:
    fabric.send(_CLIENT, _NODES[0], encode_packet(packet))
    fabric.run_until_idle()
    return [decode_packet(data) for data, _ in fabric.receive(_CLIENT)]
