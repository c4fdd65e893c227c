"""A rank's side of its collectives, sans-I/O: the host's counterpart of ``core/node.py``.

A rank issues calls into lanes (one call of a lane in its NIC at a time, lanes side by side in
the NIC's slots, SPEC.md 4.1). This core decides everything about them that is not I/O: which
START_COLL datagrams go out and when, what each answer of the node means (started, BUSY, moved
past, completed, failed; a completion or NACK only under the call's tag, SPEC.md 2.6), when a
START_COLL the node has not answered is sent again, and when a node silent past the watchdog
fails its call. It reads no socket and no clock: datagrams and ``now`` come in as arguments,
datagrams to send come out. ``netdam.api`` is its shell (the socket, ``time.monotonic()``, the
progress thread, staging and copying), and ``tests/core/test_host_core.py`` drives it on the
in-memory fabric with a hand clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from netdam.kernels.tag import verify_bytes
from netdam.protocol.constants import Opcode, Status
from netdam.protocol.errors import RemoteProtocolError
from netdam.protocol.packet import Answer, Packet, decode_packet, read_answer
from netdam.protocol.payloads import (
    CompletionPhases,
    descriptor_tag_key,
    unpack_completion,
    unpack_completion_phases,
)

#: First and longest wait before asking again a node that answered START_COLL with BUSY (every
#: slot of it runs a collective, likely another job's): doubled per refusal.
BUSY_BACKOFF_S, BUSY_BACKOFF_MAX_S = 0.002, 0.05
#: A START_COLL goes again after this (the node answers every one: "running", or its completion
#: again when that was lost)...
START_RESEND_S = 0.5
#: ...and after this while the last one went unanswered: a live node's answer must not be lost
#: for a whole watchdog. At 30% loss each way a round trip fails half the time, and at one ask
#: per START_RESEND_S 7 failures in a row (0.9%) made a live node look silent for 3.5 s: about
#: one 4-rank run in 10 failed (measured on the in-memory fabric, tests/core/test_host_core.py).
#: At this pace 3.5 s of silence is 30 lost round trips (under 1e-8).
UNANSWERED_RESEND_S = 0.1
#: Seconds past its watchdog that a call waits on a silent node before it fails (the node's own
#: watchdog fails the collective first and says so, when the node is alive).
SILENCE_GRACE_S = 1.0
#: aux_addr of an ACK of START_COLL: 0 "running", 1 the completion (SPEC.md 4.1).
_RUNNING, _COMPLETION = 0, 1


class CallGroup(Protocol):
    """What a call needs of its group: this rank's place in it (for txn ids), the group's epoch
    counter, and the group's keys for an epoch (a call moved past a node's epoch is re-keyed)."""

    rank: int
    epoch: int

    def descriptor_for_epoch(self, packet: Packet, epoch: int) -> Packet: ...


class Heard(Enum):
    """What one answer of the node did to its call."""

    NOTHING = "nothing"  # not this rank's, no call of it, or untagged where a tag is needed
    STARTED = "started"  # the node runs it
    BUSY = "busy"  # every slot of the node is taken: asked again after a backoff
    REBASED = "rebased"  # the node was past this epoch: moved on and sent again
    COMPLETED = "completed"
    FAILED = "failed"  # a NACK from the node (``Call.nack``)


def txn_for(coll_id: int, epoch: int, rank: int) -> int:
    """The txn_id of the START_COLL of *coll_id*'s call *epoch* at group rank *rank*: distinct
    for every group and epoch of this rank, whose answers share one socket."""
    return (coll_id * 1_000_003 + epoch * 7919 + rank) & 0xFFFFFFFF


@dataclass(eq=False)
class Call:
    """One collective of this rank, from issue to its end: its START_COLL and what its node said.
    Times are the ``now`` the owner passed in (the shell's ``time.monotonic()``)."""

    group: CallGroup
    packet: Packet
    watchdog_s: float
    txn: int = 0
    #: The datagram as the encode callable would make it of packet (sealed), when its builder
    #: made it (netdam.kernels.host_calls.StartStamper): sent as it is, not encoded again.
    wire: bytes | None = None
    #: Its START_COLL has left (a call queued behind another of its lane has not), and when
    #: it first left.
    sent: bool = False
    sent_at: float = 0.0
    #: When START_COLL goes again unless the node answered by then.
    resend_at: float = 0.0
    #: START_COLLs sent since the node last answered.
    unanswered: int = 0
    #: When the node last said something of it (or the call was first sent).
    heard_at: float = 0.0
    #: The node ACKed START_COLL (running), as opposed to hearing nothing yet; and when.
    started: bool = False
    started_at: float | None = None
    #: The node answered BUSY: asked again at resend_at. BUSY answers so far.
    refused: bool = False
    busy_answers: int = 0
    backoff_s: float = BUSY_BACKOFF_S
    done: bool = False
    completed_at: float | None = None
    stats: dict[str, int] = field(default_factory=dict)
    node_phases: CompletionPhases | None = None
    #: Why it failed: the node's NACK, or the seconds its node stayed silent.
    nack: Packet | None = None
    silent_s: float | None = None
    #: Queued in its lane's issue order but not to be sent before release() (a step of a
    #: torus all-reduce, which may start only when the step before it ended on this rank).
    held: bool = False
    #: Dropped from its lane unsent (the call it waited for failed): ended, never started.
    cancelled: bool = False

    @property
    def failed(self) -> bool:
        return self.nack is not None or self.silent_s is not None

    @property
    def ended(self) -> bool:
        return self.done or self.failed or self.cancelled

    @property
    def waiting_on_node(self) -> bool:
        """Sent, and the node has not said it runs it (or said BUSY): a re-send will be due."""
        return not self.started or self.refused


class CallQueue:
    """The lanes of one rank and the START_COLLs they send. *encode* turns a packet into the
    datagram this rank sends (the shell seals control opcodes there), for a call whose
    builder did not make it already (Call.wire)."""

    def __init__(self, client_id: int, lanes: int, encode: Callable[[Packet], bytes]) -> None:
        self.client_id = client_id
        self.lanes: list[list[Call]] = [[] for _ in range(lanes)]
        self._encode = encode

    # ---------------------------------------------------------------- what is queued

    def heads(self) -> list[Call]:
        """The call of each lane that is in the node (or on its way there), or held at its
        lane's head until its release."""
        return [lane[0] for lane in self.lanes if lane]

    def _sent_heads(self) -> list[Call]:
        return [lane[0] for lane in self.lanes if lane and lane[0].sent]

    def queued(self) -> bool:
        """Some call waits behind another of its lane."""
        return any(len(lane) > 1 for lane in self.lanes)

    def next_resend(self) -> float | None:
        """When a head's START_COLL is due again (None: every head is running)."""
        return min((h.resend_at for h in self._sent_heads() if h.waiting_on_node), default=None)

    # ---------------------------------------------------------------- inputs

    def issue(self, call: Call, lane: int, now: float) -> list[bytes]:
        """Queue *call* at the end of *lane*; its START_COLL goes now when the lane was empty,
        else when the call before it ends (every call that ends is dropped from its lane at
        once: by receive or tick). A *held* call keeps its place in the lane from now, and goes
        only once released and at the lane's head: a lane's calls reach the node in issue
        order, the same on every rank, whenever the rank's earlier calls end (a torus step
        queued only when the step before it ended here took its place behind calls its
        members issued later, and two ranks could each wait on the other's: SPEC.md 4.2)."""
        self.lanes[lane].append(call)
        return [self._send(call, now)] if len(self.lanes[lane]) == 1 and not call.held else []

    def release(self, call: Call, now: float) -> list[bytes]:
        """*call* may go now: its START_COLL leaves at once when it heads its lane."""
        call.held = False
        return [self._send(call, now)] if any(lane[:1] == [call] for lane in self.lanes) else []

    def cancel(self, call: Call) -> None:
        """Drop a call never sent: it ends here, and the calls behind it in its lane go on
        (advance)."""
        if call.sent:
            raise ValueError("cancel: the call was sent; only the node can end it")
        call.held, call.cancelled = False, True

    def receive(self, data: bytes, now: float) -> tuple[Call | None, Heard, list[bytes]]:
        """One datagram from the node: the call it answers, what it did to it, and what to send
        now (the call again, moved past the node's epoch; the next call of a lane that ended)."""
        return self.receive_answer(read_answer(data), data, now)

    def receive_answer(
        self, reply: Answer | None, data: bytes, now: float
    ) -> tuple[Call | None, Heard, list[bytes]]:
        """receive, for a datagram *data* already read as *reply* (read_answer's, or the same
        read compiled: netdam.kernels.host_calls)."""
        if reply is None or reply.client_id != self.client_id:
            return None, Heard.NOTHING, []
        call = next(
            (c for lane in self.lanes for c in lane if c.sent and c.txn == reply.txn_id), None
        )
        if call is None:
            return None, Heard.NOTHING, []
        heard = self._take(call, reply, data, now)
        out = [self._send(call, now)] if heard is Heard.REBASED else []
        return call, heard, out + self.advance(now)

    def tick(self, now: float, timeout: float | None = None) -> tuple[list[bytes], list[Call]]:
        """Time passed: the START_COLLs due again (lost, its completion lost, or BUSY), and the
        heads whose node stayed silent past their watchdog plus SILENCE_GRACE_S (or *timeout*),
        which fail here."""
        out = []
        silent = []
        for head in self._sent_heads():
            bound = timeout if timeout is not None else head.watchdog_s + SILENCE_GRACE_S
            if now - head.heard_at > bound:
                head.silent_s = bound
                silent.append(head)
            elif now >= head.resend_at:
                out.append(self._send(head, now))
        return out + self.advance(now), silent

    def advance(self, now: float) -> list[bytes]:
        """In every lane, drop the ended calls at the head and send the next one's START_COLL
        (the lane's slot on the node is free now)."""
        out = []
        for lane in self.lanes:
            while lane and lane[0].ended:
                lane.pop(0)
                if lane and not lane[0].held:
                    out.append(self._send(lane[0], now))
        return out

    # ---------------------------------------------------------------- the rules

    def _send(self, call: Call, now: float) -> bytes:
        call.txn = txn_for(int(call.packet.coll_id), int(call.packet.epoch), call.group.rank)
        call.resend_at = now + (UNANSWERED_RESEND_S if call.unanswered else START_RESEND_S)
        call.unanswered += 1
        if not call.sent:
            call.sent, call.sent_at, call.heard_at = True, now, now
        packet, wire = call.packet, call.wire
        if packet.client_id != self.client_id or packet.txn_id != call.txn:
            # (A caller that builds its START_COLL with these ids saves the copy: ~11 us.)
            packet, wire = replace(packet, client_id=self.client_id, txn_id=call.txn), None
        return wire if wire is not None else self._encode(packet)

    def _take(self, call: Call, reply: Answer, data: bytes, now: float) -> Heard:
        # What can end or fail the wait (a completion, a NACK) must carry this call's tag
        # (SPEC.md 2.6); a plain "started" ACK only keeps the wait alive, so it is not
        # checked (the check is compiled, but the ACK is most of what a host reads).
        decides = reply.opcode == Opcode.NACK or reply.aux_addr != _RUNNING
        key = descriptor_tag_key(call.packet.payload) if decides else b""
        if key and not verify_bytes(key, data):
            return (
                Heard.NOTHING
            )  # not from a holder of this collective's key: the nodes count those
        call.heard_at = now
        call.unanswered = 0
        if reply.opcode == Opcode.NACK and reply.status == Status.STALE_EPOCH:
            # The node already ran epoch aux_addr of this cluster's collectives (the group is
            # new: it counts from 1). Every rank's node ran the same collectives, so every rank
            # moves to the same epoch without talking to the others.
            epoch = max(call.group.epoch, reply.aux_addr + 1)
            call.group.epoch = epoch
            call.packet, call.wire = call.group.descriptor_for_epoch(call.packet, epoch), None
            return Heard.REBASED
        if reply.opcode == Opcode.NACK and reply.status == Status.BUSY:
            # Every slot of the node runs a collective (other jobs'): not a failure, ask again
            # after a backoff that doubles per refusal.
            call.refused = True
            call.busy_answers += 1
            call.resend_at = now + call.backoff_s
            call.backoff_s = min(2 * call.backoff_s, BUSY_BACKOFF_MAX_S)
            return Heard.BUSY
        if reply.opcode == Opcode.NACK:
            try:
                call.nack = decode_packet(data)  # the whole of it, for the error's text
            except RemoteProtocolError:
                return Heard.NOTHING  # a field read_answer does not read is malformed
            return Heard.FAILED
        if reply.aux_addr == _RUNNING:
            call.started = True
            call.refused = False
            call.started_at = call.started_at or now
            return Heard.STARTED
        if reply.aux_addr != _COMPLETION:
            return Heard.NOTHING
        retransmits, reads = unpack_completion(reply.payload)
        call.stats = {"retransmits": retransmits, "repair_reads": reads}
        call.done = True
        call.completed_at = now
        call.started_at = call.started_at or now  # its "running" ACK may come later, or never
        call.started = True
        call.node_phases = unpack_completion_phases(reply.payload)
        return Heard.COMPLETED
