"""A NetDAM client with nothing but ``socket`` and ``struct``: REGISTER a region, WRITE, READ it
back, FETCH_ADD a counter. Written from protocol/SPEC.md alone (no netdam imports).

    python examples/plain_socket_client.py --node 127.0.0.1:17744 --admin-key 0x1234

The admin key is in the cluster file ``netdam up`` writes (admin_key = ...).
"""

import argparse
import os
import socket
import struct
import sys

# SPEC.md 2.1: the 64-byte header, network byte order.
HEADER = struct.Struct("!BBHIIIIIIIQQBBBBBBBBIHH")
READ, READ_RESP, WRITE, FETCH_ADD, ACK, NACK, REGISTER = 0x01, 0x02, 0x03, 0x07, 0x0B, 0x0C, 0x20
ACK_REQ = 0x0001
RAW, U64 = 0, 5
RIGHTS_RW_ATOMIC = 0x7
CLIENT_ID = int.from_bytes(os.urandom(4), "big") | 1


def header(opcode, txn, rkey, addr, length, dtype=RAW, flags=0, aux=0):
    # version, opcode, flags, seq, client_id, txn_id, coll_id, epoch, rkey, length, addr,
    # aux_addr, dtype, reduce_op, status, credit, seg_type, segments_left, seg_count, reserved,
    # ret_ip, ret_port, reserved
    return HEADER.pack(1, opcode, flags, 0, CLIENT_ID, txn, 0, 0, rkey, length, addr, aux,
                       dtype, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def call(sock, node, datagram, txn):
    """Send, wait for the reply with our txn id (re-sending the same txn id is safe: SPEC 7)."""
    for _ in range(5):
        sock.sendto(datagram, node)
        try:
            while True:
                reply, _ = sock.recvfrom(65536)
                fields = HEADER.unpack_from(reply)
                if fields[4] == CLIENT_ID and fields[5] == txn:
                    opcode, status, length = fields[1], fields[14], fields[9]
                    if opcode == NACK:
                        sys.exit(f"request {txn} refused: NACK status {status}")
                    return fields, reply[64 : 64 + length]
        except TimeoutError:
            continue
    sys.exit(f"no answer from {node[0]}:{node[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="IP:PORT")
    parser.add_argument("--admin-key", required=True, type=lambda t: int(t, 0))
    args = parser.parse_args()
    host, port = args.node.rsplit(":", 1)
    node = (host, int(port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1.0)

    # REGISTER [0, 4096) with READ|WRITE|ATOMIC; the node picks the rkey (SPEC 6.1).
    body = struct.pack("<II", 0, RIGHTS_RW_ATOMIC)
    fields, _ = call(sock, node, header(REGISTER, 1, args.admin_key, 0, 8, aux=4096) + body, 1)
    rkey = fields[8]
    print(f"registered [0, 4096) as rkey 0x{rkey:08x}")

    data = b"hello, network-attached memory!!"
    call(sock, node, header(WRITE, 2, rkey, 128, len(data), flags=ACK_REQ) + data, 2)
    _, back = call(sock, node, header(READ, 3, rkey, 128, len(data)), 3)
    print(f"wrote and read back {back!r}")
    if back != data:
        sys.exit("READ returned different bytes")

    for txn, expected in ((4, 0), (5, 5)):
        _, old = call(sock, node, header(FETCH_ADD, txn, rkey, 1024, 8, dtype=U64) + struct.pack("<Q", 5), txn)
        value = struct.unpack("<Q", old)[0]
        print(f"FETCH_ADD 5 -> old value {value}")
        if value != expected:
            sys.exit(f"FETCH_ADD returned {value}, expected {expected}")
    print("ok")


if __name__ == "__main__":
    main()
