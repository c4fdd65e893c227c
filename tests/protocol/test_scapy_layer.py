"""The scapy layer is a second opinion on the codec: same bytes, same field values, both ways."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("scapy")

from scapy.layers.inet import IP, UDP  # noqa: E402
from scapy.packet import NoPayload, Raw  # noqa: E402

from netdam.protocol.constants import NETDAM_UDP_PORT, TAG_SIZE, Flags, Opcode, Status  # noqa: E402
from netdam.protocol.errors import RemoteProtocolError  # noqa: E402
from netdam.protocol.fixtures import FIXTURE_NAMES, load_fixture  # noqa: E402
from netdam.protocol.packet import Packet, decode_packet, encode_packet  # noqa: E402
from netdam.protocol.scapy_layer import NetDAM, NetDAMSegment, packet_tag, payload_elements  # noqa: E402

CLIENT, NODE = "10.0.0.100", "10.0.0.1"


def codec_fields(packet: Packet) -> dict[str, Any]:
    """The codec's view, in the scapy layer's field names and plain ints."""
    return {
        "version": packet.version,
        "opcode": int(packet.opcode),
        "flags": int(packet.flags),
        "seq": packet.seq,
        "client_id": packet.client_id,
        "txn_id": packet.txn_id,
        "coll_id": packet.coll_id,
        "epoch": packet.epoch,
        "rkey": packet.rkey,
        "length": packet.length,
        "addr": packet.addr,
        "aux_addr": packet.aux_addr,
        "dtype": int(packet.dtype),
        "reduce_op": int(packet.reduce_op),
        "status": int(packet.status),
        "credit": packet.credit,
        "seg_type": int(packet.seg_type),
        "segments_left": packet.segments_left,
        "seg_count": len(packet.segments),
        "reserved1": 0,
        "ret_ip": packet.ret[0],
        "ret_port": packet.ret[1],
        "reserved2": 0,
        "segments": list(packet.segments),
        "payload": packet.payload,
        "tag": packet.tag,
    }


def scapy_fields(layer: NetDAM) -> dict[str, Any]:
    fields = {
        name: layer.getfieldval(name)
        for name in codec_fields(Packet(Opcode.PING))
        if name not in ("segments", "payload", "tag")
    }
    fields["flags"] = int(fields["flags"])
    fields["segments"] = [(s.ip, s.port) for s in layer.segments]
    assert all(s.reserved == 0 for s in layer.segments)
    fields["payload"] = bytes(layer.payload)
    fields["tag"] = packet_tag(layer) or 0
    if fields["flags"] & Flags.TAGGED:
        fields["payload"] = fields["payload"][:-TAG_SIZE]  # the tag (SPEC.md 2.6), kept as Padding
    return fields


def build_from_codec(packet: Packet) -> NetDAM:
    """A scapy packet with the codec's values; seg_count, seg_type and length left to post_build."""
    kwargs = codec_fields(packet)
    for computed in ("seg_count", "seg_type", "length", "segments", "payload", "tag"):
        del kwargs[computed]
    if packet.length != len(packet.payload):  # READ: length is the size asked for, not sent
        kwargs["length"] = packet.length
    segments = [NetDAMSegment(ip=ip, port=port) for ip, port in packet.segments]
    layer = NetDAM(segments=segments, **kwargs)
    trailer = packet.tag.to_bytes(TAG_SIZE, "little") if packet.flags & Flags.TAGGED else b""
    return layer / Raw(packet.payload + trailer) if packet.payload or trailer else layer


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_scapy_dissects_fixture_like_the_codec(name: str) -> None:
    data = load_fixture(name)
    layer = NetDAM(data)
    assert scapy_fields(layer) == codec_fields(decode_packet(data))
    # The payload after the header and SR list stays Raw (nothing is bound above NetDAM).
    assert isinstance(layer.payload, Raw if len(data) > 64 + 8 * layer.seg_count else NoPayload)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_scapy_builds_fixture_bytes(name: str) -> None:
    data = load_fixture(name)
    assert bytes(build_from_codec(decode_packet(data))) == data
    # Rebuilding a dissected packet changes nothing either.
    assert bytes(NetDAM(data)) == data


def test_enum_names_are_the_codec_names() -> None:
    built = NetDAM(
        opcode="CHAIN_ADD",
        flags="ACK_REQ+RELAYED",
        dtype="F16",
        reduce_op="MAX",
        status="OUT_OF_BOUNDS",
        segments=[NetDAMSegment(ip="10.0.0.2")],
    )
    packet = NetDAM(bytes(built))
    assert packet.sprintf("%opcode% %dtype% %reduce_op% %status% %seg_type%") == (
        "CHAIN_ADD F16 MAX OUT_OF_BOUNDS IPV4"
    )
    assert int(packet.flags) == 0x0009
    assert packet.flags.ACK_REQ and packet.flags.RELAYED and not packet.flags.MCAST


def test_post_build_fills_counts_type_and_length() -> None:
    hops = [NetDAMSegment(ip=f"10.0.0.{i}") for i in (2, 3, 4)]
    chain = NetDAM(bytes(NetDAM(opcode="CHAIN_ADD", dtype="F32", segments=hops) / Raw(bytes(16))))
    assert (chain.seg_count, chain.seg_type, chain.length) == (3, 1, 16)
    assert [s.port for s in chain.segments] == [NETDAM_UDP_PORT] * 3
    ping = NetDAM(bytes(NetDAM(opcode="PING")))
    assert (ping.seg_count, ping.seg_type, ping.length) == (0, 0, 0)


def test_explicit_values_survive_post_build() -> None:
    # The layer validates nothing, so it can build what the codec must refuse.
    data = bytes(NetDAM(opcode="PING", seg_type=2, length=5))
    assert (data[52], int.from_bytes(data[28:32], "big")) == (2, 5)
    with pytest.raises(RemoteProtocolError, match=r"^segment type 2 \(IPv6\) is reserved in v1$"):
        decode_packet(data)


@pytest.mark.parametrize(
    ("reply_name", "request_name"), [("read_resp", "read"), ("info", "ping"), ("ack", "fetch_add")]
)
def test_reply_answers_its_request(reply_name: str, request_name: str) -> None:
    reply, request = NetDAM(load_fixture(reply_name)), NetDAM(load_fixture(request_name))
    assert reply.answers(request)
    assert reply.hashret() == request.hashret()
    assert not request.answers(reply)  # replies are never answered
    other = NetDAM(load_fixture(request_name))
    other.txn_id += 1
    assert not reply.answers(other)
    assert reply.hashret() != other.hashret()


def test_nack_answers_any_request_with_its_ids() -> None:
    nack = NetDAM(load_fixture("nack"))
    read = decode_packet(load_fixture("read"))
    request = NetDAM(encode_packet(replace(read, txn_id=109, addr=0xF_FFF0, length=64)))
    assert nack.answers(request)
    assert nack.status == Status.OUT_OF_BOUNDS


def test_read_resp_does_not_answer_a_write_with_the_same_ids() -> None:
    write = decode_packet(load_fixture("write"))
    same_ids = NetDAM(encode_packet(replace(write, txn_id=101)))
    assert not NetDAM(load_fixture("read_resp")).answers(same_ids)


def test_ip_udp_stack_round_trips_and_binds_on_port_7744() -> None:
    request = (
        IP(src=CLIENT, dst=NODE)
        / UDP(sport=50000, dport=NETDAM_UDP_PORT)
        / NetDAM(load_fixture("chain_add"))
    )
    parsed = IP(bytes(request))
    assert parsed.haslayer(NetDAM)
    assert scapy_fields(parsed[NetDAM]) == scapy_fields(NetDAM(load_fixture("chain_add")))
    assert bytes(parsed[UDP].payload) == load_fixture("chain_add")
    # Replies come *from* 7744 to the client's port: bound too.
    reply = IP(
        bytes(
            IP(src=NODE, dst=CLIENT)
            / UDP(sport=NETDAM_UDP_PORT, dport=50000)
            / NetDAM(load_fixture("read_resp"))
        )
    )
    assert reply.haslayer(NetDAM)
    read = IP(
        bytes(
            IP(src=CLIENT, dst=NODE)
            / UDP(sport=50000, dport=NETDAM_UDP_PORT)
            / NetDAM(load_fixture("read"))
        )
    )
    assert reply.answers(read)
    # Other ports stay Raw.
    elsewhere = IP(bytes(IP() / UDP(sport=5000, dport=5001) / Raw(load_fixture("ping"))))
    assert not elsewhere.haslayer(NetDAM)


def test_udp_over_netdam_defaults_to_port_7744() -> None:
    udp = UDP(bytes(UDP() / NetDAM(opcode="PING")))
    assert (udp.sport, udp.dport) == (NETDAM_UDP_PORT, NETDAM_UDP_PORT)
    assert udp[NetDAM].opcode == Opcode.PING


def test_payload_elements_by_dtype() -> None:
    np.testing.assert_array_equal(
        payload_elements(NetDAM(load_fixture("chain_add"))),
        np.array([0.125, -1.5, 2.75, 100.0], dtype="<f4"),
    )
    f16 = payload_elements(IP() / UDP() / NetDAM(load_fixture("all_write")))
    assert f16.dtype == np.dtype("<f2")
    assert f16.tolist() == [1.0, -0.5, 65504.0, 2.0**-14]
    assert payload_elements(NetDAM(load_fixture("ack"))).tolist() == [41]
    assert payload_elements(NetDAM(load_fixture("ping"))).size == 0
    with pytest.raises(
        ValueError, match="^payload of 3 bytes is not a multiple of the f32 element size 4$"
    ):
        payload_elements(NetDAM(dtype="F32") / Raw(b"abc"))
    with pytest.raises(ValueError, match="^packet has no NetDAM layer$"):
        payload_elements(IP() / UDP(dport=53))


def test_summary_names_the_opcode() -> None:
    assert (
        NetDAM(load_fixture("chain_add")).mysummary() == "NetDAM CHAIN_ADD client=7 txn=104 seq=3"
    )
    assert NetDAM(load_fixture("nack")).mysummary().endswith(" OUT_OF_BOUNDS")


def test_pool_control_payloads_dissect_like_the_codec() -> None:
    from netdam.protocol.payloads import unpack_alloc, unpack_credential, unpack_region_info
    from netdam.protocol.scapy_layer import (
        NetDAMAlloc,
        NetDAMCredential,
        NetDAMRegion,
        pool_payload,
    )

    alloc = NetDAM(load_fixture("alloc"))
    assert alloc.mysummary() == "NetDAM ALLOC client=7 txn=116 seq=0"
    layer = pool_payload(alloc)
    want = unpack_alloc(decode_packet(load_fixture("alloc")).payload)
    assert isinstance(layer, NetDAMAlloc)
    assert (
        layer.size,
        layer.credential,
        layer.stride,
        layer.ways,
        int(layer.rights),
        layer.label.rstrip(b"\0"),
    ) == (want.size, want.credential, want.stride, want.ways, want.rights, want.label.encode())
    for name in ("free", "query"):
        cred = pool_payload(IP() / UDP() / NetDAM(load_fixture(name)))
        assert isinstance(cred, NetDAMCredential)
        assert cred.credential == unpack_credential(decode_packet(load_fixture(name)).payload)
    region = pool_payload(NetDAM(load_fixture("alloc_ack")), request=alloc)
    info = unpack_region_info(decode_packet(load_fixture("alloc_ack")).payload)
    assert isinstance(region, NetDAMRegion)
    assert (
        region.gaddr,
        region.size,
        region.credential,
        region.rkey,
        region.stride,
        region.ways,
    ) == (info.gaddr, info.size, info.credential, info.rkey, info.stride, len(info.ways))
    assert [(w.node, w.local, w.size) for w in region.way_list] == [
        (w.node, w.local, w.size) for w in info.ways
    ]
    # Built from fields, the layers give the fixture's bytes back.
    assert bytes(region) == decode_packet(load_fixture("alloc_ack")).payload
    assert bytes(layer) == decode_packet(load_fixture("alloc")).payload
    with pytest.raises(ValueError, match="READ carries no pool-control payload"):
        pool_payload(NetDAM(load_fixture("read")))
