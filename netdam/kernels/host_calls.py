"""A host's per-call datagrams, compiled: its START_COLLs stamped and sealed, and its node's
answers read (``netdam.api``'s calls and waits).

**START_COLLs.** A repeated collective's START_COLLs differ in four fields (the header's
``epoch`` and ``txn_id``, the descriptor's ``rkey`` and tag key: protocol.packet.StartCollTemplate)
and leave sealed with the admin's control tag (SPEC.md 2.6). Written field by field into bytes in
Python and sealed by a second compiled call, that took ~10 us of each rank's call; here one call
writes the four fields, the sealing rkey and the tag (``StartStamper``).

**Answers.** A rank reads two answers per collective, the node's "running" ACK and its completion; in
Python each cost a ``recvfrom`` (and one more that found the socket empty, raising), and
``protocol.packet.read_answer``'s checks: ~20 us an answer in a driver of 4 ranks at 4 KiB,
a quarter of its time (docs/PERFORMANCE.md, "A host's answers read compiled"). Here one
``recvmmsg`` takes every answer waiting, and each is checked by the datapath's own compiled
twin of ``decode_packet`` (``wire.check_packet``, after the tag trailer is set aside as the
datapath does: ``tag.tagged_length``), its fields written to a row for Python's call queue.

The checks are read_answer's (an ACK or NACK, well formed), plus two fields read_answer leaves
unread, dtype and reduce op, which must hold values SPEC.md names: a node writes valid ones.
Tags are not checked here: the call queue checks the answers that decide a call
(core/host.py, ``CallQueue._take``), with the call's key.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from netdam.kernels.dispatch import TypedEntry
from netdam.kernels.state import RxBatch
from netdam.kernels.tag import TAG, seal_control_tag, tagged_length
from netdam.kernels.udp_io import MAX_SEGMENTS_PER_RUN, RUN_BYTES, STATE_LEN, recv_batch_kernel
from netdam.kernels.wire import (
    HDR,
    OP_ACK,
    OP_NACK,
    SEG,
    check_packet,
    copy_bytes,
    put_le32,
    rd32,
    rd64,
    wr32,
)
from netdam.protocol.constants import MAX_PAYLOAD_BYTES, Opcode
from netdam.protocol.layout import (
    D_RKEY,
    DESCRIPTOR_BYTES,
    H_AUX_ADDR,
    H_CLIENT_ID,
    H_EPOCH,
    H_OPCODE,
    H_RKEY,
    H_SEG_COUNT,
    H_STATUS,
    H_TXN_ID,
)
from netdam.protocol.packet import Answer, Packet, StartCollTemplate

#: Bytes of a START_COLL descriptor's tag key (SPEC.md 6.5, "Tag key").
TAG_KEY_BYTES = 16

#: The columns of a row of _read_answers: the answer's fields (A_OPCODE -1: no well-formed
#: answer), where its payload lies in the receive buffer, and the whole datagram's place.
A_OPCODE, A_STATUS, A_CLIENT, A_TXN, A_AUX, A_PAYLOAD, A_PAYLOAD_LEN, A_AT, A_LEN = range(9)
ANSWER_COLUMNS = 9
_U64_MASK = (1 << 64) - 1
#: Datagrams one read takes at most: a rank's answers of a few calls in flight (more wait for
#: the next read, which the caller makes while a read comes back full).
READ_SLOTS = 4


@njit(cache=True, nogil=True)
def _read_answers(fd, rx, rows, max_n, io_state):
    """Receive what waits on *fd* (no wait) into *rx*; row k of *rows* says what datagram k
    is. Returns how many datagrams were taken."""
    n = recv_batch_kernel(fd, rx.buf, rx.off, rx.len, rx.src, max_n, 0, io_state)
    for k in range(n):
        at, ln = rx.off[k], np.int64(rx.len[k])
        b = rx.buf[at : at + ln]
        rows[k, A_OPCODE] = -1
        rows[k, A_AT] = at
        rows[k, A_LEN] = ln
        if ln < HDR:
            continue
        op = np.int64(b[H_OPCODE])
        if op != OP_ACK and op != OP_NACK:
            continue
        body = tagged_length(b, ln)
        if body < 0 or check_packet(b, body, MAX_PAYLOAD_BYTES) != 0:
            continue
        payload = HDR + SEG * np.int64(b[H_SEG_COUNT])
        rows[k, A_OPCODE] = op
        rows[k, A_STATUS] = np.int64(b[H_STATUS])
        rows[k, A_CLIENT] = rd32(b, H_CLIENT_ID)
        rows[k, A_TXN] = rd32(b, H_TXN_ID)
        rows[k, A_AUX] = np.int64(rd64(b, H_AUX_ADDR))
        rows[k, A_PAYLOAD] = at + payload
        rows[k, A_PAYLOAD_LEN] = body - payload
    return n


class AnswerReader:
    """Reads a host socket's waiting answers in one compiled call, into buffers of its own
    (one reader per socket; not shared between threads: callers hold the socket's lock)."""

    def __init__(self) -> None:
        self.rx = RxBatch(
            np.zeros(READ_SLOTS * RUN_BYTES, np.uint8),
            np.zeros(READ_SLOTS * MAX_SEGMENTS_PER_RUN, np.int64),
            np.zeros(READ_SLOTS * MAX_SEGMENTS_PER_RUN, np.int32),
            np.zeros(READ_SLOTS * MAX_SEGMENTS_PER_RUN, np.uint64),
        )
        self.rows = np.zeros((self.rx.off.shape[0], ANSWER_COLUMNS), np.int64)
        self.io_state = np.zeros(STATE_LEN, np.int64)
        self._fields: list[list[int]] = []
        self._read = TypedEntry(_read_answers)

    @property
    def capacity(self) -> int:
        """Datagrams one read takes at most: a read that took this many may have left more."""
        return READ_SLOTS

    def read(self, fd: int) -> int:
        """Take the datagrams waiting on socket *fd* (at most ``capacity``, none: 0); then
        ``answer(k)`` and ``datagram(k)`` for each k below the count returned."""
        if fd < 0:
            raise ValueError(f"read: {fd} is no open socket")
        n = int(self._read(fd, self.rx, self.rows, self.rx.off.shape[0], self.io_state))
        self._fields = self.rows[:n].tolist()
        return n

    def answer(self, k: int) -> Answer | None:
        """Datagram *k* of the last read as read_answer gives it (None: no well-formed ACK or
        NACK)."""
        op, status, client, txn, aux, payload, size, _, _ = self._fields[k]
        if op < 0:
            return None
        payload_bytes = self.rx.buf[payload : payload + size].tobytes()
        # aux_addr is a u64 in an int64 row: its two's complement back to the unsigned field.
        return Answer(op, status, client, txn, aux & _U64_MASK, payload_bytes)

    def datagram(self, k: int) -> bytes:
        """Datagram *k* of the last read, whole (its tag trailer included)."""
        at, size = self._fields[k][A_AT], self._fields[k][A_LEN]
        return self.rx.buf[at : at + size].tobytes()


#: The words of a stamp (_stamp_start's *words*): the template's length and where its
#: descriptor begins, the call's epoch, txn_id and descriptor rkey, and the sealing rkey (-1:
#: not sealed). One array, not six arguments: numba's dispatcher types each argument of every
#: call (~0.4 us apiece).
W_LENGTH, W_PAYLOAD_AT, W_EPOCH, W_TXN, W_RKEY, W_SEAL_RKEY = range(6)


@njit(cache=True, nogil=True)
def _stamp_start(template, out, words, tag_key, seal_key):
    """The START_COLL template into *out* with a call's fields (*words*, the W_ names) and
    *tag_key*, sealed under seal_key (k0, k1) when words[W_SEAL_RKEY] >= 0; its length."""
    n, payload_at = words[W_LENGTH], words[W_PAYLOAD_AT]
    copy_bytes(out, 0, template, 0, n)
    wr32(out, H_EPOCH, words[W_EPOCH])
    wr32(out, H_TXN_ID, words[W_TXN])
    put_le32(out, payload_at + D_RKEY, words[W_RKEY])
    copy_bytes(out, payload_at + DESCRIPTOR_BYTES, tag_key, 0, TAG_KEY_BYTES)
    if words[W_SEAL_RKEY] < 0:
        return n
    wr32(out, H_RKEY, words[W_SEAL_RKEY])
    return seal_control_tag(out, n, seal_key[0], seal_key[1])


class StartStamper:
    """The START_COLLs of one template (a group's repeated call), each stamped with its call's
    fields and sealed as the host's control client seals it (*sealing*: its
    ``ControlClient.sealing`` of the template, None: sent as it is), in one compiled call."""

    def __init__(self, template: StartCollTemplate, sealing: tuple[bytes, int] | None) -> None:
        size = len(template.encoded)
        if size - template.payload_at != DESCRIPTOR_BYTES + TAG_KEY_BYTES:
            raise ValueError("a START_COLL template's payload is a descriptor and its tag key")
        self.template = template
        self._bytes = np.frombuffer(template.encoded, np.uint8)
        self._out = np.zeros(size + TAG, np.uint8)  # room for the tag
        self._words = np.array([size, template.payload_at, 0, 0, 0, -1], np.int64)
        self._seal_key = np.zeros(2, np.uint64)
        self._stamp = TypedEntry(_stamp_start)
        if sealing is not None:
            key, rkey = sealing
            if len(key) != 16 or not 0 <= rkey < 1 << 32:
                raise ValueError("a control tag key is 16 bytes, and an rkey 32 bits")
            self._words[W_SEAL_RKEY] = rkey
            self._seal_key[:] = np.frombuffer(key, "<u8")

    def stamp(self, epoch: int, txn_id: int, rkey: int, tag_key: bytes) -> tuple[Packet, bytes]:
        """The call's START_COLL (StartCollTemplate.moved's Packet) and its datagram as sent."""
        if not (0 <= epoch < 1 << 32 and 0 <= txn_id < 1 << 32 and 0 <= rkey < 1 << 32):
            raise ValueError(f"epoch {epoch}, txn_id {txn_id} and rkey {rkey} are 32-bit fields")
        if len(tag_key) != TAG_KEY_BYTES or not any(tag_key):
            raise ValueError(f"a tag key is {TAG_KEY_BYTES} bytes, not all zero")
        words, out = self._words, self._out
        words[W_EPOCH], words[W_TXN], words[W_RKEY] = epoch, txn_id, rkey
        n = self._stamp(self._bytes, out, words, np.frombuffer(tag_key, np.uint8), self._seal_key)
        payload_at = self.template.payload_at
        payload = out[payload_at : self._bytes.shape[0]].tobytes()
        return self.template.packet_with(epoch, txn_id, payload), out[:n].tobytes()


def warm_host_kernels(fd: int) -> None:
    """Compile (or load from the cache) this module's kernels, reading socket *fd* once (it
    should hold nothing) and stamping a START_COLL: a host's first collective must not pay
    their compile (~20 s cold on 2 cores; netdam.cluster.launch.build_node_kernels)."""
    AnswerReader().read(fd)
    payload = bytes(DESCRIPTOR_BYTES) + b"\x01" * TAG_KEY_BYTES
    template = StartCollTemplate.of(
        Packet(Opcode.START_COLL, rkey=1, length=len(payload), payload=payload)
    )
    StartStamper(template, (b"\x01" * 16, 0)).stamp(1, 1, 1, b"\x01" * TAG_KEY_BYTES)
