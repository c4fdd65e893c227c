"""Tags (SPEC.md 2.6): SipHash-2-4 against the reference vectors, the compiled tag against the
plain-Python one, the codec's trailer, and the sealed datagram's checks."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.kernels.tag import seal, tag_ok
from netdam.protocol.constants import (
    HEADER_SIZE,
    SEGMENT_SIZE,
    TAG_SIZE,
    DType,
    Flags,
    Opcode,
    Status,
)
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.layout import HEADER
from netdam.protocol.packet import Packet, decode_packet, encode_packet
from netdam.protocol.payloads import (
    Algo,
    CollectiveDescriptor,
    descriptor_tag_key,
    unpack_descriptor,
)
from netdam.protocol.tag import seal as py_seal
from netdam.protocol.tag import siphash24, tag_of
from netdam.protocol.tag import verify as py_verify

#: SipHash-2-4 outputs (bytes as written) for key 00..0f and messages 00, 00 01, ..., 00..3e:
#: the reference implementation's vectors.h (Aumasson and Bernstein, github.com/veorq/SipHash).
SIPHASH24_VECTORS = (
    "310e0edd47db6f72",
    "fd67dc93c539f874",
    "5a4fa9d909806c0d",
    "2d7efbd796666785",
    "b7877127e09427cf",
    "8da699cd64557618",
    "cee3fe586e46c9cb",
    "37d1018bf50002ab",
    "6224939a79f5f593",
    "b0e4a90bdf82009e",
    "f3b9dd94c5bb5d7a",
    "a7ad6b22462fb3f4",
    "fbe50e86bc8f1e75",
    "903d84c02756ea14",
    "eef27a8e90ca23f7",
    "e545be4961ca29a1",
    "db9bc2577fcc2a3f",
    "9447be2cf5e99a69",
    "9cd38d96f0b3c14b",
    "bd6179a71dc96dbb",
    "98eea21af25cd6be",
    "c7673b2eb0cbf2d0",
    "883ea3e395675393",
    "c8ce5ccd8c030ca8",
    "94af49f6c650adb8",
    "eab8858ade92e1bc",
    "f315bb5bb835d817",
    "adcf6b0763612e2f",
    "a5c91da7acaa4dde",
    "716595876650a2a6",
    "28ef495c53a387ad",
    "42c341d8fa92d832",
    "ce7cf2722f512771",
    "e37859f94623f3a7",
    "381205bb1ab0e012",
    "ae97a10fd434e015",
    "b4a31508beff4d31",
    "81396229f0907902",
    "4d0cf49ee5d4dcca",
    "5c73336a76d8bf9a",
    "d0a704536ba93e0e",
    "925958fcd6420cad",
    "a915c29bc8067318",
    "952b79f3bc0aa6d4",
    "f21df2e41d4535f9",
    "87577519048f53a9",
    "10a56cf5dfcd9adb",
    "eb75095ccd986cd0",
    "51a9cb9ecba312e6",
    "96afadfc2ce666c7",
    "72fe52975a4364ee",
    "5a1645b276d592a1",
    "b274cb8ebf87870a",
    "6f9bb4203de7b381",
    "eaecb2a30b22a87f",
    "9924a43cc1315724",
    "bd838d3aafbf8db7",
    "0b1a2a3265d51aea",
    "135079a3231ce660",
    "932b2846e4d70666",
    "e1915f5cb1eca46c",
    "f325965ca16d629f",
    "575ff28e60381be5",
    "724506eb4c328a95",
)
KEY = bytes(range(16))


def test_siphash_matches_all_64_reference_vectors() -> None:
    for n, expected in enumerate(SIPHASH24_VECTORS):
        assert siphash24(KEY, bytes(range(n))).to_bytes(8, "little").hex() == expected, n


def chain_add(hops: int, payload: bytes = b"\x01" * 32) -> Packet:
    segments = tuple(("127.0.0.1", 7000 + h) for h in range(hops))
    return Packet(
        Opcode.CHAIN_ADD,
        seq=5,
        coll_id=3,
        epoch=9,
        rkey=0x1234,
        addr=64,
        aux_addr=4096,
        dtype=DType.F32,
        segments=segments,
    ).with_payload(payload)


@pytest.mark.parametrize("hops", [0, 1, 3, 63])
def test_compiled_tag_equals_the_reference(hops: int, rng: np.random.Generator) -> None:
    """The datapath's seal writes what protocol.tag computes, for every SR list length."""
    packet = (
        chain_add(hops)
        if hops
        else Packet(Opcode.ALL_WRITE, coll_id=3, epoch=2).with_payload(b"\x07" * 24)
    )
    data = encode_packet(packet)
    for _ in range(4):
        key = rng.bytes(16)
        buf = np.zeros(len(data) + TAG_SIZE, np.uint8)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        n = seal(buf, len(data), key)
        assert n == len(data) + TAG_SIZE
        assert buf.tobytes() == py_seal(key, data)
        assert tag_ok(buf, key) and py_verify(key, buf.tobytes())


def test_the_tag_covers_header_and_route_not_payload(rng: np.random.Generator) -> None:
    """Any bit flipped in the header or the SR list breaks the tag, but for what a relay
    rewrites (segments_left, the return segment); the payload is not covered (SPEC.md 12.1 says
    what that leaves open)."""
    key = rng.bytes(16)
    sealed = bytearray(py_seal(key, encode_packet(chain_add(3))))
    covered = HEADER_SIZE + 3 * SEGMENT_SIZE
    relays_rewrite = {HEADER.at("segments_left"), *range(HEADER.at("ret_ip"), HEADER_SIZE)}
    for byte in range(covered):
        for bit in (0, 7):
            forged = bytearray(sealed)
            forged[byte] ^= 1 << bit
            if byte in (2, 3) and not int.from_bytes(forged[2:4], "big") & Flags.TAGGED:
                continue  # the flag itself cleared: not a tagged datagram at all
            holds = byte in relays_rewrite
            assert py_verify(key, bytes(forged)) == holds, (byte, bit)
            assert tag_ok(np.frombuffer(bytes(forged), np.uint8).copy(), key) == holds, (byte, bit)
    other_payload = bytearray(sealed)
    other_payload[covered] ^= 0xFF
    assert py_verify(key, bytes(other_payload))
    assert not py_verify(rng.bytes(16), bytes(sealed))


def test_the_codec_reads_and_writes_the_trailer(rng: np.random.Generator) -> None:
    key = rng.bytes(16)
    data = py_seal(key, encode_packet(chain_add(2, b"\x02" * 16)))
    packet = decode_packet(data)
    assert packet.flags & Flags.TAGGED and packet.payload == b"\x02" * 16
    assert packet.tag == tag_of(key, data)
    assert encode_packet(packet) == data
    with pytest.raises(RemoteProtocolError) as exc:
        decode_packet(data[: HEADER_SIZE + 2 * SEGMENT_SIZE + 4])
    assert exc.value.status == Status.TRUNCATED


def test_a_descriptor_carries_its_tag_key() -> None:
    desc = CollectiveDescriptor(Algo.ALL_REDUCE, 1, 100, 0, 4096, 0x55, tag_key=KEY)
    payload = desc.encode()
    assert len(payload) == 80 and descriptor_tag_key(payload) == KEY
    assert unpack_descriptor(payload).tag_key == KEY
    plain = CollectiveDescriptor(Algo.ALL_REDUCE, 1, 100, 0, 4096, 0x55).encode()
    assert len(plain) == 64 and descriptor_tag_key(plain) == b""
    with pytest.raises(RemoteProtocolError) as exc:
        unpack_descriptor(plain + bytes(16))
    assert exc.value.status == Status.BAD_FIELD
    with pytest.raises(ValueError):
        CollectiveDescriptor(Algo.ALL_REDUCE, 1, 100, 0, 4096, 0x55, tag_key=b"short")


def test_seal_wrapper_refuses_what_the_kernel_would_overrun() -> None:
    data = np.zeros(HEADER_SIZE, np.uint8)
    with pytest.raises(ValueError):
        seal(data, HEADER_SIZE, KEY)  # no room for the tag
    with pytest.raises(ValueError):
        seal(np.zeros(200, np.uint8), HEADER_SIZE, b"short")
