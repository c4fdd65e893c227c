"""JOIN on a process hosting several NICs (SPEC.md section 3, JOIN): a JOIN of another group
replaces the NIC's group socket, and the process's event loop must watch the new socket even
when it takes the closed one's descriptor number, or an idle NIC never hears the new group (a
torus row's group replaces the cluster's this way, SPEC.md 4.2). A JOIN the node cannot carry
out is refused and changes nothing: the process serves on in the group it had."""

from __future__ import annotations

import socket

import pytest

from netdam import api
from netdam.api import ProcessGroup
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.launch import start_cluster
from netdam.protocol.constants import Opcode, Status
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64

FIRST: Endpoint = ("239.77.201.1", 17123)
SECOND: Endpoint = ("239.77.201.2", 17124)


def _answers(group: Endpoint) -> int:
    """PINGs sent to *group* that an idle NIC answered (INFO) within 0.5 s each: only a socket
    the event loop watches wakes it (nothing else is sent to the process meanwhile)."""
    got = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        sock.settimeout(0.5)
        for txn in range(3):
            sock.sendto(encode_packet(Packet(Opcode.PING, client_id=3, txn_id=txn)), group)
            try:
                reply = decode_packet(sock.recv(65536))
            except TimeoutError:
                continue
            got += reply.opcode == Opcode.INFO
    return got


def _join(client: ControlClient, node: Endpoint, group: Endpoint) -> None:
    client.request(node, Packet(Opcode.JOIN, rkey=client.admin_key, addr=endpoint_to_u64(group)))


def test_an_idle_nic_hears_the_group_that_replaced_its_last() -> None:
    with start_cluster(2, memory=1 << 20, nics_per_process=2) as cluster:
        client = ControlClient.for_cluster(cluster.info)
        node = cluster.info.nodes[0].control_endpoint
        try:
            for group in (FIRST, SECOND):
                _join(client, node, group)  # answered once the socket is open
                assert _answers(group) == 3, group
            assert _answers(FIRST) == 0  # left when SECOND replaced it
        finally:
            client.close()


def test_a_join_whose_port_another_socket_holds_is_refused_and_changes_nothing() -> None:
    """A socket bound to the wildcard address without SO_REUSEADDR (as any socket bound to port
    0 is) holds its port against the node's group socket: the JOIN is NACKed IN_USE, where the
    node process used to exit, and the node stays in its group. A ProcessGroup whose derived
    group port is held says which port and what to do."""
    with start_cluster(2, memory=1 << 20, nics_per_process=2) as cluster:
        client = ControlClient.for_cluster(cluster.info)
        node = cluster.info.nodes[0].control_endpoint
        try:
            _join(client, node, FIRST)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
                holder.bind(("0.0.0.0", SECOND[1]))
                with pytest.raises(ControlError, match="IN_USE") as refused:
                    _join(client, node, SECOND)
                assert refused.value.status == Status.IN_USE
                with pytest.raises(ControlError, match="BAD_FIELD"):
                    _join(client, node, ("127.0.0.9", SECOND[1]))  # no multicast address
                assert _answers(FIRST) == 3  # alive, and still in the group it had

                derived = ProcessGroup(cluster.info, 1, multicast=False)
                group = derived.group
                derived.close()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
                holder.bind(("0.0.0.0", group[1]))
                with pytest.raises(
                    ControlError, match=f"holds UDP port {group[1]}.*multicast=False"
                ):
                    ProcessGroup(cluster.info, 1)
                # It gave its arena back: another job's process may take this rank now.
                assert not api._ARENA_LOCKS
            ProcessGroup(cluster.info, 1).close()  # the port free again: it joins
        finally:
            client.close()
