"""The NetDAM memory pool with nothing but ``socket`` and ``struct``: WRITE, READ back and
FETCH_ADD through the switch's virtual IP. Written from protocol/SPEC.md alone (no netdam imports).

    netdam up --nodes 2 --switch --detach --cluster c.toml
    netdam pool alloc --cluster c.toml --size 64KiB --interleave 8KiB   # prints gaddr and rkey
    python examples/pool_plain_socket.py --vip 127.0.0.1:PORT --gaddr 0x100000000 --rkey 0x...

Requests go to the VIP; replies come straight from the node that holds the data (the switch
wrote our address into the return segment), so the socket must not be connected.
"""

import argparse
import os
import socket
import struct
import sys

# SPEC.md 2.1: the 64-byte header, network byte order.
HEADER = struct.Struct("!BBHIIIIIIIQQBBBBBBBBIHH")
READ, WRITE, FETCH_ADD, NACK = 0x01, 0x03, 0x07, 0x0C
ACK_REQ, RELAYED = 0x0001, 0x0008
RAW, U64 = 0, 5
CLIENT_ID = int.from_bytes(os.urandom(4), "big") | 1


def header(opcode, txn, rkey, addr, length, dtype=RAW, flags=0):
    return HEADER.pack(1, opcode, flags, 0, CLIENT_ID, txn, 0, 0, rkey, length, addr, 0,
                       dtype, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def call(sock, vip, datagram, txn):
    """Send to the VIP, wait for the reply with our txn id from whichever node answers.
    Re-sending the same txn id is safe: a node executes it at most once (SPEC 7)."""
    for _ in range(10):
        sock.sendto(datagram, vip)
        try:
            while True:
                reply, source = sock.recvfrom(65536)
                fields = HEADER.unpack_from(reply)
                if fields[4] == CLIENT_ID and fields[5] == txn:
                    if fields[1] == NACK:
                        sys.exit(f"request {txn} refused: NACK status {fields[14]}")
                    return fields, reply[64 : 64 + fields[9]], source
        except TimeoutError:
            continue
    sys.exit(f"no answer through {vip[0]}:{vip[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vip", required=True, help="IP:PORT of the switch")
    parser.add_argument("--gaddr", required=True, type=lambda t: int(t, 0), help="region's global address")
    parser.add_argument("--rkey", required=True, type=lambda t: int(t, 0))
    args = parser.parse_args()
    host, port = args.vip.rsplit(":", 1)
    vip = (host, int(port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.5)

    data = b"pooled memory, plain socket ok!!"
    _, _, node = call(sock, vip, header(WRITE, 1, args.rkey, args.gaddr, len(data), flags=ACK_REQ) + data, 1)
    fields, back, node = call(sock, vip, header(READ, 2, args.rkey, args.gaddr, len(data)), 2)
    print(f"wrote and read back {back!r} (answered by node {node[0]}:{node[1]}, "
          f"relayed: {bool(fields[2] & RELAYED)})")
    if back != data:
        sys.exit("READ returned different bytes")

    counter = args.gaddr + 64
    start = None
    for txn in (3, 4):
        _, old, _ = call(sock, vip, header(FETCH_ADD, txn, args.rkey, counter, 8, dtype=U64) + struct.pack("<Q", 5), txn)
        value = struct.unpack("<Q", old)[0]
        start = value if start is None else start
        print(f"FETCH_ADD 5 -> old value {value}")
        if value != start + 5 * (txn - 3):
            sys.exit(f"FETCH_ADD returned {value}, expected {start + 5 * (txn - 3)}")
    print("ok")


if __name__ == "__main__":
    main()
