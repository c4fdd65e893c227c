"""The NetDAM memory pool with nothing but the standard library (socket, struct, tomllib):
allocate a region, WRITE, READ back, FETCH_ADD, QUERY and FREE it through the switch's virtual
IP. Written from protocol/SPEC.md alone (no netdam imports).

    netdam up --nodes 2 --switch --detach --cluster c.toml
    python examples/pool_plain_socket.py --cluster c.toml

The cluster file (SPEC.md 8.1) gives the VIP and the group key; ALLOC as the admin creates
a tenant and hands back its credential (SPEC.md 11.9); the tenant then queries and frees the
region with requests sealed under a key derived from the credential, which itself stays off the
wire. Requests go to the VIP; READ/WRITE/atomic replies come straight from the node that holds
the data (the switch wrote our address into the return segment), so the socket is not connected.

The region is tagged (SPEC.md 2.6): every request carries SipHash-2-4 of its header under the
region's 128-bit key, which ALLOC's answer hands back, and only answers sealed under it are
taken. The admin's ALLOC carries a control tag under the cluster's admin tag key instead of
the admin key. SipHash and both tags are in netdam_tags.py beside this file.
"""

import argparse
import os
import socket
import struct
import sys

import tomllib
from netdam_tags import admin_tag_key, seal, seal_control, sealed_by, sealed_by_control, tenant_keys

# SPEC.md 2.1: the 64-byte header, network byte order.
HEADER = struct.Struct("!BBHIIIIIIIQQBBBBBBBBIHH")
READ, WRITE, FETCH_ADD, PING, INFO, ACK, NACK = 0x01, 0x03, 0x07, 0x09, 0x0A, 0x0B, 0x0C
ALLOC, FREE, QUERY = 0x26, 0x27, 0x28
ACK_REQ, RELAYED = 0x0001, 0x0008
RAW, U64 = 0, 5
BAD_RKEY, NO_ROUTE = 8, 20
ALLOC_TAGGED = 0x01  # SPEC.md 11.9: ALLOC's flags, bit 0
# SPEC.md 6.4 INFO; 11.9 ALLOC request, region record and one way of it (little-endian).
INFO_PAYLOAD = struct.Struct("<IIQIIII")
ALLOC_REQUEST = struct.Struct("<QQIHBB16s")
REGION = struct.Struct("<QQQIIHBBI16s")
WAY = struct.Struct("<IIQQ")
CLIENT_ID = int.from_bytes(os.urandom(4), "big") | 1


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

    def call(self, opcode, payload=b"", timeout=0.5, tries=8, key=None, admin=None, **fields):
        """Send to the VIP, wait for the reply with our txn id from whoever answers. Re-sending
        the same txn id is safe: nodes and the switch's allocator execute it at most once
        (SPEC 7, 11.9); the wait doubles on each try (any schedule within the window is correct, SPEC 7).
        With a region's tag *key* the request is sealed and only a sealed answer is taken; with
        a control tag key (*admin*: the admin tag key, or a tenant's), the same with a control
        tag."""
        self.txn += 1
        datagram = (
            header(opcode, self.txn, length=fields.pop("length", len(payload)), **fields) + payload
        )
        if key is not None:
            datagram = seal(key, datagram)
        if admin is not None:
            datagram = seal_control(admin, datagram)
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
                        if admin is not None and not sealed_by_control(admin, reply):
                            continue
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
    admin = admin_tag_key(cluster)
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
    request = ALLOC_REQUEST.pack(
        64 << 10, 0, 8192, 0, 7, ALLOC_TAGGED, b"plain-socket".ljust(16, b"\0")
    )
    fields, body, _ = client.call(ALLOC, request, admin=admin)
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
        client.call(
            WRITE, data[offset : offset + step], rkey=rkey, addr=addr, flags=ACK_REQ, key=key
        )
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
                FETCH_ADD,
                struct.pack("<Q", 5),
                rkey=rkey,
                addr=counter,
                length=8,
                dtype=U64,
                key=key,
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

    # The tenant queries and frees its region: rkey its id, credential 0 in the payload, a
    # control tag under its tag key (SPEC.md 11.9, "Tenant tags").
    tenant, tenant_key = tenant_keys(credential)
    no_credential = struct.pack("<Q", 0)
    _, body, _ = client.call(QUERY, no_credential, rkey=tenant, addr=gaddr, admin=tenant_key)
    if region_record(body)["rkey"] != rkey:
        sys.exit("QUERY described another region")
    client.call(FREE, no_credential, rkey=tenant, addr=gaddr, admin=tenant_key)
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
