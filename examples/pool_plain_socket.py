"""The NetDAM memory pool with nothing but the standard library (socket, struct, tomllib):
allocate a region, WRITE, READ back, FETCH_ADD, QUERY and FREE it through the switch's virtual
IP. Written from protocol/SPEC.md alone (no netdam imports).

    netdam up --nodes 2 --switch --detach --cluster c.toml
    python examples/pool_plain_socket.py --cluster c.toml

The cluster file (SPEC.md 8.1) gives the VIP and the admin key; ALLOC with the admin key creates
a tenant and hands back its credential (SPEC.md 11.9), which alone then queries and frees the
region. Requests go to the VIP; READ/WRITE/atomic replies come straight from the node that holds
the data (the switch wrote our address into the return segment), so the socket is not connected.

The region is tagged (SPEC.md 2.6): every request carries SipHash-2-4 of its header under the
region's 128-bit key, which ALLOC's answer hands back, and only answers sealed under it are
taken. SipHash is the 30 lines below (the reference of Aumasson and Bernstein).
"""

import argparse
import os
import socket
import struct
import sys

import tomllib

# SPEC.md 2.1: the 64-byte header, network byte order.
HEADER = struct.Struct("!BBHIIIIIIIQQBBBBBBBBIHH")
READ, WRITE, FETCH_ADD, PING, INFO, ACK, NACK = 0x01, 0x03, 0x07, 0x09, 0x0A, 0x0B, 0x0C
ALLOC, FREE, QUERY = 0x26, 0x27, 0x28
ACK_REQ, RELAYED, TAGGED = 0x0001, 0x0008, 0x0020
RAW, U64 = 0, 5
BAD_RKEY, NO_ROUTE = 8, 20
ALLOC_TAGGED = 0x01  # SPEC.md 11.9: ALLOC's flags, bit 0
# SPEC.md 6.4 INFO; 11.9 ALLOC request, region record and one way of it (little-endian).
INFO_PAYLOAD = struct.Struct("<IIQIIII")
ALLOC_REQUEST = struct.Struct("<QQIHBB16s")
REGION = struct.Struct("<QQQIIHBBI16s")
WAY = struct.Struct("<IIQQ")
CLIENT_ID = int.from_bytes(os.urandom(4), "big") | 1
MASK = (1 << 64) - 1


def siphash24(key, data):
    """SipHash-2-4 of *data* under the 16-byte *key*, as an int (SPEC.md 2.6)."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(n):
        for _ in range(n):
            v[0] = (v[0] + v[1]) & MASK
            v[1] = ((v[1] << 13) | (v[1] >> 51)) & MASK ^ v[0]
            v[0] = ((v[0] << 32) | (v[0] >> 32)) & MASK
            v[2] = (v[2] + v[3]) & MASK
            v[3] = ((v[3] << 16) | (v[3] >> 48)) & MASK ^ v[2]
            v[0] = (v[0] + v[3]) & MASK
            v[3] = ((v[3] << 21) | (v[3] >> 43)) & MASK ^ v[0]
            v[2] = (v[2] + v[1]) & MASK
            v[1] = ((v[1] << 17) | (v[1] >> 47)) & MASK ^ v[2]
            v[2] = ((v[2] << 32) | (v[2] >> 32)) & MASK

    tail = len(data) % 8
    last = (len(data) & 0xFF) << 56 | int.from_bytes(data[len(data) - tail :], "little")
    for m in [*struct.unpack_from(f"<{len(data) // 8}Q", data), last]:
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    v[2] ^= 0xFF
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def tag_of(key, datagram):
    """SPEC.md 2.6: the tag covers the header and SR list (none here), with segments_left
    (byte 53) and bytes 56-63 (the return segment a relay rewrites) taken as zero."""
    covered = bytearray(datagram[:64])
    covered[53] = 0
    covered[56:64] = bytes(8)
    return siphash24(key, bytes(covered)).to_bytes(8, "little")


def seal(key, datagram):
    """Set TAGGED and append the tag."""
    flagged = datagram[:2] + struct.pack("!H", struct.unpack_from("!H", datagram, 2)[0] | TAGGED) + datagram[4:]
    return flagged + tag_of(key, flagged)


def sealed_by(key, datagram):
    return len(datagram) >= 72 and datagram[-8:] == tag_of(key, datagram[:-8])


class Refused(Exception):
    def __init__(self, status, text):
        super().__init__(f"NACK status {status} {text!r}")
        self.status = status


def header(opcode, txn, rkey=0, addr=0, length=0, dtype=RAW, flags=0, aux=0):
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


class Client:
    def __init__(self, vip):
        self.vip = vip
        self.txn = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))

    def call(self, opcode, payload=b"", timeout=0.5, tries=8, key=None, **fields):
        """Send to the VIP, wait for the reply with our txn id from whoever answers. Re-sending
        the same txn id is safe: nodes and the switch's allocator execute it at most once
        (SPEC 7, 11.9); the wait doubles on each try (any schedule within the window is correct, SPEC 7).
        With a region's tag *key* the request is sealed and only a sealed answer is taken."""
        self.txn += 1
        datagram = (
            header(opcode, self.txn, length=fields.pop("length", len(payload)), **fields) + payload
        )
        if key is not None:
            datagram = seal(key, datagram)
        for _ in range(tries):
            self.sock.sendto(datagram, self.vip)
            self.sock.settimeout(timeout)
            try:
                while True:
                    reply, source = self.sock.recvfrom(65536)
                    got = HEADER.unpack_from(reply)
                    if got[4] == CLIENT_ID and got[5] == self.txn:
                        if key is not None and not sealed_by(key, reply):
                            continue  # not from a holder of the key: never taken
                        body = reply[64 : 64 + got[9]]
                        if got[1] == NACK:
                            raise Refused(got[14], body.decode(errors="replace"))
                        return got, body, source
            except TimeoutError:
                timeout = min(2 * timeout, 4.0)
        sys.exit(f"no answer through {self.vip[0]}:{self.vip[1]}")


def region_record(body):
    gaddr, size, credential, rkey, stride, ways, rights, flags, _, label = REGION.unpack_from(body)
    backing = [WAY.unpack_from(body, REGION.size + k * WAY.size) for k in range(ways)]
    end = REGION.size + ways * WAY.size
    return {
        "tag_key": body[end : end + 16] if flags & ALLOC_TAGGED else None,
        "gaddr": gaddr,
        "size": size,
        "credential": credential,
        "rkey": rkey,
        "stride": stride,
        "rights": rights,
        "label": label.rstrip(b"\0").decode(),
        "ways": [(n, local, sz) for n, _, local, sz in backing],
    }


def pieces(gaddr, offset, length, stride, limit):
    """Split [offset, offset+length) so no piece crosses a stride boundary (SPEC 11.2)."""
    while length:
        step = min(length, limit, stride - offset % stride if stride else length)
        yield gaddr + offset, offset, step
        offset += step
        length -= step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="cluster file of `netdam up --switch`")
    args = parser.parse_args()
    with open(args.cluster, "rb") as f:
        cluster = tomllib.load(f)
    admin_key = cluster["cluster"]["admin_key"]
    vip = (cluster["switch"]["address"], cluster["switch"]["port"])
    client = Client(vip)

    # PING: INFO tells the MTU, and its aux_addr is our address-validation token (SPEC.md 12.4):
    # READs answered with more than 3x their size must carry it.
    fields, info, _ = client.call(PING)
    token = fields[11]
    version, mtu, mapped, max_payload, _, rank, nodes = INFO_PAYLOAD.unpack(info)
    print(
        f"switch {vip[0]}:{vip[1]}: version {version}, MTU {mtu}, {nodes} nodes, largest payload {max_payload}"
    )

    # ALLOC 64 KiB interleaved with stride 8 KiB over every node, all rights, tagged, for a new
    # tenant.
    request = ALLOC_REQUEST.pack(64 << 10, 0, 8192, 0, 7, ALLOC_TAGGED, b"plain-socket".ljust(16, b"\0"))
    fields, body, _ = client.call(ALLOC, request, rkey=admin_key)
    region = region_record(body)
    gaddr, rkey, credential, stride, key = (
        region["gaddr"],
        region["rkey"],
        region["credential"],
        region["stride"],
        region["tag_key"],
    )
    assert fields[10] == gaddr and fields[8] == rkey, "ACK header names the region"
    print(
        f"ALLOC: gaddr 0x{gaddr:x} rkey 0x{rkey:08x} ways {len(region['ways'])} credential 0x{credential:016x}"
    )

    data = bytes((7 * k) % 251 for k in range(20000))
    for addr, offset, step in pieces(gaddr, 0, len(data), stride, max_payload):
        client.call(WRITE, data[offset : offset + step], rkey=rkey, addr=addr, flags=ACK_REQ, key=key)
    back = bytearray()
    relayed = True
    for addr, _, step in pieces(gaddr, 0, len(data), stride, max_payload):
        got, chunk, _ = client.call(READ, rkey=rkey, addr=addr, length=step, aux=token, key=key)
        relayed &= bool(got[2] & RELAYED)
        back += chunk
    print(f"wrote and read back {len(back)} bytes, relayed: {relayed}")
    if bytes(back) != data:
        sys.exit("READ returned different bytes")

    counter = gaddr + 8192 + 64  # on the second way when there are two nodes
    olds = [
        struct.unpack(
            "<Q",
            client.call(
                FETCH_ADD, struct.pack("<Q", 5), rkey=rkey, addr=counter, length=8, dtype=U64, key=key
            )[1],
        )[0]
        for _ in range(2)
    ]
    print(f"FETCH_ADD 5 twice -> old values {olds}")
    if olds[1] != olds[0] + 5:
        sys.exit("FETCH_ADD did not add")

    # The rkey alone (no tag) opens nothing: BAD_RKEY.
    try:
        client.call(READ, rkey=rkey, addr=gaddr, length=8)
        sys.exit("an unsealed READ of the tagged region succeeded")
    except Refused as exc:
        if exc.status != BAD_RKEY:
            raise
    print("an unsealed READ with the right rkey: BAD_RKEY")

    # The credential alone (rkey 0) queries and frees the tenant's region.
    _, body, _ = client.call(QUERY, struct.pack("<Q", credential), addr=gaddr)
    if region_record(body)["rkey"] != rkey:
        sys.exit("QUERY described another region")
    client.call(FREE, struct.pack("<Q", credential), addr=gaddr)
    try:
        client.call(READ, rkey=rkey, addr=gaddr, length=8)
        sys.exit("READ after FREE succeeded")
    except Refused as exc:
        if exc.status != NO_ROUTE:
            raise
    print(f"FREE: 0x{gaddr:x} is gone (READ answers NO_ROUTE)")
    print("ok")


if __name__ == "__main__":
    main()
