"""JOIN on a process hosting several NICs (SPEC.md section 3, JOIN): a JOIN of another group
replaces the NIC's group socket, and the process's event loop must watch the new socket even
when it takes the closed one's descriptor number, or an idle NIC never hears the new group (a
torus row's group replaces the cluster's this way, SPEC.md 4.2)."""

from __future__ import annotations

import socket
import time

from netdam.cluster.control import ControlClient
from netdam.cluster.launch import start_cluster
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Endpoint, Packet, decode_packet, encode_packet, endpoint_to_u64

FIRST: Endpoint = ("239.77.201.1", 47123)
SECOND: Endpoint = ("239.77.201.2", 47124)


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


def test_an_idle_nic_hears_the_group_that_replaced_its_last() -> None:
    with start_cluster(2, memory=1 << 20, nics_per_process=2) as cluster:
        client = ControlClient.for_cluster(cluster.info)
        node = cluster.info.nodes[0].control_endpoint
        try:
            for group in (FIRST, SECOND):
                client.request(
                    node, Packet(Opcode.JOIN, rkey=client.admin_key, addr=endpoint_to_u64(group))
                )
                time.sleep(0.1)  # the shell opens the socket after the answer
                assert _answers(group) == 3, group
            assert _answers(FIRST) == 0  # left when SECOND replaced it
        finally:
            client.close()
