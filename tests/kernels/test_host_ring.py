"""The ring-host baseline's compiled half (netdam/kernels/host_ring.py): WRITE headers and where
each payload lies, for the gather send."""

from __future__ import annotations

import numpy as np
import pytest

from netdam.kernels.host_ring import write_headers
from netdam.protocol.constants import HEADER_SIZE, DType, Flags, Opcode
from netdam.protocol.packet import Packet, decode_packet, encode_packet


def _template() -> np.ndarray:
    head = encode_packet(
        Packet(
            Opcode.WRITE,
            flags=Flags.ACK_REQ,
            rkey=0x1234,
            dtype=DType.F32,
            length=4,
            payload=bytes(4),
        )
    )
    return np.frombuffer(head, np.uint8)[:HEADER_SIZE].copy()


def test_headers_name_each_payload_and_its_place() -> None:
    """2500 bytes from source offset 100 in payloads of 1024: three WRITEs, the last shorter,
    each header the template with its own txn_id, length and address."""
    heads = np.zeros(4 * HEADER_SIZE, np.uint8)
    off, length = np.zeros(4, np.int64), np.zeros(4, np.int32)
    count = write_headers(_template(), 4096, 100, 0x8000, 2500, 1024, 7, heads, off, length)
    assert count == 3
    assert list(off[:3]) == [100, 1124, 2148] and list(length[:3]) == [1024, 1024, 452]
    source = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
    for k in range(3):
        datagram = (
            heads[k * HEADER_SIZE : (k + 1) * HEADER_SIZE].tobytes()
            + source[off[k] : off[k] + length[k]].tobytes()
        )
        packet = decode_packet(datagram)
        assert (packet.opcode, packet.rkey, packet.flags) == (Opcode.WRITE, 0x1234, Flags.ACK_REQ)
        assert (packet.txn_id, packet.length, packet.addr) == (7 + k, length[k], 0x8000 + 1024 * k)


def test_headers_are_refused_past_the_source_or_their_arrays() -> None:
    heads = np.zeros(2 * HEADER_SIZE, np.uint8)
    off, length = np.zeros(2, np.int64), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="outside the source"):
        write_headers(_template(), 1000, 900, 0, 200, 1024, 0, heads, off, length)
    with pytest.raises(ValueError, match="do not fit"):
        write_headers(_template(), 4096, 0, 0, 3000, 1024, 0, heads, off, length)
    with pytest.raises(ValueError, match="int64 offsets"):
        write_headers(_template(), 4096, 0, 0, 100, 1024, 0, heads, off.astype(np.int32), length)
