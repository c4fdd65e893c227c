"""The tags of SPEC.md 2.6 with nothing but the standard library: SipHash-2-4 (the reference of
Aumasson and Bernstein, 2012), the tag of a tagged region's datagram, the control tag of the
admin's control datagrams, and the admin tag key derived from a cluster file. The plain-socket
examples beside this file import it; copy it into a client of your own.
"""

import hashlib
import struct

MASK = (1 << 64) - 1
TAGGED = 0x0020  # SPEC.md 2.1: the flags bit of a datagram that ends with its 8-byte tag


def siphash24(key, data):
    """SipHash-2-4 of *data* under the 16-byte *key*, as an int."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [
        k0 ^ 0x736F6D6570736575,
        k1 ^ 0x646F72616E646F6D,
        k0 ^ 0x6C7967656E657261,
        k1 ^ 0x7465646279746573,
    ]

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


def _covered(body):
    """*body* with segments_left (byte 53) and bytes 56-63 (the return segment a relay
    rewrites) taken as zero."""
    covered = bytearray(body)
    covered[53] = 0
    covered[56:64] = bytes(8)
    return bytes(covered)


def _flagged(datagram):
    flags = struct.unpack_from("!H", datagram, 2)[0] | TAGGED
    return datagram[:2] + struct.pack("!H", flags) + datagram[4:]


def tag_of(key, datagram):
    """A region's tag: over the header and SR list (none in these examples), 8 bytes LE."""
    return siphash24(key, _covered(datagram[:64])).to_bytes(8, "little")


def seal(key, datagram):
    """A region request sealed: TAGGED set, its tag appended."""
    flagged = _flagged(datagram)
    return flagged + tag_of(key, flagged)


def sealed_by(key, datagram):
    """Whether *datagram* ends with its region tag under *key*."""
    return len(datagram) >= 72 and datagram[-8:] == tag_of(key, datagram[:-8])


def control_tag_of(key, body):
    """A control tag (SPEC.md 2.6, "Control tags"): over the whole datagram, payload too."""
    return siphash24(key, _covered(body)).to_bytes(8, "little")


def seal_control(key, datagram):
    """A control request sealed under the admin tag key: TAGGED set, its control tag appended."""
    flagged = _flagged(datagram)
    return flagged + control_tag_of(key, flagged)


def sealed_by_control(key, datagram):
    """Whether *datagram* (an answer to a control request) ends with its control tag."""
    return len(datagram) >= 72 and datagram[-8:] == control_tag_of(key, datagram[:-8])


def admin_tag_key(cluster):
    """The admin tag key of a cluster file (its TOML, parsed; SPEC.md 8.1): the first 16 bytes
    of SHA-256(secret, 0x00, "admin-tag"), the secret being ``group_key`` (32 hex digits), or
    SHA-256 of "name:admin_key" in a hand-written file without one."""
    head = cluster["cluster"]
    if head.get("group_key"):
        secret = bytes.fromhex(head["group_key"])
    else:
        secret = hashlib.sha256(f"{head['name']}:{head['admin_key']}".encode()).digest()
    return hashlib.sha256(secret + b"\x00" + b"admin-tag").digest()[:16]


def tenant_keys(credential):
    """A pool tenant's id and tag key (SPEC.md 11.9, "Tenant tags"), from its 64-bit credential:
    with d = SHA-256 of the credential's 8 bytes (little-endian), the id is the first 4 bytes of
    SHA-256(d, 0x00, "tenant-id") big-endian (0 counts as 1), the key the first 16 bytes of
    SHA-256(d, 0x00, "tenant-tag"). A sealed request carries the id in rkey, the credential
    nowhere."""
    digest = hashlib.sha256(credential.to_bytes(8, "little")).digest()
    tenant = int.from_bytes(hashlib.sha256(digest + b"\x00tenant-id").digest()[:4], "big") or 1
    return tenant, hashlib.sha256(digest + b"\x00tenant-tag").digest()[:16]
