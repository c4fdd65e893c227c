"""A NetDAM client with nothing but ``socket`` and ``struct``: REGISTER a region, WRITE, READ it
back, FETCH_ADD a counter, DEREGISTER. Written from protocol/SPEC.md alone (no netdam imports;
SipHash and the control tag are in netdam_tags.py beside it).

    python examples/plain_socket_client.py --node 127.0.0.1:17744 --cluster /tmp/netdam/cluster.toml

REGISTER and DEREGISTER are the admin's: they carry a control tag under the cluster's admin
tag key (SPEC.md 2.6, "Control tags"), derived from the cluster file ``netdam up`` writes (a
file only its owner can read), never from the command line, where every local user would see it
(``ps``); only answers sealed under the same key are taken. The region is the
node's last 4 KiB page (node memory size from PING/INFO): nodes place a pool switch's regions
first fit from the bottom of memory, so that page is the last one the pool takes, and were it
taken the node would answer IN_USE rather than share it. It starts its counter at 0 and
deregisters the region at the end, so it can run any number of times against the same node.
"""

import argparse
import os
import socket
import struct
import sys

import tomllib
from netdam_tags import admin_tag_key, seal_control, sealed_by_control

# SPEC.md 2.1: the 64-byte header, network byte order.
HEADER = struct.Struct("!BBHIIIIIIIQQBBBBBBBBIHH")
READ, READ_RESP, WRITE, FETCH_ADD, PING, ACK, NACK = 0x01, 0x02, 0x03, 0x07, 0x09, 0x0B, 0x0C
REGISTER, DEREGISTER = 0x20, 0x21
# SPEC.md "Status codes": NACKs print by name.
STATUS = [
    "OK",
    "BAD_VERSION",
    "BAD_OPCODE",
    "TRUNCATED",
    "BAD_LENGTH",
    "BAD_DTYPE",
    "BAD_OP",
    "BAD_SEGMENT",
    "BAD_RKEY",
    "NO_RIGHTS",
    "OUT_OF_BOUNDS",
    "MISALIGNED",
    "TOO_LARGE",
    "STALE",
    "NOT_MEMBER",
    "EXISTS",
    "NO_SPACE",
    "UNAUTHORIZED",
    "BAD_FIELD",
    "SPANS_NODES",
    "NO_ROUTE",
    "STALE_EPOCH",
    "BUSY",
    "TIMEOUT",
]
PAGE = 4096
ACK_REQ = 0x0001
RAW, U64 = 0, 5
RIGHTS_RW_ATOMIC = 0x7
CLIENT_ID = int.from_bytes(os.urandom(4), "big") | 1


def header(opcode, txn, rkey, addr, length, dtype=RAW, flags=0, aux=0):
    # version, opcode, flags, seq, client_id, txn_id, coll_id, epoch, rkey, length, addr,
    # aux_addr, dtype, reduce_op, status, credit, seg_type, segments_left, seg_count, reserved,
    # ret_ip, ret_port, reserved
    return HEADER.pack(
        1,
        opcode,
        flags,
        0,
        CLIENT_ID,
        txn,
        0,
        0,
        rkey,
        length,
        addr,
        aux,
        dtype,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    )


def call(sock, node, datagram, txn, admin=None):
    """Send, wait for the reply with our txn id (re-sending the same txn id is safe: SPEC 7).
    With the *admin* tag key the request is sealed and only a sealed answer is taken."""
    if admin is not None:
        datagram = seal_control(admin, datagram)
    for _ in range(5):
        sock.sendto(datagram, node)
        try:
            while True:
                reply, _ = sock.recvfrom(65536)
                fields = HEADER.unpack_from(reply)
                if fields[4] == CLIENT_ID and fields[5] == txn:
                    if admin is not None and not sealed_by_control(admin, reply):
                        continue  # not from a holder of the key: never taken
                    opcode, status, length = fields[1], fields[14], fields[9]
                    if opcode == NACK:
                        name = STATUS[status] if status < len(STATUS) else f"status {status}"
                        sys.exit(f"request {txn} refused: NACK {name}")
                    return fields, reply[64 : 64 + length]
        except TimeoutError:
            continue
    sys.exit(f"no answer from {node[0]}:{node[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="IP:PORT")
    parser.add_argument(
        "--cluster", required=True, help="the cluster file (TOML) `netdam up` wrote"
    )
    args = parser.parse_args()
    try:
        with open(args.cluster, "rb") as f:
            admin = admin_tag_key(tomllib.load(f))
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as exc:
        sys.exit(f"cannot read the cluster's keys from {args.cluster}: {exc}")
    host, port = args.node.rsplit(":", 1)
    node = (host, int(port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1.0)

    # PING: INFO says how big node memory is (SPEC 6.4: memory bytes at payload offset 8).
    _, info = call(sock, node, header(PING, 1, 0, 0, 0), 1)
    memory = struct.unpack_from("<Q", info, 8)[0]
    base = memory - PAGE  # the last page: the pool's last choice (see the docstring)

    # REGISTER [base, base + 4096) with READ|WRITE|ATOMIC; the node picks the rkey (SPEC 6.1).
    body = struct.pack("<II", 0, RIGHTS_RW_ATOMIC)
    fields, _ = call(sock, node, header(REGISTER, 2, 0, base, 8, aux=PAGE) + body, 2, admin)
    rkey = fields[8]
    print(f"registered [0x{base:x}, 0x{base + PAGE:x}) as rkey 0x{rkey:08x}")
    try:
        data = b"hello, network-attached memory!!"
        call(sock, node, header(WRITE, 3, rkey, base + 128, len(data), flags=ACK_REQ) + data, 3)
        _, back = call(sock, node, header(READ, 4, rkey, base + 128, len(data)), 4)
        print(f"wrote and read back {back!r}")
        if back != data:
            sys.exit("READ returned different bytes")

        counter = base + 1024
        zero = struct.pack("<Q", 0)
        call(sock, node, header(WRITE, 5, rkey, counter, 8, flags=ACK_REQ) + zero, 5)  # start at 0
        for txn, expected in ((6, 0), (7, 5)):
            add = header(FETCH_ADD, txn, rkey, counter, 8, dtype=U64) + struct.pack("<Q", 5)
            _, old = call(sock, node, add, txn)
            value = struct.unpack("<Q", old)[0]
            print(f"FETCH_ADD 5 -> old value {value}")
            if value != expected:
                sys.exit(f"FETCH_ADD returned {value}, expected {expected}")
    finally:
        # DEREGISTER (SPEC 6.2): the rkey stops working; the node forgets the region.
        call(sock, node, header(DEREGISTER, 8, 0, 0, 8) + struct.pack("<II", rkey, 0), 8, admin)
    print("deregistered; ok")


if __name__ == "__main__":
    main()
