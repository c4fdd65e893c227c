"""The compiled half of the ring-host baseline (``netdam.clients.ring_host``): the headers of one
segment's WRITE datagrams, and where each one's payload lies in the source buffer, for
``udp_io.send_gather`` to send header and payload together with no copy between (as a RoCE NIC's
DMA engine reads a registered buffer for an RDMA WRITE). The header comes from a template the
client encodes once with ``protocol.packet.encode_packet``; only ``txn_id``, ``length`` and
``addr`` change per datagram.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.wire import HDR, OP_ACK, copy_bytes, wr32, wr64
from netdam.protocol.layout import H_ADDR, H_LENGTH, H_OPCODE, H_TXN_ID


@njit(cache=True, nogil=True)
def _write_headers(template, src, dst_addr, nbytes, per_packet, txn0, heads, body_off, body_len):
    """The headers of the WRITEs of [src, src + nbytes) of the source buffer to dst_addr.., in
    datagrams of per_packet payload bytes; returns how many. Header k goes to heads[k * HDR:],
    its payload's place in the source to body_off[k], body_len[k] (the send gathers them)."""
    n = 0
    done = 0
    while done < nbytes:
        length = min(per_packet, nbytes - done)
        pos = n * HDR
        copy_bytes(heads, pos, template, 0, HDR)
        wr32(heads[pos:], H_TXN_ID, (txn0 + n) & 0xFFFFFFFF)
        wr32(heads[pos:], H_LENGTH, length)
        wr64(heads[pos:], H_ADDR, dst_addr + done)
        body_off[n] = src + done
        body_len[n] = length
        done += length
        n += 1
    return n


def write_headers(
    template: np.ndarray,
    source_bytes: int,
    src: int,
    dst_addr: int,
    nbytes: int,
    per_packet: int,
    txn0: int,
    heads: np.ndarray,
    body_off: np.ndarray,
    body_len: np.ndarray,
) -> int:
    """Checked entry to _write_headers: the segment inside the source (*source_bytes* long),
    room for every header, the arrays the gather send takes (uint8 headers, int64 offsets,
    int32 lengths)."""
    if template.dtype != np.uint8 or template.shape[0] < HDR:
        raise ValueError(f"the header template must be at least {HDR} uint8 bytes")
    if heads.dtype != np.uint8 or body_off.dtype != np.int64 or body_len.dtype != np.int32:
        raise ValueError("write_headers takes uint8 headers, int64 offsets, int32 lengths")
    if per_packet <= 0 or nbytes < 0 or src < 0 or dst_addr < 0 or src + nbytes > source_bytes:
        raise ValueError(f"segment [{src}, {src + nbytes}) outside the source or bad packet size")
    count = -(-nbytes // per_packet)
    if count > min(body_off.shape[0], body_len.shape[0]) or count * HDR > heads.shape[0]:
        raise ValueError(f"{count} datagrams do not fit the header arrays")
    return int(
        _write_headers(
            template,
            np.int64(src),
            np.int64(dst_addr),
            np.int64(nbytes),
            np.int64(per_packet),
            np.int64(txn0),
            heads,
            body_off,
            body_len,
        )
    )


@njit(cache=True, nogil=True)
def _sort_replies(rx_len, n, rx, rx_off, rx_src, node, others):
    """Count the ACKs among n received datagrams that came from *node* (the next node's
    address, as udp_io gives sources); the indices of every other datagram go to *others* for
    Python (NACKs, the hosts' step words, and anything from anyone else, which it drops).
    Returns (acks, n_others)."""
    acks = 0
    m = 0
    for k in range(n):
        if rx_src[k] == node and rx_len[k] >= HDR and rx[rx_off[k] + H_OPCODE] == OP_ACK:
            acks += 1
        else:
            others[m] = k
            m += 1
    return acks, m


def sort_replies(
    rx: np.ndarray,
    rx_off: np.ndarray,
    rx_len: np.ndarray,
    rx_src: np.ndarray,
    n: int,
    node: int,
    others: np.ndarray,
) -> tuple[int, int]:
    """Checked entry to _sort_replies (the receive arrays recv_batch filled)."""
    if not 0 <= n <= min(rx_off.shape[0], rx_len.shape[0], rx_src.shape[0], others.shape[0]):
        raise ValueError(f"{n} datagrams exceed the receive arrays")
    if n and int((rx_off[:n] + rx_len[:n]).max()) > rx.shape[0]:
        raise ValueError("a datagram reaches past the receive buffer")
    acks, m = _sort_replies(rx_len, np.int64(n), rx, rx_off, rx_src, np.uint64(node), others)
    return int(acks), int(m)
